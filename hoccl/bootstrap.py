"""Rendezvous: how ranks find each other and match their calls.

Two groups, one interface (``submit(comm, op)``):

* ``LocalGroup`` — several ranks in one Python process (Jupyter, tests).  All
  ranks' calls come from one thread, rank after rank, so no call may wait for
  another rank's call: an operation is held until every participant has
  submitted it, then issued for each of them (in each rank's own call order).
* ``MPIGroup`` — one rank per process under mpirun.  Init-time exchange (pads,
  process and device identity) is an MPI allgather; per call, the participants
  swap buffer descriptors (exported handles, cached by the importer) through
  shared-memory mailboxes (``hoccl._mailbox``), bounded by the communicator's timeout.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from typing import Any, Dict, List, Tuple

from ._errors import MismatchError
from ._mailbox import Mailboxes, wait_until

__all__ = ["LocalGroup", "MPIGroup"]


class LocalGroup:
    """In-process rendezvous of several communicators."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.comms: List[Any] = []
        self._closed: set = set()
        self._leak = False  # a rank closed with work stuck behind its caller's stream
        self._pending: Dict[tuple, Dict[int, Any]] = {}
        self._queues: List[deque] = [deque() for _ in range(world_size)]

    def prepare(self, comm: Any, local: Dict[str, Any]) -> None:
        """Nothing to export in one process: peers use each other's addresses."""
        return None

    def admit(self, comm: Any, op: Any) -> None:
        """Check mode: compare with the ranks that already made this call."""
        group = self._pending.get(op.key, {})
        if comm.check and group:
            first_rank, first = next(iter(group.items()))
            if op.signature != first.signature:
                raise MismatchError(_mismatch(op.call, comm.rank, op.signature,
                                              first_rank, first.signature))

    def submit(self, comm: Any, op: Any, payload: Any) -> None:
        self._pending.setdefault(op.key, {})[comm.rank] = op
        self._queues[comm.rank].append(op)
        self.progress()

    def withdraw(self, comm: Any, op: Any) -> None:
        """``comm`` closes with ``op`` never issued: forget it (the other ranks' matching
        calls then wait for ever, and their ``synchronize`` names this rank)."""
        self._queues[comm.rank] = deque(queued for queued in self._queues[comm.rank]
                                        if queued is not op)
        group = self._pending.get(op.key)
        if group is not None and group.get(comm.rank) is op:
            del group[comm.rank]
            if not group:
                del self._pending[op.key]

    def siblings(self, comm: Any) -> List[Any]:
        """The other ranks of this process: an abort of one is an abort of all."""
        return [member for member in self.comms if member is not comm]

    def forget_calls(self) -> None:
        """After an abort: no held call will ever be issued."""
        self._pending.clear()
        for queue in self._queues:
            queue.clear()

    def waiting_for(self, op: Any) -> List[int]:
        """The participants that have not yet made the call ``op`` belongs to."""
        group = self._pending.get(op.key, {})
        return [rank for rank in op.plan.participants if rank not in group]

    def progress(self) -> None:
        """Issue, for every rank, the operations at the head of its queue that are complete."""
        moved = True
        while moved:
            moved = False
            for rank, queue in enumerate(self._queues):
                while queue:
                    op = queue[0]
                    group = self._pending.get(op.key, {})
                    if len(group) < len(op.plan.participants):
                        break
                    queue.popleft()
                    addresses = {(peer, name): address for peer, peer_op in group.items()
                                 for name, address in peer_op.local.items()}
                    self.comms[rank].device_handle.activate()
                    self.comms[rank]._issue(op, addresses)
                    op.issued = True
                    if all(member.issued for member in group.values()):
                        del self._pending[op.key]
                    moved = True

    def leave(self, comm: Any, leak: bool = False) -> None:
        """``comm`` closed its streams.  Its pad and scratch stay mapped by the other ranks'
        lanes until they have closed theirs too: free every device only then (or none, if
        any rank's work was left stuck: its lanes may still write into every peer)."""
        self._closed.add(comm.rank)
        self._leak = self._leak or leak
        if len(self._closed) == len(self.comms):
            for member in self.comms:
                member.device_handle.close(leak=self._leak)
            self._pending.clear()
            for queue in self._queues:
                queue.clear()


class MPIGroup:
    """One rank of an mpirun job."""

    def __init__(self, mpi_comm: Any, timeout: float):
        # an mpi4py communicator, or a bootstrap object: ``rank``, ``world_size``,
        # ``allgather(value) -> list``, ``barrier()`` and ``close()``
        self.bootstrap = None if hasattr(mpi_comm, "Dup") else mpi_comm
        self.mpi = mpi_comm.Dup() if self.bootstrap is None else None
        self.rank = self.mpi.Get_rank() if self.bootstrap is None else mpi_comm.rank
        self.world_size = self.mpi.Get_size() if self.bootstrap is None else mpi_comm.world_size
        self.timeout = timeout
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.mailboxes = Mailboxes(self.rank, self.world_size, self.allgather, self.barrier)

    def allgather(self, value: Any) -> List[Any]:
        if self.bootstrap is not None:
            return list(self.bootstrap.allgather(value))
        return self.mpi.allgather(value)

    def local_rank(self) -> int:
        """This rank's index among the ranks on its host."""
        hosts = self.allgather(self.host)
        return sum(1 for host in hosts[:self.rank] if host == self.host)

    def prepare(self, comm: Any, local: Dict[str, Any]) -> Any:
        """Export this rank's buffers (cached by allocation): what peers need to map them."""
        device = comm.device_handle
        return {name: device.export(address) for name, address in local.items()}

    def admit(self, comm: Any, op: Any) -> None:
        """Mismatches are found in ``submit``, when the peers' signatures arrive."""

    def withdraw(self, comm: Any, op: Any) -> None:
        """Under mpirun every call is issued before it returns: nothing is ever held."""

    def siblings(self, comm: Any) -> List[Any]:
        """One rank per process: peers learn of an abort from the poison in their pads."""
        return []

    def forget_calls(self) -> None:
        """Nothing is held between calls under mpirun."""

    def submit(self, comm: Any, op: Any, exports: Any) -> None:
        """Swap descriptors with the other participants, import theirs, then issue."""
        payload = (exports, op.signature if comm.check else None)
        peers = [rank for rank in op.plan.participants if rank != self.rank]
        received = self._exchange(peers, op.key, payload, op.call)
        addresses = {(self.rank, name): address for name, address in op.local.items()}
        for peer, (descriptors, signature) in received.items():
            if comm.check and signature != op.signature:
                raise MismatchError(_mismatch(op.call, self.rank, op.signature, peer, signature))
            for name, descriptor in descriptors.items():
                # the device caches mappings by allocation: a repeat costs no driver call
                addresses[(peer, name)] = comm.device_handle.import_(descriptor)
        comm._issue(op, addresses)
        op.issued = True

    def _exchange(self, peers: List[int], key: tuple, payload: Any,
                  call: str) -> Dict[int, Any]:
        """Send ``payload`` to every peer and receive theirs, through the shared-memory
        mailboxes; give up after the timeout."""
        deadline = time.monotonic() + self.timeout
        for peer in peers:
            self.mailboxes.send(peer, (key, payload), deadline, call)
        received: Dict[int, Any] = {}
        missing = list(peers)
        while missing:
            wait_until(lambda: any(self.mailboxes.ready(peer) for peer in missing), deadline,
                       lambda: f"{call}: rank {self.rank} waited {self.timeout:g} s for ranks "
                               f"{missing} to make the matching call {key}; they never did — "
                               f"a mismatched sequence of calls or a dead process")
            for peer in [peer for peer in missing if self.mailboxes.ready(peer)]:
                their_key, received[peer] = self.mailboxes.receive(peer)
                missing.remove(peer)
                if their_key != key:
                    raise MismatchError(
                        f"{call}: rank {self.rank} made call {key} but rank {peer}'s next "
                        f"call with it was {their_key}: the ranks' sequences of calls differ")
        return received

    def barrier(self) -> None:
        if self.bootstrap is not None:
            self.bootstrap.barrier()
        else:
            self.mpi.Barrier()

    def leave(self, comm: Any, leak: bool = False) -> None:
        """Free the device (keep it, with ``leak``) and the duplicated MPI communicator
        (unless MPI is gone)."""
        comm.device_handle.close(leak=leak)
        self.mailboxes.close()
        if self.bootstrap is not None:
            self.bootstrap.close()
        if self.mpi is not None:
            from mpi4py import MPI
            if not MPI.Is_finalized():
                self.mpi.Free()
            self.mpi = None


def _mismatch(call: str, rank: int, mine: Tuple, peer: int, theirs: Tuple) -> str:
    return (f"{call}: rank {rank} called {_describe(mine)} but rank {peer} called "
            f"{_describe(theirs)}")


def _describe(signature: Tuple) -> str:
    return "(" + ", ".join(f"{key}={value!r}" for key, value in signature) + ")"
