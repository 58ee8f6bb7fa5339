"""MPI between hosts (mpi4py): host arrays as they are, device arrays staged through
host memory."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from .._dtypes import reduce_arrays
from .._errors import AbortedError, HocclTimeoutError, InvalidArgumentError
from .._mailbox import wait_until
from ..bootstrap import Bootstrap, MPIBootstrap
from .arrays import Arrays, address
from .engine import InterHostEngine, Setup

__all__ = ["MpiEngine"]


class MpiEngine(InterHostEngine):
    """Collectives of an mpi4py communicator on host arrays; device arrays are staged
    through host memory (the caller's stream is waited for first).  Each step returns
    when it is done: it is MPI's nonblocking form, tested until complete, so that it
    ends in ``timeout`` seconds, or at ``abort()``, where a blocking MPI call would wait
    for ever on a rank that never comes.  A step that ended so is still in MPI's hands
    (MPI cannot cancel a collective): the engine takes no more calls."""

    name = "mpi"

    def __init__(self, mpi_comm: Any, stream_waiter: Optional[Callable[[int], None]],
                 timeout: float, label: str = "mpi"):
        from mpi4py import MPI
        self.MPI = MPI
        self.mpi = mpi_comm
        self.label = label
        self.wait_stream = stream_waiter
        self.timeout = timeout
        self._types: Dict[int, Any] = {}
        self._ops: Dict[Tuple[str, str], Any] = {}
        self._broken = ""  # why the engine takes no more calls
        self._aborted = ""

    @classmethod
    def connect(cls, setup: Setup) -> Tuple["MpiEngine", "MpiEngine"]:
        """The rails split from the MPI communicator (``_mpi_communicator``), the world a
        duplicate of it; on the cuda backend each step first waits for the caller's
        stream on the host."""
        mpi = _mpi_communicator(setup.call, setup.bootstrap, setup.mpi_comm)
        host = setup.host
        waiter = None
        if setup.backend == "cuda":
            handle = host.device_handle

            def waiter(stream: int) -> None:
                from cuda.bindings import driver
                handle.synchronize_stream(driver.CUstream(stream), host.timeout)
        label = "mpi (host-staged)" if setup.backend == "cuda" else "mpi"
        rank = setup.bootstrap.rank
        host_index, local = setup.topology.host_of(rank), setup.topology.local_of(rank)
        return (cls(mpi.Split(color=local, key=host_index), waiter, host.timeout, label),
                cls(mpi.Dup(), waiter, host.timeout, label))

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
        kit = Arrays.of(arrays[0])
        if self.wait_stream is not None and stream is not None:
            self.wait_stream(stream)
        if send is not None and recv is not None:
            (s_at, s_bytes), (r_at, r_bytes) = address(send), address(recv)
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
