"""A communicator across hosts: hoccl inside each host, an existing engine between hosts.

``hoccl.init()`` on a world that spans several hosts (or, with ``local_size=k`` /
``HOCCL_LOCAL_SIZE=k``, on simulated hosts of k consecutive ranks) returns a
``HierarchicalCommunicator``: the same API and argument checks as ``Communicator``
(it is one), whose calls run the phases of ``hoccl.sched.hierarchical`` plans:

* ``"host"`` calls on a hoccl communicator of the rank's host (built by ``init``'s
  single-host path over a ``SubBootstrap`` of the host's ranks): zero SMs for data;
* ``"rail"`` calls on the inter-host engine among the ranks with this local rank;
* ``"world"`` send/recv on the engine over all ranks;
* ``"local"`` steps (avg's division) on the rank's arrays.

Engines (``inter_host=``): ``"nccl"`` (nccl4py, or torch.distributed when it is
initialised with NCCL; CUDA buffers, enqueued on the caller's stream), ``"mpi"``
(mpi4py; device buffers are staged through host memory, so each MPI step waits on the
host for the work before it), and ``"hoccl"`` (hoccl communicators over the rails:
simulated hosts on one machine only).

Ordering.  On the cuda backend with NCCL every phase is enqueued on the caller's stream,
in order: a call returns without waiting for the GPU, like a single-host call.  On the
host backend (and for MPI steps) a call runs its phases one after the other and returns
when they are done (each phase's communicator is synchronised before the next phase
reads what it wrote), so ``stream`` must be None there.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ._buffers import Buffer, as_buffer
from .backends._caller_stream import array_framework
from ._dtypes import numpy_dtype, reduce_arrays
from ._errors import AbortedError, HocclError, HocclTimeoutError, InvalidArgumentError
from ._mailbox import wait_until
from .bootstrap import Bootstrap, MPIBootstrap
from .comm import Communicator, _held_calls
from .sched import Shape
from .sched.hierarchical import (Call, Divide, HierarchicalPlan, Region, Topology,
                                 build_hierarchical, divide_in_place, verify_hierarchical)

__all__ = ["SubBootstrap", "host_topology", "HierarchicalCommunicator", "INTER_HOST_ENGINES"]

log = logging.getLogger("hoccl")

INTER_HOST_ENGINES = ("nccl", "mpi", "hoccl")


class SubBootstrap:
    """A ``Bootstrap`` over ``members`` (parent ranks, in order) of ``parent``.

    Exchanges go through the parent's: every parent rank must make the same exchanges
    at the same time (as ``init`` does, building every host's and every rail's
    communicator at once), each keeping its own members' values.  ``close`` leaves the
    parent open."""

    def __init__(self, parent: Bootstrap, members: Sequence[int]):
        self.parent = parent
        self.members = tuple(members)
        self.rank = self.members.index(parent.rank)
        self.world_size = len(self.members)

    def allgather(self, value: Any) -> List[Any]:
        everyone = self.parent.allgather(value)
        return [everyone[member] for member in self.members]

    def barrier(self) -> None:
        self.parent.barrier()

    def close(self) -> None:
        """The parent belongs to the hierarchical communicator."""


def host_topology(call: str, bootstrap: Bootstrap, local_size: Optional[int]
                  ) -> Tuple[Topology, List[str], str]:
    """The world's hosts: ``local_size`` (or ``HOCCL_LOCAL_SIZE``) consecutive ranks per
    simulated host, or else the ranks grouped by hostname (they must be consecutive and
    as many on every host).  Returns (topology, every rank's hostname, how it was found)."""
    names = bootstrap.allgather(socket.gethostname())
    world_size = len(names)
    source = "local_size"
    if local_size is None and os.environ.get("HOCCL_LOCAL_SIZE"):
        text, source = os.environ["HOCCL_LOCAL_SIZE"], "HOCCL_LOCAL_SIZE"
        try:
            local_size = int(text)
        except ValueError:
            raise InvalidArgumentError(f"{call}: HOCCL_LOCAL_SIZE must be a positive int; "
                                       f"got {text!r}") from None
    if local_size is not None:
        if (isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1
                or world_size % local_size):
            raise InvalidArgumentError(f"{call}: {source} must be a positive int that divides "
                                       f"the world size {world_size}; got {local_size!r}")
        for first in range(0, world_size, local_size):
            group = names[first:first + local_size]
            if len(set(group)) != 1:
                raise InvalidArgumentError(
                    f"{call}: {source}={local_size} puts ranks {first}..{first + local_size - 1} "
                    f"on one host, but they run on {sorted(set(group))}")
        return Topology(world_size // local_size, local_size), names, f"{source}={local_size}"
    order = list(dict.fromkeys(names))
    size = names.count(order[0])
    expected = [host for host in order for _ in range(size)]
    if names != expected:
        raise InvalidArgumentError(
            f"{call}: ranks must be placed in blocks of equal size per host (rank = host * "
            f"ranks_per_host + local rank); got hosts {names}. Launch with block placement "
            f"(mpirun --map-by slot, torchrun) or pass local_size=")
    return Topology(len(order), size), names, "hostname"


# -- arrays of any framework --------------------------------------------------------------
class _Arrays:
    """Flat views, scratch, staging and division for one array framework (numpy, torch,
    cupy), each ordered on the stream given as a raw handle (None: the host backend)."""

    def __init__(self, kind: str):
        self.kind = kind

    @staticmethod
    def of(array: Any) -> "_Arrays":
        return _Arrays(array_framework([array]) or "numpy")

    def flat(self, array: Any) -> Any:
        return array.reshape(-1)

    def _stream(self, handle: Optional[int], like: Any) -> Any:
        """A context that makes ``handle`` (a stream of ``like``'s GPU) current."""
        if self.kind == "torch":
            import torch
            return torch.cuda.stream(torch.cuda.ExternalStream(handle, device=like.device))
        import cupy
        return cupy.cuda.ExternalStream(handle)

    def empty(self, like: Any, count: int, stream: Optional[int]) -> Any:
        """``count`` elements of ``like``'s dtype on its device, allocated on ``stream``
        (the caching allocators reuse it only after the work later enqueued there)."""
        if self.kind == "numpy":
            return np.empty(count, like.dtype)
        if self.kind == "torch":
            import torch
            with self._stream(stream, like):
                return torch.empty(count, dtype=like.dtype, device=like.device)
        import cupy
        with cupy.cuda.Device(like.device.id), self._stream(stream, like):
            return cupy.empty(count, like.dtype)

    def to_host(self, view: Any) -> np.ndarray:
        """A numpy copy of ``view`` (whose stream work the caller has waited for)."""
        if self.kind == "numpy":
            return view
        if self.kind == "torch":
            import torch
            if view.dtype == torch.bfloat16:
                return view.view(torch.int16).cpu().numpy().view(numpy_dtype("bfloat16"))
            return view.cpu().numpy()
        return view.get()

    def from_host(self, view: Any, host: np.ndarray, stream: Optional[int]) -> None:
        """``view[...] = host``, ordered on ``stream`` (synchronous with the host)."""
        if self.kind == "numpy":
            if host is not view:
                view[...] = host
            return
        if self.kind == "torch":
            import torch
            if str(host.dtype) == "bfloat16":
                source = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
            else:
                source = torch.from_numpy(host)
            with self._stream(stream, view):
                view.copy_(source)
                torch.cuda.current_stream().synchronize()  # ``host`` may go once we return
            return
        stream_object = self._stream(stream, view)
        view.set(host, stream=stream_object)
        stream_object.synchronize()


def _framework_array(array: Any) -> Any:
    """``array``, or a cupy view of a device array of another kind (any object with
    ``__cuda_array_interface__``), so that phases can slice it."""
    if isinstance(array, np.ndarray) or array_framework([array]) is not None:
        return array
    import cupy
    return cupy.asarray(array)


def _address(array: Any) -> Tuple[int, int]:
    """(address, nbytes) of a flat array of any framework."""
    if isinstance(array, np.ndarray):
        return array.ctypes.data, array.nbytes
    if array_framework([array]) == "torch":
        return array.data_ptr(), array.numel() * array.element_size()
    return array.data.ptr, array.nbytes


# -- inter-host engines -------------------------------------------------------------------
class _MpiEngine:
    """Collectives of an mpi4py communicator on host arrays; device arrays are staged
    through host memory (the caller's stream is waited for first).  Each step returns
    when it is done: it is MPI's nonblocking form, tested until complete, so that it
    ends in ``timeout`` seconds, or at ``abort()``, where a blocking MPI call would wait
    for ever on a rank that never comes.  A step that ended so is still in MPI's hands
    (MPI cannot cancel a collective): the engine takes no more calls."""

    name = "mpi"

    def __init__(self, mpi_comm: Any, stream_waiter: Optional[Callable[[int], None]],
                 timeout: float):
        from mpi4py import MPI
        self.MPI = MPI
        self.mpi = mpi_comm
        self.wait_stream = stream_waiter
        self.timeout = timeout
        self._types: Dict[int, Any] = {}
        self._ops: Dict[Tuple[str, str], Any] = {}
        self._broken = ""  # why the engine takes no more calls
        self._aborted = ""

    def _wait(self, request: Any, what: str) -> None:
        """Test ``request`` until it completes, the timeout passes or the engine is
        aborted (``wait_until``, which looks for the abort every 50 ms)."""
        def aborted() -> None:
            if self._aborted:
                self._broken = f"{what} was left unfinished by an abort"
                raise AbortedError(f"{what} across hosts (MPI): aborted: {self._aborted}")
        try:
            wait_until(request.Test, time.monotonic() + self.timeout,
                       lambda: f"{what} across hosts (MPI, rank {self.mpi.rank} of "
                               f"{self.mpi.size} in its group): not finished within "
                               f"{self.timeout:g} s: a rank did not make the matching call, or "
                               f"is gone; MPI cannot take the step back, so this communicator "
                               f"takes no more calls", check=aborted)
        except HocclTimeoutError:
            self._broken = f"{what} did not finish within {self.timeout:g} s"
            raise

    def _usable(self, what: str) -> None:
        if self._broken:
            raise AbortedError(f"{what} across hosts (MPI): the engine takes no more calls: "
                               f"{self._broken}")

    # buffers -------------------------------------------------------------------------
    def _type(self, itemsize: int) -> Any:
        if itemsize not in self._types:
            self._types[itemsize] = self.MPI.BYTE.Create_contiguous(itemsize).Commit()
        return self._types[itemsize]

    def _spec(self, array: np.ndarray) -> list:
        return [array.view(np.uint8), self._type(array.dtype.itemsize)]

    def _op(self, op: str, dtype: np.dtype) -> Any:
        """A commutative MPI op over whole elements that computes as hoccl's reductions do."""
        key = (op, str(dtype))
        if key not in self._ops:
            def apply(incoming: Any, inout: Any, datatype: Any) -> None:
                a = np.frombuffer(incoming, np.uint8).view(dtype)
                b = np.frombuffer(inout, np.uint8).view(dtype)
                b[...] = reduce_arrays([b, a], op, dtype)
            self._ops[key] = self.MPI.Op.Create(apply, commute=True)
        return self._ops[key]

    def _staged(self, send: Any, recv: Any, stream: Optional[int], body: Callable) -> None:
        """Run ``body(host_send, host_recv)`` on numpy arrays that keep the in-place
        relation of ``send`` and ``recv``; copy what it wrote back to the device."""
        arrays = [array for array in (send, recv) if array is not None]
        self._usable("a step")
        if not arrays or isinstance(arrays[0], np.ndarray):
            body(send, recv)
            return
        kit = _Arrays.of(arrays[0])
        if self.wait_stream is not None and stream is not None:
            self.wait_stream(stream)
        if send is not None and recv is not None:
            (s_at, s_bytes), (r_at, r_bytes) = _address(send), _address(recv)
            if s_at < r_at + r_bytes and r_at < s_at + s_bytes:  # in place: one staged buffer
                large, large_at = (recv, r_at) if r_bytes >= s_bytes else (send, s_at)
                host = kit.to_host(large).copy()
                item = host.dtype.itemsize

                def inside(at: int, nbytes: int) -> np.ndarray:
                    return host[(at - large_at) // item:(at - large_at + nbytes) // item]
                body(inside(s_at, s_bytes), inside(r_at, r_bytes))
                kit.from_host(large, host, stream)
                return
        host_send = kit.to_host(send) if send is not None else None
        host_recv = kit.to_host(recv).copy() if recv is not None else None
        body(host_send, host_recv)
        if recv is not None and host_recv is not None:
            kit.from_host(recv, host_recv, stream)

    @staticmethod
    def _same(a: Optional[np.ndarray], b: Optional[np.ndarray]) -> bool:
        return a is not None and b is not None and a.ctypes.data == b.ctypes.data

    # the collectives ----------------------------------------------------------------
    def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        def body(s, r):
            inner = r[self.mpi.rank * s.size:(self.mpi.rank + 1) * s.size]
            self._wait(self.mpi.Iallgather(
                self.MPI.IN_PLACE if self._same(s, inner) else self._spec(s), self._spec(r)),
                "all_gather")
        self._staged(send, recv, stream, body)

    def reduce_scatter(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None:
        def body(s, r):
            own = s[self.mpi.rank * r.size:(self.mpi.rank + 1) * r.size]
            if self._same(own, r):  # MPI's in-place form would overwrite block 0 of s
                result = np.empty_like(r)
                self._wait(self.mpi.Ireduce_scatter_block(self._spec(s), self._spec(result),
                                                          self._op(op, s.dtype)),
                           "reduce_scatter")
                r[...] = result
                return
            self._wait(self.mpi.Ireduce_scatter_block(self._spec(s), self._spec(r),
                                                      self._op(op, s.dtype)), "reduce_scatter")
        self._staged(send, recv, stream, body)

    def all_reduce(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None:
        def body(s, r):
            self._wait(self.mpi.Iallreduce(
                self.MPI.IN_PLACE if self._same(s, r) else self._spec(s), self._spec(r),
                self._op(op, r.dtype)), "all_reduce")
        self._staged(send, recv, stream, body)

    def all_to_all(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self._staged(send, recv, stream, lambda s, r: self._wait(
            self.mpi.Ialltoall(self._spec(s), self._spec(r)), "all_to_all"))

    def broadcast(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        def body(s, r):
            if s is not None and not self._same(s, r):
                r[...] = s
            self._wait(self.mpi.Ibcast(self._spec(r), root=root), "broadcast")
        self._staged(send if self.mpi.rank == root else None, recv, stream, body)

    def reduce(self, send: Any, recv: Any, root: int, op: str, *, stream: Any = None) -> None:
        def body(s, r):
            in_place = self.mpi.rank == root and self._same(s, r)
            self._wait(self.mpi.Ireduce(self.MPI.IN_PLACE if in_place else self._spec(s),
                                        self._spec(r) if r is not None else None,
                                        self._op(op, s.dtype), root=root), "reduce")
        self._staged(send, recv if self.mpi.rank == root else None, stream, body)

    def gather(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        def body(s, r):
            at_root = self.mpi.rank == root
            in_place = at_root and self._same(s, r[root * s.size:(root + 1) * s.size])
            self._wait(self.mpi.Igather(self.MPI.IN_PLACE if in_place else self._spec(s),
                                        self._spec(r) if at_root else None, root=root),
                       "gather")
        self._staged(send, recv if self.mpi.rank == root else None, stream, body)

    def scatter(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        def body(s, r):
            at_root = self.mpi.rank == root
            in_place = at_root and self._same(r, s[root * r.size:(root + 1) * r.size])
            self._wait(self.mpi.Iscatter(self._spec(s) if at_root else None,
                                         self.MPI.IN_PLACE if in_place else self._spec(r),
                                         root=root), "scatter")
        self._staged(send if self.mpi.rank == root else None, recv, stream, body)

    def send(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        self._staged(buf, None, stream, lambda s, r: self._wait(
            self.mpi.Isend(self._spec(s), dest=peer), "send"))

    def recv(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        self._staged(None, buf, stream, lambda s, r: self._wait(
            self.mpi.Irecv(self._spec(r), source=peer), "recv"))

    def barrier(self, *, stream: Any = None) -> None:
        self._usable("barrier")
        if self.wait_stream is not None and stream is not None:
            self.wait_stream(stream)
        self._wait(self.mpi.Ibarrier(), "barrier")

    def synchronize(self) -> None:
        """Every MPI step returned when it was done."""

    def abort(self, reason: str = "") -> None:
        """A step in progress returns (its MPI request cannot be taken back: the engine
        takes no more calls); later calls are refused above."""
        self._aborted = reason or "abort() was called"

    def close(self) -> None:
        if self.mpi is not None and not self.MPI.Is_finalized():
            for datatype in self._types.values():
                datatype.Free()
            for op in self._ops.values():
                op.Free()
            self.mpi.Free()
        self.mpi = None


_NCCL_OPS = ("sum", "prod", "max", "min")


class _Nccl4pyEngine:
    """Collectives of an nccl4py communicator, enqueued on the caller's stream."""

    def __init__(self, comm: Any, label: str, device: int):
        import nccl.core as nccl
        self.nccl, self.comm, self.name, self.device = nccl, comm, label, device
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

    def barrier(self, *, stream: Any = None) -> None:
        """An all_reduce of one element: every member's stream reaches it first."""
        if self._token is None:
            self._token = _device_token(self.device)
        self.comm.allreduce(self._token, self._token, self._ops["sum"], stream=stream)

    def synchronize(self) -> None:
        """The caller's streams are synchronised by the hierarchical communicator."""

    def abort(self, reason: str = "") -> None:
        self.comm.abort()

    def close(self) -> None:
        self.comm.destroy()


class _TorchNcclEngine:
    """Collectives of a torch.distributed NCCL group, on the caller's stream (torch's
    ``Work.wait()`` makes the current stream wait; the host never blocks)."""

    def __init__(self, group: Any, members: Sequence[int], label: str):
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.group = torch, dist, group
        self.members, self.name = list(members), label
        self._ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
                     "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        self._token: Any = None

    def _tensor(self, array: Any) -> Any:
        if array is None or isinstance(array, self.torch.Tensor):
            return array
        return self.torch.as_tensor(array, device="cuda")

    def _run(self, stream: Any, body: Callable, *arrays: Any) -> None:
        tensors = [self._tensor(array) for array in arrays]
        with self.torch.cuda.stream(self.torch.cuda.ExternalStream(stream)):
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

    def barrier(self, *, stream: Any = None) -> None:
        if self._token is None:
            self._token = self.torch.zeros(1, device="cuda")
        self._run(stream, lambda t: self.dist.all_reduce(t, group=self.group), self._token)

    def synchronize(self) -> None:
        """The caller's streams are synchronised by the hierarchical communicator."""

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


def _nccl_engines(call: str, bootstrap: Bootstrap, topology: Topology, device: int
                  ) -> Tuple[Any, Any, str]:
    """(this rank's rail engine, the world engine, a label) over NCCL: nccl4py when it
    imports (a world communicator from a unique id swapped through the bootstrap, split
    into rails), else torch.distributed when it is initialised with the same world."""
    rank = bootstrap.rank
    host, local = topology.host_of(rank), topology.local_of(rank)
    binding = os.environ.get("HOCCL_NCCL_BINDING", "")
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
        return (_Nccl4pyEngine(rail, label, device), _Nccl4pyEngine(world, label, device),
                label)
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
    return (_TorchNcclEngine(rails[local], topology.groups("rail")[local], label),
            _TorchNcclEngine(None, range(topology.world_size), label), label)


def _mpi_communicator(call: str, bootstrap: Bootstrap, mpi_comm: Any) -> Any:
    """The MPI communicator the engine splits: the bootstrap's own, or ``mpi_comm`` / the
    world when the bootstrap is not MPI's (its ranks must then be the same)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise InvalidArgumentError(f"{call}: inter_host='mpi' needs mpi4py (pip install "
                                   f"'hoccl[mpi]')") from None
    if isinstance(bootstrap, MPIBootstrap):
        return bootstrap.mpi
    world = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
    if world.Get_size() != bootstrap.world_size or world.Get_rank() != bootstrap.rank:
        raise InvalidArgumentError(f"{call}: inter_host='mpi' needs an MPI communicator with the "
                                   f"bootstrap's ranks; MPI has rank {world.Get_rank()} of "
                                   f"{world.Get_size()}, the bootstrap {bootstrap.rank} of "
                                   f"{bootstrap.world_size}")
    return world


def _default_engine(backend: str, one_machine: bool) -> str:
    """cuda: NCCL when nccl4py imports or torch.distributed runs on NCCL, else MPI; host:
    hoccl itself for simulated hosts on one machine, else MPI."""
    if backend == "cuda":
        try:
            import nccl.core  # noqa: F401
            return "nccl"
        except ImportError:
            pass
        try:
            import torch.distributed as dist
            if dist.is_initialized() and dist.get_backend() == "nccl":
                return "nccl"
        except ImportError:
            pass
        return "mpi"
    return "hoccl" if one_machine else "mpi"


# -- the communicator ---------------------------------------------------------------------
class HierarchicalCommunicator(Communicator):
    """One rank of a world that spans hosts.  Create with ``hoccl.init``.

    The API is ``Communicator``'s, with the same argument checks; each call runs the
    phases of its ``hoccl.sched.hierarchical`` plan.  ``describe()`` says how the world
    is split and which engines run where.  Not inside ``hoccl.group()``."""

    def __init__(self, *, topology: Topology, rank: int, host: Communicator,
                 rail: Any, world: Any, inter_host: str, engine_label: str, grouping: str,
                 bootstrap: Bootstrap, verify_plans: bool):
        self.topology = topology
        self.rank = rank
        self.world_size = topology.world_size
        self.backend: str = host.backend
        self.device: Optional[int] = host.device
        self.inter_host = inter_host
        self._host = host
        self._levels: Dict[str, Any] = {"host": host, "rail": rail, "world": world}
        self._engine_label = engine_label
        self._grouping = grouping
        self._bootstrap = bootstrap
        self._verify_plans = verify_plans
        self._verified: Dict[int, HierarchicalPlan] = {}
        self._streams: Dict[int, Any] = {}   # caller streams used since the last synchronize
        self._aborted_reason = ""
        self._closed = False
        # the host backend runs a call's phases one after another on the host
        self._blocking = host.backend == "host"

    @classmethod
    def connect(cls, *, call: str, backend: str, bootstrap: Bootstrap, topology: Topology,
                hostnames: List[str], grouping: str, device: Optional[int],
                inter_host: Optional[str], mpi_comm: Any, verify_plans: bool,
                connect_host: Callable[..., Communicator]) -> "HierarchicalCommunicator":
        """Build this rank's host communicator, its rail engine and the world engine; every
        rank of ``bootstrap`` must call this at the same time (as ``init`` does)."""
        rank = bootstrap.rank
        one_machine = len(set(hostnames)) == 1
        engine = inter_host if inter_host is not None else _default_engine(backend, one_machine)
        if engine not in INTER_HOST_ENGINES:
            raise InvalidArgumentError(f"{call}: inter_host must be one of {INTER_HOST_ENGINES} "
                                       f"or None; got {engine!r}")
        if engine == "hoccl" and not one_machine:
            raise InvalidArgumentError(f"{call}: inter_host='hoccl' connects simulated hosts on "
                                       f"one machine; these ranks run on {sorted(set(hostnames))}")
        if engine == "nccl" and backend != "cuda":
            raise InvalidArgumentError(f"{call}: inter_host='nccl' needs the cuda backend; this "
                                       f"world uses {backend!r} (use 'mpi' or 'hoccl')")
        if backend == "cuda" and device is None:
            from .backends import cuda_device_count
            machine_rank = hostnames[:rank].count(hostnames[rank])
            device = machine_rank % cuda_device_count()
        host_index, local = topology.host_of(rank), topology.local_of(rank)
        host = connect_host(SubBootstrap(bootstrap, topology.groups("host")[host_index]), device)
        if engine == "hoccl":
            rail: Any = connect_host(SubBootstrap(bootstrap, topology.groups("rail")[local]),
                                     device)
            world: Any = connect_host(SubBootstrap(bootstrap, range(topology.world_size)), device)
            label = f"hoccl ({backend})"
        elif engine == "mpi":
            mpi = _mpi_communicator(call, bootstrap, mpi_comm)
            waiter = None
            if backend == "cuda":
                handle = host.device_handle

                def waiter(stream: int) -> None:
                    from cuda.bindings import driver
                    handle.synchronize_stream(driver.CUstream(stream), host.timeout)
            rail = _MpiEngine(mpi.Split(color=local, key=host_index), waiter, host.timeout)
            world = _MpiEngine(mpi.Dup(), waiter, host.timeout)
            label = "mpi (host-staged)" if backend == "cuda" else "mpi"
        else:
            assert device is not None  # nccl needs the cuda backend, which picked a GPU above
            rail, world, label = _nccl_engines(call, bootstrap, topology, device)
        bootstrap.barrier()
        comm = cls(topology=topology, rank=rank, host=host, rail=rail, world=world,
                   inter_host=engine, engine_label=label, grouping=grouping,
                   bootstrap=bootstrap, verify_plans=verify_plans)
        log.info("init: rank %d/%d on host %d of %d (local rank %d), inter-host engine %s",
                 rank, topology.world_size, host_index, topology.hosts, local, label)
        return comm

    # -- state ------------------------------------------------------------------------------
    def describe(self) -> Dict[str, Any]:
        """How the world is split and which engine runs each level."""
        return {"world_size": self.world_size, "rank": self.rank, "hosts": self.topology.hosts,
                "local_size": self.topology.local_size,
                "host": self.topology.host_of(self.rank),
                "local_rank": self.topology.local_of(self.rank), "grouping": self._grouping,
                "intra_host": f"hoccl ({self.backend})", "inter_host": self._engine_label,
                "ordering": ("each call's phases run one after another on the host"
                             if self._blocking else "every phase enqueued on the caller's stream")}

    @property
    def host_communicator(self) -> Communicator:
        """The hoccl communicator of this rank's host (world ``local_size``)."""
        return self._host

    @property
    def device_handle(self) -> Any:
        return self._host.device_handle

    @property
    def options(self) -> Any:
        return self._host.options

    @property
    def timeout(self) -> float:
        return self._host.timeout

    @property
    def max_sms(self) -> int:
        return self._host.max_sms

    @property
    def copy_sms(self) -> int:
        return self._host.copy_sms

    @property
    def aborted(self) -> bool:
        return bool(self._aborted_reason) or self._host.aborted

    @property
    def abort_reason(self) -> str:
        return self._aborted_reason or self._host.abort_reason

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        t = self.topology
        return (f"<hoccl.HierarchicalCommunicator rank {self.rank}/{self.world_size} "
                f"({t.hosts} hosts x {t.local_size}) backend={self.backend} device={self.device} "
                f"inter_host={self.inter_host}>")

    # -- host side ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block until this rank's calls have finished: the caller streams they used (the
        engine's work is on them) and the host communicator's calls."""
        self._usable("synchronize")
        if self.backend == "cuda":
            from cuda.bindings import driver
            # the frameworks may have made another GPU's context current since hoccl's
            # last call: the streams below are this GPU's
            self._host.device_handle.activate()
            for stream in list(self._streams):
                self._host.device_handle.synchronize_stream(driver.CUstream(stream), self.timeout)
            self._streams.clear()
        for engine in self._levels.values():
            if isinstance(engine, Communicator):
                engine.synchronize()

    def abort(self, reason: str = "") -> None:
        """Abort the host communicator and the engines (NCCL's ``ncclCommAbort``; an MPI
        step in progress cannot be taken back).  Idempotent."""
        if self._aborted_reason:
            return
        self._aborted_reason = reason or f"rank {self.rank}: abort() was called"
        for engine in self._levels.values():
            try:
                engine.abort(self._aborted_reason)
            except HocclError as error:
                log.warning("rank %d abort: %s", self.rank, error)

    def split(self, color: Optional[int], key: Optional[int] = None, *,
              timeout: Optional[float] = None, verify_plans: Optional[bool] = None,
              max_sms: Optional[int] = None, copy_sms: Optional[int] = None,
              **options: Any) -> Optional[Communicator]:
        """Not offered yet: a world across hosts would need its rails and inter-host
        engines split too.  Raises ``InvalidArgumentError``."""
        self._usable("split")
        raise InvalidArgumentError("split: not supported across hosts yet (a "
                                   "HierarchicalCommunicator); split the MPI communicator "
                                   "and call hoccl.init(mpi_comm=...) on each part instead")

    def register(self, array: Any) -> Any:
        """Not offered yet across hosts (the inter-host engines have registrations of
        their own).  Raises ``InvalidArgumentError``."""
        self._usable("register")
        raise InvalidArgumentError("register: not supported across hosts yet (a "
                                   "HierarchicalCommunicator); calls on unregistered buffers "
                                   "work as ever")

    def deregister(self, window: Any) -> None:
        self._usable("deregister")
        raise InvalidArgumentError("deregister: nothing is registered across hosts")

    def set_options(self, **changes: Any) -> None:
        """Options of the hoccl communicators (the host's, and the rails' with hoccl)."""
        self._usable("set_options")
        for engine in self._levels.values():
            if isinstance(engine, Communicator):
                engine.set_options(**changes)

    def close(self) -> None:
        """Wait for outstanding work, then close the engines, the host communicator and
        the bootstrap.  Idempotent."""
        if self._closed:
            return
        if not self.aborted:
            try:
                self.synchronize()
            except HocclError as error:
                log.warning("rank %d close: %s", self.rank, error)
        self._closed = True
        for level in ("rail", "world", "host"):  # NCCL's rails were split from its world
            try:
                self._levels[level].close()
            except Exception as error:  # every level must get its close
                log.warning("rank %d close %s: %r", self.rank, level, error)
        self._bootstrap.close()

    # -- a call -------------------------------------------------------------------------
    def _usable(self, name: str) -> None:
        if self._closed:
            raise InvalidArgumentError(f"{name}: the communicator is closed")
        if self.aborted:
            raise AbortedError(f"{name}: the communicator was aborted: {self.abort_reason}")

    def _plan(self, shape: Shape) -> HierarchicalPlan:
        plan = build_hierarchical(shape, self.topology)
        if self._verify_plans and self._verified.get(id(plan)) is not plan:
            verify_hierarchical(plan)
            self._verified[id(plan)] = plan
        return plan

    def _enter(self, name: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
               stream: Any) -> None:
        """Run ``shape``'s hierarchical plan on this rank's arrays (every argument has been
        checked by ``Communicator``)."""
        if shape.scale is not None:
            raise InvalidArgumentError(
                f"{name}: scale is not supported across hosts yet; scale the result, or use a "
                f"communicator within one host")
        if _held_calls() is not None:
            raise InvalidArgumentError(
                f"{name}: a communicator across hosts does not take calls inside hoccl.group() "
                f"(its phases mix engines); make them outside, sends and receives in an order "
                f"that cannot wait in a cycle")
        arrays = {key: _framework_array(buffer.owner) for key, buffer in buffers.items()
                  if buffer is not None}
        handle = self._stream(name, stream, list(arrays.values()))
        plan = self._plan(shape)
        first = next(iter(arrays.values()), None)
        kit = _Arrays.of(first) if first is not None else _Arrays("numpy")
        views = {key: kit.flat(array) for key, array in arrays.items()}
        scratch = plan.scratch_count(self.rank)
        if scratch:
            views["scratch"] = kit.empty(views[next(iter(views))], scratch, handle)

        def region(part: Optional[Region]) -> Any:
            return None if part is None else views[part.buffer][part.start:part.stop]
        for level, steps in plan.program(self.rank):
            self._usable(name)
            if level == "local":
                for step in steps:
                    assert isinstance(step, Divide)
                    self._divide(name, region(step.region), step.divisor, handle)
                continue
            engine = self._levels[level]
            for step in steps:
                assert isinstance(step, Call)
                try:
                    _issue(engine, step, region(step.send), region(step.recv), handle)
                except HocclTimeoutError as error:  # a step left to its engine: no more calls
                    self.abort(f"rank {self.rank}: {name}: {error}")
                    raise
            if self._blocking:
                engine.synchronize()

    def _divide(self, name: str, view: Any, divisor: int,
                stream: Optional[int]) -> None:
        """``view /= divisor`` as avg divides.  On GPUs hoccl's own reduction kernel does it
        (one input, ``divisor``), on the caller's stream through the same driver handle
        the phases before it were given, on at most ``max_sms`` SMs; the host backend's
        phases run on the host, and so does its division."""
        if stream is None:
            divide_in_place(view, divisor)
            return
        buffer = as_buffer(name, "recvbuf", view)
        if buffer.count:
            device = self._host.device_handle
            device.activate()
            device.reduce(device.resolve_stream(stream, [view]), buffer.address,
                          [buffer.address], buffer.count, buffer.dtype, "avg", divisor=divisor)

    def _stream(self, name: str, stream: Any, arrays: List[Any]) -> Optional[int]:
        """The caller's stream as a raw handle (None on the host backend, which runs each
        call's phases on the host and so takes no stream)."""
        if self.backend == "host":
            if stream is not None:
                raise InvalidArgumentError(
                    f"{name}: across hosts the host backend runs each call's phases on the "
                    f"host, one after another; pass stream=None")
            return None
        device = self._host.device_handle
        device.activate()
        handle = int(device.resolve_stream(stream, arrays))
        self._streams[handle] = True
        return handle


def _issue(engine: Any, call: Call, send: Any, recv: Any, stream: Optional[int]) -> None:
    """One call of a phase on its level's communicator (hoccl's API; the engines mirror it)."""
    s = call.shape
    kind = s.collective
    if kind == "sendrecv":
        if send is not None:
            engine.send(send, s.peer, stream=stream)
        else:
            engine.recv(recv, s.root, stream=stream)
    elif kind == "barrier":
        engine.barrier(stream=stream)
    elif kind in ("all_gather", "all_to_all"):
        getattr(engine, kind)(send, recv, stream=stream)
    elif kind in ("reduce_scatter", "all_reduce"):
        getattr(engine, kind)(send, recv, s.op, stream=stream)
    elif kind == "reduce":
        engine.reduce(send, recv, s.root, s.op, stream=stream)
    else:
        getattr(engine, kind)(send, recv, s.root, stream=stream)
