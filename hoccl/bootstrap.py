"""Rendezvous: how the ranks of a job find each other.

A ``Bootstrap`` is the out-of-band channel a process group is built on: rank, world
size, an allgather of Python objects and a barrier.  ``MPIBootstrap`` wraps an mpi4py
communicator; ``hoccl.torch`` provides one over a torch.distributed Store.  Matching
each call with the peers' calls is ``hoccl._groups``'.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, List, Optional, Protocol

__all__ = ["Bootstrap", "MPIBootstrap", "end_of_job"]

log = logging.getLogger("hoccl")


class Bootstrap(Protocol):
    """The out-of-band channel of a process group.

    A bootstrap may also offer ``split(color, key)``: a bootstrap over the ranks of
    ``color`` ordered by (``key``, rank), or None for ``color=None``, made collectively by
    every rank (``MPIBootstrap`` does, with MPI_Comm_split); ``Communicator.split`` needs
    it.  And ``peer_lost(description)``: a process group calls it once when it finds a
    peer's process gone without having closed (``MPIBootstrap`` then aborts the MPI job
    at exit, ``end_of_job``)."""
    rank: int
    world_size: int

    def allgather(self, value: Any) -> List[Any]:
        """Every rank's ``value`` (picklable), in rank order."""

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class MPIBootstrap:
    """A ``Bootstrap`` over an mpi4py communicator (duplicated, freed by ``close``)."""

    def __init__(self, mpi_comm: Any):
        self.mpi = mpi_comm.Dup()
        self.rank: int = self.mpi.Get_rank()
        self.world_size: int = self.mpi.Get_size()

    def allgather(self, value: Any) -> List[Any]:
        return self.mpi.allgather(value)

    def barrier(self) -> None:
        self.mpi.Barrier()

    def split(self, color: Optional[int], key: int) -> Optional["MPIBootstrap"]:
        """MPI_Comm_split: the ranks of ``color`` ordered by (``key``, rank), or None for
        ``color=None`` (MPI_UNDEFINED).  Every rank must call it."""
        from mpi4py import MPI
        part = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        if part == MPI.COMM_NULL:
            return None
        try:
            return MPIBootstrap(part)
        finally:
            part.Free()

    def close(self) -> None:
        if self.mpi is not None:
            from mpi4py import MPI
            if not MPI.Is_finalized():
                self.mpi.Free()
            self.mpi = None

    @staticmethod
    def peer_lost(description: str) -> None:
        """A peer's process exited without closing: MPI_Finalize would wait for it (MPICH
        waits for ever, then crashes), so ``end_of_job`` aborts the MPI job instead."""
        if not _LOST_MPI_PEERS:
            log.warning("%s without closing the communicator: the MPI job will be aborted "
                        "at exit", description)
        _LOST_MPI_PEERS.append(description)


#: the peers' processes that process groups over MPI found gone without closing
_LOST_MPI_PEERS: List[str] = []
#: seconds ``end_of_job`` leaves the launcher to forward its message before MPI_Abort
_FORWARD_SECONDS = 0.2


def end_of_job() -> None:
    """At interpreter exit, after hoccl's communicators are closed: if a peer's process was
    lost (``MPIBootstrap.peer_lost``) and MPI is still running, abort the MPI job
    (``MPI_Abort``, exit status 1): MPI_Finalize, which mpi4py runs after every Python
    exit handler, would wait for the lost process.  The launcher then ends every rank."""
    if not _LOST_MPI_PEERS:
        return
    MPI = getattr(sys.modules.get("mpi4py"), "MPI", None)
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    log.error("hoccl: aborting the MPI job at exit: %s without closing the communicator "
              "(MPI_Finalize would wait for it)", _LOST_MPI_PEERS[0])
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    # the launcher forwards output from a pipe it reads on its own time, and MPI_Abort
    # tears the job down at once: without a pause the message was lost in 1 run of 24
    time.sleep(_FORWARD_SECONDS)
    MPI.COMM_WORLD.Abort(1)
