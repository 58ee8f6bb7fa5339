"""torch.distributed's device library inside a host (or between hosts): a ProcessGroup
of the level's ranks (ProcessGroupNCCL, which is RCCL in ROCm builds of torch; gloo on
CPUs and in CI).  It moves bytes, so every dtype goes through it; its reductions are
hoccl's (``FoldingEngine``), so they agree with every other engine's."""

from __future__ import annotations

import datetime
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .._errors import AbortedError, HocclTimeoutError, InvalidArgumentError
from .arrays import torch_stream
from .engine import Pair, Setup
from .folding import FoldingEngine

__all__ = ["TorchGroupEngine", "torch_groups"]


def torch_groups(call: str, setup_rank: int, world_size: int,
                 groups: Sequence[Sequence[int]]) -> List[Any]:
    """``dist.new_group`` of every group in ``groups`` (every rank of the default group
    must make them, in the same order, as torch requires), after checking that
    torch.distributed is initialised on the same world."""
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None  # type: ignore[assignment]
    if dist is None or not dist.is_available() or not dist.is_initialized() \
            or dist.get_world_size() != world_size or dist.get_rank() != setup_rank:
        raise InvalidArgumentError(
            f"{call}: the torch engine (intra_host='torch' on some host) needs "
            f"torch.distributed initialised on the same world on every rank (rank "
            f"{setup_rank} of {world_size}): call dist.init_process_group first")
    return [dist.new_group(list(group)) for group in groups]


class TorchGroupEngine(FoldingEngine):
    """The collectives of one torch.distributed group, on byte views of the caller's
    arrays (numpy arrays and torch tensors; on a GPU enqueued on the caller's stream).
    Each step is torch's asynchronous form, waited for at most ``timeout`` seconds: a
    step that ends so leaves the group in torch's hands, and the engine takes no more
    calls.  Reductions: ``FoldingEngine`` (hoccl's rule)."""

    name = "torch"

    def __init__(self, group: Any, members: Sequence[int], timeout: float, label: str):
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.group = torch, dist, group
        self.members = list(members)
        self.size = len(self.members)
        self.member = self.members.index(dist.get_rank())
        self.timeout, self.label = timeout, label
        self._broken = ""
        self._token: Any = None

    @classmethod
    def connect(cls, setup: Setup) -> Tuple["TorchGroupEngine", "TorchGroupEngine"]:
        """Rails and world over torch.distributed (an engine between hosts)."""
        topology, rank = setup.topology, setup.bootstrap.rank
        rails = torch_groups(setup.call, rank, topology.world_size, topology.groups("rail"))
        local = topology.local_of(rank)
        label = describe_backend(rails[local])
        return (cls(rails[local], topology.groups("rail")[local], setup.host.timeout, label),
                cls(None, range(topology.world_size), setup.host.timeout, label))

    # -- bytes -------------------------------------------------------------------------
    def _bytes(self, array: Any) -> Any:
        """A flat uint8 tensor over ``array``'s memory (None stays None)."""
        if array is None:
            return None
        if isinstance(array, np.ndarray):
            return self.torch.from_numpy(array.reshape(-1).view(np.uint8))
        return array.reshape(-1).view(self.torch.uint8)

    def _run(self, what: str, stream: Optional[int], body: Callable, *arrays: Any) -> None:
        """``body`` on byte tensors, on the caller's stream, then wait for its work."""
        if self._broken:
            raise AbortedError(f"{what} ({self.label}): the engine takes no more calls: "
                               f"{self._broken}")
        tensors = [self._bytes(array) for array in arrays]
        if stream is not None:
            with self.torch.cuda.stream(torch_stream(self.torch, stream)):
                work = body(*tensors)
        else:
            work = body(*tensors)
        try:
            for each in work if isinstance(work, list) else [work]:
                each.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as error:
            self._broken = f"{what} did not finish: {error}"
            raise HocclTimeoutError(
                f"{what} ({self.label}, member {self.member} of {self.size}): not finished "
                f"within {self.timeout:g} s, or failed: {error}; the group is torch's to "
                f"recover, so this engine takes no more calls") from None

    # -- the copies --------------------------------------------------------------------
    def _global(self, member: int) -> int:
        return self.members[member]

    def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        gather = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        self._run("all_gather", stream, lambda s, r: gather(r, s, group=self.group,
                                                            async_op=True), send, recv)

    def all_to_all(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self._run("all_to_all", stream, lambda s, r: self.dist.all_to_all_single(
            r, s, group=self.group, async_op=True), send, recv)

    def broadcast(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        def body(s: Any, r: Any) -> Any:
            if s is not None and s.data_ptr() != r.data_ptr():
                r.copy_(s)
            return self.dist.broadcast(r, src=self._global(root), group=self.group,
                                       async_op=True)
        self._run("broadcast", stream, body, send, recv)

    def gather(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        def body(s: Any, r: Any) -> Any:
            parts = list(r.chunk(self.size)) if r is not None else None
            return self.dist.gather(s, gather_list=parts, dst=self._global(root),
                                    group=self.group, async_op=True)
        self._run("gather", stream, body, send, recv if self.member == root else None)

    def scatter(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        def body(s: Any, r: Any) -> Any:
            parts = list(s.chunk(self.size)) if s is not None else None
            return self.dist.scatter(r, scatter_list=parts, src=self._global(root),
                                     group=self.group, async_op=True)
        self._run("scatter", stream, body, send if self.member == root else None, recv)

    def send(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        self._run("send", stream, lambda b: self.dist.isend(b, dst=self._global(peer),
                                                            group=self.group), buf)

    def recv(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        self._run("recv", stream, lambda b: self.dist.irecv(b, src=self._global(peer),
                                                            group=self.group), buf)

    def batch(self, pairs: Sequence[Pair], *, stream: Any = None) -> None:
        """Every pair posted (``isend``/``irecv``) before any is waited for."""
        def body(*tensors: Any) -> List[Any]:
            return [self.dist.isend(tensor, dst=self._global(peer), group=self.group)
                    if kind == "send" else
                    self.dist.irecv(tensor, src=self._global(peer), group=self.group)
                    for (kind, _, peer), tensor in zip(pairs, tensors)]
        if pairs:
            self._run("send/recv batch", stream, body, *[array for _, array, _ in pairs])

    def barrier(self, *, stream: Any = None) -> None:
        """A one-byte all_gather: every member reaches it before any leaves."""
        if self._token is None:
            device = "cpu" if stream is None else "cuda"
            self._token = (self.torch.zeros(1, dtype=self.torch.uint8, device=device),
                           self.torch.zeros(self.size, dtype=self.torch.uint8, device=device))
        self.all_gather(*self._token, stream=stream)

    def probe(self, device: str) -> None:
        """Find the collectives the group cannot run on ``device`` ("cpu", "cuda"): each
        on a few bytes, every member at once (a backend refuses a device type before it
        communicates, so every member finds the same); sets ``lacks``."""
        torch, size = self.torch, self.size
        lacks = []
        for primitive in ("all_gather", "all_to_all", "broadcast", "gather", "scatter"):
            small = torch.zeros(1, dtype=torch.uint8, device=device)
            large = torch.zeros(size, dtype=torch.uint8, device=device)
            send, recv = {"all_gather": (small, large), "all_to_all": (large, large),
                          "broadcast": (None, small), "gather": (small, large),
                          "scatter": (large, small)}[primitive]
            try:
                if primitive == "broadcast":
                    self.broadcast(None, recv, 0)
                else:
                    getattr(self, primitive)(send, recv, *((0,) if primitive in (
                        "gather", "scatter") else ()))
            except (RuntimeError, HocclTimeoutError, AbortedError) as error:
                lacks.append((primitive, str(error).splitlines()[0][:200]))
                self._broken = ""  # a refusal before any byte moved leaves the group usable
        self.lacks = tuple(lacks)

    def abort(self, reason: str = "") -> None:
        """torch.distributed groups are the application's: later calls are refused."""
        self._broken = self._broken or (reason or "abort() was called")

    def close(self) -> None:
        """torch.distributed groups are the application's: left as they are."""


def describe_backend(group: Any) -> str:
    """"torch (gloo)", "torch (nccl)"...: the label of a group's engine."""
    import torch.distributed as dist
    return f"torch ({dist.get_backend(group)})"
