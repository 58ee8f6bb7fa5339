"""NCCL between hosts: nccl4py, or torch.distributed's NCCL groups where nccl4py is
missing; CUDA buffers, every step enqueued on the caller's stream."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence, Tuple

from ..config import environ
from .._errors import InvalidArgumentError
from .arrays import torch_stream
from .engine import InterHostEngine, Pair, Setup

__all__ = ["NcclEngine", "Nccl4pyEngine", "TorchNcclEngine"]


class NcclEngine(InterHostEngine):
    """NCCL on the cuda backend: ``connect`` picks the binding, ``Nccl4pyEngine`` or
    ``TorchNcclEngine`` (``HOCCL_NCCL_BINDING=torch`` forces torch.distributed)."""

    name = "nccl"
    enqueues = True

    @classmethod
    def check_world(cls, call: str, backends: List[str], hostnames: List[str]) -> None:
        others = sorted(set(backends) - {"cuda"})
        if others:
            raise InvalidArgumentError(f"{call}: inter_host='nccl' needs the cuda backend on "
                                       f"every rank; this world also uses {others} (use 'mpi' "
                                       f"or 'gloo')")

    @classmethod
    def connect(cls, setup: Setup) -> Tuple["NcclEngine", "NcclEngine"]:
        """nccl4py when it imports (a world communicator from a unique id swapped through
        the bootstrap, split into rails), else torch.distributed when it is initialised
        with the same world."""
        call, bootstrap, topology = setup.call, setup.bootstrap, setup.topology
        device = setup.device
        assert device is not None  # nccl needs the cuda backend, which picked a GPU
        rank = bootstrap.rank
        host, local = topology.host_of(rank), topology.local_of(rank)
        binding = environ("HOCCL_NCCL_BINDING") or ""
        try:
            if binding == "torch":
                raise ImportError("HOCCL_NCCL_BINDING=torch")
            import nccl.core as nccl
        except ImportError:
            nccl = None
        if nccl is not None:
            from cuda.core import Device as CudaCoreDevice
            CudaCoreDevice(device).set_current()
            uid = bootstrap.allgather(bytes(nccl.get_unique_id()) if rank == 0 else None)[0]
            world = nccl.Communicator.init(topology.world_size, rank,
                                           nccl.UniqueId.from_bytes(uid))
            rail = world.split(color=local, key=host)
            label = f"nccl (nccl4py {getattr(nccl, '__version__', '?')})"
            return Nccl4pyEngine(rail, label, device), Nccl4pyEngine(world, label, device)
        try:
            import torch.distributed as dist
        except ImportError:
            dist = None  # type: ignore[assignment]
        if dist is None or not dist.is_initialized() or dist.get_backend() != "nccl" \
                or dist.get_world_size() != topology.world_size or dist.get_rank() != rank:
            raise InvalidArgumentError(
                f"{call}: inter_host='nccl' needs nccl4py (pip install nccl4py) or "
                f"torch.distributed initialised with the NCCL backend on the same world (rank "
                f"{rank} of {topology.world_size}); or pass inter_host='mpi'")
        import torch
        torch.cuda.set_device(device)
        rails = [dist.new_group(list(topology.groups("rail")[l])) for l in range(topology.local_size)]
        label = f"nccl (torch.distributed {torch.__version__})"
        return (TorchNcclEngine(rails[local], topology.groups("rail")[local], label),
                TorchNcclEngine(None, range(topology.world_size), label))


class Nccl4pyEngine(NcclEngine):
    """Collectives of an nccl4py communicator, enqueued on the caller's stream."""

    def __init__(self, comm: Any, label: str, device: int):
        import nccl.core as nccl
        self.nccl, self.comm, self.label, self.device = nccl, comm, label, device
        self._ops = {"sum": nccl.NcclRedOp.SUM, "prod": nccl.NcclRedOp.PROD,
                     "max": nccl.NcclRedOp.MAX, "min": nccl.NcclRedOp.MIN}
        self._token: Any = None

    def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self.comm.allgather(send, recv, stream=stream)

    def reduce_scatter(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None:
        self.comm.reduce_scatter(send, recv, self._ops[op], stream=stream)

    def all_reduce(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None:
        self.comm.allreduce(send, recv, self._ops[op], stream=stream)

    def all_to_all(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self.comm.alltoall(send, recv, stream=stream)

    def broadcast(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        self.comm.broadcast(send, recv, root, stream=stream)

    def reduce(self, send: Any, recv: Any, root: int, op: str, *, stream: Any = None) -> None:
        self.comm.reduce(send, recv, self._ops[op], root=root, stream=stream)

    def gather(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        self.comm.gather(send, recv, root=root, stream=stream)

    def scatter(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        self.comm.scatter(send, recv, root, stream=stream)

    def send(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        self.comm.send(buf, peer, stream=stream)

    def recv(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        self.comm.recv(buf, peer, stream=stream)

    def batch(self, pairs: Sequence[Pair], *, stream: Any = None) -> None:
        """The pairs inside one NCCL group (``ncclGroupStart``/``ncclGroupEnd``)."""
        with self.nccl.group():
            for kind, array, peer in pairs:
                getattr(self.comm, kind)(array, peer, stream=stream)

    def barrier(self, *, stream: Any = None) -> None:
        """An all_reduce of one element: every member's stream reaches it first."""
        if self._token is None:
            self._token = _device_token(self.device)
        self.comm.allreduce(self._token, self._token, self._ops["sum"], stream=stream)

    def abort(self, reason: str = "") -> None:
        self.comm.abort()

    def close(self) -> None:
        self.comm.destroy()


class TorchNcclEngine(NcclEngine):
    """Collectives of a torch.distributed NCCL group, on the caller's stream (torch's
    ``Work.wait()`` makes the current stream wait; the host never blocks)."""

    def __init__(self, group: Any, members: Sequence[int], label: str):
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.group = torch, dist, group
        self.members, self.label = list(members), label
        self._ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
                     "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        self._token: Any = None

    def _tensor(self, array: Any) -> Any:
        if array is None or isinstance(array, self.torch.Tensor):
            return array
        return self.torch.as_tensor(array, device="cuda")

    def _run(self, stream: Any, body: Callable, *arrays: Any) -> None:
        tensors = [self._tensor(array) for array in arrays]
        with self.torch.cuda.stream(torch_stream(self.torch, int(stream))):
            body(*tensors)

    def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self._run(stream, lambda s, r: self.dist.all_gather_into_tensor(r, s, group=self.group),
                  send, recv)

    def reduce_scatter(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None:
        self._run(stream, lambda s, r: self.dist.reduce_scatter_tensor(
            r, s, op=self._ops[op], group=self.group), send, recv)

    def all_reduce(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None:
        def body(s, r):
            if s.data_ptr() != r.data_ptr():
                r.copy_(s)
            self.dist.all_reduce(r, op=self._ops[op], group=self.group)
        self._run(stream, body, send, recv)

    def all_to_all(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self._run(stream, lambda s, r: self.dist.all_to_all_single(r, s, group=self.group),
                  send, recv)

    def broadcast(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        def body(s, r):
            if s is not None and s.data_ptr() != r.data_ptr():
                r.copy_(s)
            self.dist.broadcast(r, src=self.members[root], group=self.group)
        self._run(stream, body, send, recv)

    def reduce(self, send: Any, recv: Any, root: int, op: str, *, stream: Any = None) -> None:
        def body(s, r):
            target = s
            if r is not None:
                if s.data_ptr() != r.data_ptr():
                    r.copy_(s)
                target = r
            self.dist.reduce(target, dst=self.members[root], op=self._ops[op], group=self.group)
        self._run(stream, body, send, recv)

    def gather(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        def body(s, r):
            parts = list(r.chunk(len(self.members))) if r is not None else None
            self.dist.gather(s, gather_list=parts, dst=self.members[root], group=self.group)
        self._run(stream, body, send, recv)

    def scatter(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        def body(s, r):
            parts = list(s.chunk(len(self.members))) if s is not None else None
            self.dist.scatter(r, scatter_list=parts, src=self.members[root], group=self.group)
        self._run(stream, body, send, recv)

    def send(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        self._run(stream, lambda b: self.dist.send(b, dst=self.members[peer], group=self.group),
                  buf)

    def recv(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        self._run(stream, lambda b: self.dist.recv(b, src=self.members[peer], group=self.group),
                  buf)

    def batch(self, pairs: Sequence[Pair], *, stream: Any = None) -> None:
        """The pairs as one ``batch_isend_irecv`` of the group (one NCCL group)."""
        if not pairs:
            return

        def body(*tensors: Any) -> None:
            operations = [self.dist.P2POp(self.dist.isend if kind == "send" else
                                          self.dist.irecv, tensor, self.members[peer],
                                          group=self.group)
                          for (kind, _, peer), tensor in zip(pairs, tensors)]
            for work in self.dist.batch_isend_irecv(operations):
                work.wait()
        self._run(stream, body, *[array for _, array, _ in pairs])

    def barrier(self, *, stream: Any = None) -> None:
        if self._token is None:
            self._token = self.torch.zeros(1, device="cuda")
        self._run(stream, lambda t: self.dist.all_reduce(t, group=self.group), self._token)

    def abort(self, reason: str = "") -> None:
        """torch.distributed groups are the application's: left as they are."""

    def close(self) -> None:
        """torch.distributed groups are the application's: left as they are."""


def _device_token(device: int) -> Any:
    """One float32 element on GPU ``device`` (cupy, else torch): a barrier's payload."""
    try:
        import cupy
        with cupy.cuda.Device(device):
            return cupy.zeros(1, cupy.float32)
    except ImportError:
        import torch
        return torch.zeros(1, device=f"cuda:{device}")
