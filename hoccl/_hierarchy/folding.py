"""Reductions that agree across device kinds: hoccl's rule, and engines that follow it by
moving data with their library and reducing it themselves.

The rule (every engine of a hierarchical call follows it, so that every rank gets the
same bits whichever devices and libraries took part):

* a reduction *step* (one reduce_scatter, all_reduce or reduce of one level) folds its
  inputs in member order, ``acc = op(acc, x[i])`` for i = 0, 1, ... of the level's
  group, whoever owns the result;
* float16 and bfloat16 accumulate in float32, every other type in its own precision
  (integers wrap); each ``+``/``*`` is one IEEE operation rounded to nearest;
* the step rounds once, to the storage type (to nearest even), at its end;
* the steps themselves come in the plan's order: a host's sum of its local ranks
  (local rank order), then the hosts' sums (host order), then "avg"'s one division
  (``hoccl.sched.hierarchical``).

hoccl's own backends reduce by this rule already (``hoccl.testing`` says how: the
plans fold inputs in rank order, the CUDA kernel in a float32 accumulator, the host
backend with ``reduce_into``: ``reduce_arrays``' bits, a block at a time).  A library whose reductions run in an order of its own
(NCCL's rings and trees, gloo's, MPI's ``Op`` applied pairwise) cannot be made to agree,
so the engines over them (``TorchGroupEngine``, ``StagedEngine``) move the inputs with
the library and ``fold`` them here: numpy's ``reduce_into`` on host arrays, the same
operations in torch (or cupy) on device arrays.  NCCL between all-NVIDIA hosts keeps
NCCL's own reductions (``NcclEngine``): every rank still gets the same bits, but not
those of this rule.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ..config import host_threads
from .._dtypes import numpy_dtype, reduce_into
from .arrays import Arrays
from .engine import InterHostEngine

__all__ = ["fold", "FoldingEngine"]


def _to_numpy(array: Any) -> np.ndarray:
    """A numpy view of a host array of any framework (torch's bfloat16 through int16)."""
    if isinstance(array, np.ndarray):
        return array
    import torch
    if array.dtype == torch.bfloat16:
        return array.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return array.numpy()


def _in_host_memory(kit: Arrays, array: Any) -> bool:
    return kit.kind == "numpy" or (kit.kind == "torch" and array.device.type == "cpu")


def fold(parts: Sequence[Any], out: Any, op: str, stream: Optional[int] = None) -> None:
    """``out[...] = op over parts`` by hoccl's rule (the module docstring); ``parts`` and
    ``out`` are flat arrays of one framework, on one device, of ``out``'s dtype.  Work on a
    device is enqueued on ``stream`` (a raw handle)."""
    kit = Arrays.of(out)
    if _in_host_memory(kit, out):
        host = _to_numpy(out)
        reduce_into(host, [_to_numpy(part) for part in parts], op, threads=host_threads())
        return
    with kit.on_stream(stream, out):
        _fold_on_device(kit.kind, parts, out, op)


def _fold_on_device(kind: str, parts: Sequence[Any], out: Any, op: str) -> None:
    """``fold``'s operations in torch or cupy, on the current stream."""
    if kind == "torch":
        import torch
        wide = torch.float32 if out.dtype in (torch.float16, torch.bfloat16) else out.dtype
        acc = parts[0].to(wide, copy=True)
        combine = {"sum": torch.Tensor.add_, "prod": torch.Tensor.mul_,
                   "max": lambda a, x: torch.maximum(a, x, out=a),
                   "min": lambda a, x: torch.minimum(a, x, out=a)}[op]
        for part in parts[1:]:
            combine(acc, part.to(wide))
        out.copy_(acc)
        return
    import cupy
    wide = cupy.float32 if out.dtype.itemsize == 2 and out.dtype.kind in "fV" else out.dtype
    acc = parts[0].astype(wide, copy=True)
    function = {"sum": cupy.add, "prod": cupy.multiply, "max": cupy.maximum,
                "min": cupy.minimum}[op]
    for part in parts[1:]:
        function(acc, part.astype(wide, copy=False), out=acc)
    out[...] = acc.astype(out.dtype)


class FoldingEngine(InterHostEngine):
    """An engine whose library moves the data and whose reductions follow hoccl's rule:
    ``reduce_scatter`` is an ``all_to_all`` and a fold, ``all_reduce`` a reduce_scatter
    of the part that divides evenly and an ``all_gather`` (the rest: an all_gather and a
    fold), ``reduce`` a ``gather`` and a fold at the root.  A subclass gives the copies
    (``all_gather``, ``all_to_all``, ``gather``...), ``size`` and ``member`` (its group's
    size and this rank's number in it), and ``scratch`` and ``folding`` (where scratch
    comes from and how a fold is ordered on the caller's stream)."""

    size: int
    member: int

    @classmethod
    def primitives(cls, collective: str) -> Tuple[str, ...]:
        return {"reduce_scatter": ("all_to_all",), "all_reduce": ("all_to_all", "all_gather"),
                "reduce": ("gather",), "barrier": ("all_gather",),
                "sendrecv": ("send", "recv")}.get(collective, (collective,))

    #: host scratch, reused: a step on host arrays is done with its scratch when it
    #: returns (its transfers waited for, its fold computed), and a fresh 128 MiB array
    #: costs its page faults (20-40 ms) at every call
    _host_bytes: Optional[np.ndarray] = None

    @staticmethod
    def host_scratch(nbytes: int) -> np.ndarray:
        """``nbytes`` of host memory for ``scratch``."""
        return np.empty(nbytes, np.uint8)

    def scratch(self, like: Any, count: int, stream: Optional[int]) -> Any:
        """``count`` elements of ``like``'s dtype, where ``like`` lives."""
        kit = Arrays.of(like)
        if not _in_host_memory(kit, like):
            return kit.empty(like, count, stream)
        nbytes = count * _to_numpy(like).dtype.itemsize
        if self._host_bytes is None or self._host_bytes.nbytes < nbytes:
            self._host_bytes = self.host_scratch(nbytes)
        if kit.kind == "numpy":
            return self._host_bytes[:nbytes].view(like.dtype)
        import torch
        return torch.from_numpy(self._host_bytes[:nbytes]).view(like.dtype)

    def folding(self, parts: Sequence[Any], out: Any, op: str, stream: Optional[int]) -> None:
        """``fold`` ordered on ``stream`` (the caller's, on a device)."""
        fold(parts, out, op, stream)

    def reduce_scatter(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None:
        count = recv.shape[0]
        if not count:
            return
        received = self.scratch(send, self.size * count, stream)
        self.folding(self.exchanged(send, received, count, stream), recv, op, stream)

    def exchanged(self, send: Any, received: Any, count: int, stream: Optional[int]) -> list:
        """reduce_scatter's inputs: ``all_to_all(send, received)``, cut into the members'
        blocks of ``count`` (an engine may hand its own block from ``send`` instead)."""
        self.all_to_all(send, received, stream=stream)
        return [received[i * count:(i + 1) * count] for i in range(self.size)]

    def all_reduce(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None:
        count, size = recv.shape[0], self.size
        shard, rest = divmod(count, size)
        main = shard * size
        if shard:
            mine = recv[self.member * shard:(self.member + 1) * shard]
            self.reduce_scatter(send[:main], mine, op, stream=stream)
            self.all_gather(mine, recv[:main], stream=stream)
        if rest:
            everyone = self.scratch(send, size * rest, stream)
            self.all_gather(send[main:], everyone, stream=stream)
            self.folding([everyone[i * rest:(i + 1) * rest] for i in range(size)],
                         recv[main:], op, stream)

    def reduce(self, send: Any, recv: Any, root: int, op: str, *, stream: Any = None) -> None:
        count = send.shape[0]
        if not count:
            return
        everyone = self.scratch(send, self.size * count, stream) if self.member == root else None
        self.gather(send, everyone, root, stream=stream)
        if everyone is not None:
            self.folding([everyone[i * count:(i + 1) * count] for i in range(self.size)], recv,
                         op, stream)
