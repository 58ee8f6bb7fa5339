"""The staged engine's transport between members on one machine: each step's bytes are
read by their receiver straight out of the sender's memory with Linux cross-memory
attach (``process_vm_readv``, one copy, as MPI libraries move large messages inside a
node), and MPI carries only the small messages that say where the bytes lie and when
they have been read.

Members of different hosts (engines) can share one machine: a CPU-only group beside a
GPU group in one box, or a test rig.  Between them MPI's point-to-point path copies every
byte twice through shared cells (the Open MPI of the H200 machine, cross-memory attach
turned off in its environment: 3–5 GB/s), where one read by the receiver moves it once
(the staged engine's pinned slot of a GPU member is read by its CPU peer directly), and
a piece in the staged engine's own memory is not copied by the kernel at all: its
segment is mapped by the peer (``hoccl.backends._segments``).

A step, for each piece a member sends to a peer: an *offer* (address and length, tag
``_OFFER``) to that peer, then the peer's *read receipt* (tag ``_READ``) before the
piece's memory may change; for each piece it receives: the peer's offer, the read, a
receipt back.  Reads wait for nothing but offers, so no member waits on another's wait;
with several steps in flight a peer's pieces are read in the order of its offers (one
tag each way: a receipt answers the oldest offer not yet answered).
An ``all_reduce`` step (``CmaTransport.all_reduce``) reads nothing into a buffer: once
every peer's offer has come, a fold reads the peers' pieces where they lie, a block at a
time into its threads' caches, and writes the sum; on the wire it is an all_gather, so a
staged peer takes its part as one.

``CmaTransport.connect`` chooses it only where every member sits on one machine and each
can read every other's memory (a trial read at connect); ``HOCCL_CROSS_MEMORY=0`` keeps
MPI's own path.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable, List, Sequence, Tuple, Union

import numpy as np

from .._errors import HocclError, InvalidArgumentError
from ..backends._cross_memory import RemotePtr, move
from ..config import environ
from ..backends._segments import PeerSegments, segment_words
from .transports import MpiTransport

__all__ = ["CmaTransport", "same_machine"]

_OFFER, _READ = 11, 12
#: an offer: the piece's address and length, and its segment's (``segment_words``)
OFFER_WORDS = 6
#: a read of a piece is split over ``HOCCL_HOST_THREADS`` threads in parts of at least this
#: many bytes (one thread reads about 5 GB/s out of another process on the H200 machine)
READ_PART_BYTES = 512 << 10


def _machine() -> str:
    """This process's machine: host name and kernel boot (containers of one host that
    do not share process ids fail the trial read instead)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def same_machine(comm: Any) -> bool:
    """Whether every member of ``comm`` sits on this machine and can read the others'
    memory, and none turned the path off (``HOCCL_CROSS_MEMORY=0``): every member gets
    the same answer (a collective call on ``comm``)."""
    from mpi4py import MPI
    try:
        wanted, problem = _wanted(), ""
    except InvalidArgumentError as error:  # raised on every member, after the collective
        wanted, problem = False, str(error)
    word = np.array([int.from_bytes(os.urandom(7), "little")], np.uint64)
    machines = comm.allgather((_machine(), os.getpid(), word.ctypes.data, int(word[0]),
                               problem))
    problems = [f"member {m}: {told[4]}" for m, told in enumerate(machines) if told[4]]
    if problems:
        raise InvalidArgumentError("; ".join(problems))
    able = wanted and sys.platform.startswith("linux") and len({m[0] for m in machines}) == 1
    if able:
        probe = np.zeros(1, np.uint64)
        for _, pid, address, value, _ in machines:
            try:
                move(probe.ctypes.data, RemotePtr(pid, address), 8)
            except HocclError:
                able = False
                break
            able = able and int(probe[0]) == value
    verdict = comm.allreduce(int(able), op=MPI.MIN)
    return bool(verdict)


def _wanted() -> bool:
    """``HOCCL_CROSS_MEMORY``: 1 (the default) or 0."""
    text = (environ("HOCCL_CROSS_MEMORY") or "1").strip().lower()
    if text in ("1", "on", "true", "yes"):
        return True
    if text in ("0", "off", "false", "no"):
        return False
    raise InvalidArgumentError(f"inter_host='mpi': HOCCL_CROSS_MEMORY must be 1 or 0 (read "
                               f"each other's memory between members on one machine, or "
                               f"not); got {text!r}")


class _Step:
    """One step in flight: the offers this member made (each awaiting its receipt) and
    the pieces it reads (each awaiting its offer)."""

    def __init__(self, transport: "CmaTransport", offers: Sequence[Tuple[int, np.ndarray]],
                 reads: Sequence[Tuple[int, np.ndarray]]):
        comm = transport.comm
        self.transport = transport
        self.requests: List[Any] = []  # sends of offers and receipts, receipts expected
        self.keep: List[np.ndarray] = []  # the buffers of messages in flight
        for peer, piece in offers:
            offer = np.array([piece.ctypes.data, piece.nbytes, *segment_words(piece)],
                             np.uint64)
            self.keep += [offer, piece]  # the piece lives until its receipt has come
            self.requests.append(comm.Isend(offer, dest=peer, tag=_OFFER))
            receipt = np.zeros(1, np.uint64)
            self.keep.append(receipt)
            self.requests.append(comm.Irecv(receipt, source=peer, tag=_READ))
        self.reads: List[Tuple[int, np.ndarray, np.ndarray, Any]] = []
        for peer, piece in reads:
            offer = np.zeros(OFFER_WORDS, np.uint64)
            self.reads.append((peer, piece, offer, comm.Irecv(offer, source=peer, tag=_OFFER)))

    def progress(self, behind: set) -> None:
        """Read every piece whose offer has come, and send its receipt, in the order the
        steps were made: a peer in ``behind`` has an earlier step's piece still unread
        (its receipts must come back in the order of its offers, which carry one tag)."""
        waiting = []
        for peer, piece, offer, request in self.reads:
            if peer in behind or not request.Test():
                waiting.append((peer, piece, offer, request))
                behind.add(peer)
                continue
            self.transport.read(piece, peer, offer)
            self._receipt(peer)
        self.reads = waiting

    def _receipt(self, peer: int) -> None:
        receipt = np.ones(1, np.uint64)
        self.keep.append(receipt)
        self.requests.append(self.transport.comm.Isend(receipt, dest=peer, tag=_READ))

    def done(self) -> bool:
        return not self.reads and bool(self.transport.MPI.Request.Testall(self.requests))


class _FoldStep(_Step):
    """A step that folds its members' pieces as it reads them: ``piece`` is offered to
    every peer, and once every peer's piece has been offered ``fold`` is given every
    member's piece in member order (``CmaTransport.all_reduce``); the receipts go back
    after it."""

    def __init__(self, transport: "CmaTransport", piece: np.ndarray,
                 fold: Callable[[List[Any]], None]):
        others = [(peer, piece) for peer in transport.others()]
        super().__init__(transport, others, others)
        self.piece, self.fold = piece, fold

    def progress(self, behind: set) -> None:
        if not self.reads:
            return
        peers = {peer for peer, *_ in self.reads}
        if behind & peers or not all(request.Test() for *_, request in self.reads):
            behind |= peers
            return
        pieces: List[Any] = [self.piece] * self.transport.size
        for peer, _, offer, _ in self.reads:
            pieces[peer] = self.transport.offered(peer, offer, self.piece.nbytes)
        self.fold(pieces)
        for peer in sorted(peers):
            self._receipt(peer)
        self.reads = []


class CmaTransport(MpiTransport):
    """``MpiTransport``'s steps, each piece read by its receiver from the sender's memory
    (the module docstring); barriers stay MPI's."""

    def __init__(self, comm: Any):
        super().__init__(comm)
        self.label = "mpi, cross-memory"
        self.pids = comm.allgather(os.getpid())
        self.segments = PeerSegments()
        #: the steps not yet done: testing any one reads for all (a member's send, tested
        #: until its receipt comes, must not hold back its own receive's reads)
        self._steps: List[_Step] = []

    @classmethod
    def connect(cls, comm: Any) -> MpiTransport:
        """A ``CmaTransport`` where every member of ``comm`` is on one machine and can
        read the others (``same_machine``), else ``MpiTransport``."""
        return cls(comm) if same_machine(comm) else MpiTransport(comm)

    def read(self, piece: np.ndarray, peer: int, offer: np.ndarray) -> None:
        """A peer's offered bytes into ``piece``."""
        source = self.offered(peer, offer, piece.nbytes)
        move(piece.ctypes.data, source if isinstance(source, RemotePtr) else source.ctypes.data,
             piece.nbytes, piece_bytes=READ_PART_BYTES)

    def offered(self, peer: int, offer: np.ndarray,
                expected: int) -> Union[RemotePtr, np.ndarray]:
        """A peer's offered piece: mapped here where it lies in one of the peer's segments
        (``hoccl.backends._segments``), else where cross-memory attach reads it.  The
        lengths agree, or the calls differ."""
        address, nbytes = int(offer[0]), int(offer[1])
        if nbytes != expected:
            raise HocclError(f"a step across hosts ({self.label}, member {self.member} of "
                             f"{self.size}): member {peer} offered {nbytes} bytes where "
                             f"{expected} were expected: the members' calls differ")
        fd, inode, base, length = (int(word) for word in offer[2:OFFER_WORDS])
        mapped = self.segments.view(self.pids[peer], (fd, inode, base, length), address, nbytes)
        return RemotePtr(self.pids[peer], address) if mapped is None else mapped

    def others(self) -> List[int]:
        return [m for m in range(self.size) if m != self.member]

    def all_reduce(self, piece: np.ndarray, fold: Callable[[List[Any]], None]) -> Any:
        """Every member's ``piece`` handed to ``fold`` where it lies, in member order (this
        member's own, each peer's as ``offered`` gives it: an array where it is mapped,
        else a ``RemotePtr``): the fold reads its peers' bytes as it folds them, with no
        copy of its own.  On the wire it is an ``all_gather`` of ``piece``, so a
        peer may take its part as one.  The fold must not write over ``piece``."""
        step = _FoldStep(self, piece, fold)
        self._steps.append(step)
        return step

    def _post(self, offers: Sequence[Tuple[int, np.ndarray]],
              reads: Sequence[Tuple[int, np.ndarray]]) -> "_Step":
        """A step: each send an offer (done once its receipt comes), each receive a read of
        the peer's offered piece (``PairTransport`` writes the steps over it)."""
        step = _Step(self, offers, reads)
        self._steps.append(step)
        return step

    def send(self, buf: np.ndarray, peer: int) -> Any:
        return self._post([(peer, buf)], [])  # done when read: no synchronous mode needed

    def test(self, request: Any) -> bool:
        behind: set = set()
        for step in self._steps:
            step.progress(behind)
        if not isinstance(request, _Step):
            return super().test(request)
        if not request.done():
            return False
        self._steps.remove(request)
        return True
