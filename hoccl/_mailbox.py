"""Shared-memory mailboxes: how the ranks of one host swap per-call descriptors.

Every rank owns one segment in ``/dev/shm`` holding one single-producer,
single-consumer ring per peer (the messages that peer sends it).  A ring is two
process-shared POSIX semaphores and ``SLOTS`` slots of ``SLOT_BYTES``::

    filled   messages waiting: the writer posts it after copying a message into a slot,
             the reader takes it before copying one out
    free     empty slots: the reader posts it after copying a message out, the writer
             takes it before copying one in

    writer   take free ─▶ copy into slot w % SLOTS ─▶ post filled      (w += 1)
    reader   take filled ─▶ copy out of slot r % SLOTS ─▶ post free     (r += 1)

Each side counts the messages it has moved (``w``, ``r``: private to its process), which
names the next slot.  POSIX makes sem_post and sem_trywait synchronise memory (POSIX.1,
4.12 "Memory Synchronization"; glibc's are a release increment and an acquire
compare-and-swap), so the reader sees every byte the writer copied before it posted
``filled``, and the writer refills a slot only after the reader, having posted ``free``,
is done with it — on weakly ordered CPUs (aarch64) as on x86.  No process ever blocks in
sem_wait: waits poll sem_trywait (``wait_until``), so they can time out and notice a dead
peer.

After the rings, a segment holds its rank's two *notices*, told once each to every peer
out of band of the calls' messages: why the rank aborted (``Notice``: a divergence, or
any other reason), and that it closed (with how many calls it had made).  A notice is
written into the owner's segment, then a semaphore per reader is posted, so that a
reader which takes its semaphore reads the whole notice (as a ring's message).  A peer
whose waits were released by an abort's poison learns from the first why; a peer waiting
for a call learns from the second that it will never come.

A message costs a pickle, two memory copies and four semaphore calls (microseconds)
instead of a round trip through the bootstrap, which is used only to agree on the
segments' names and the ranks' processes (through the ``allgather`` and ``barrier``
callables: MPI or a store).  Segments are unlinked as soon as every rank has mapped them.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import pickle
import socket
import struct
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

from ._errors import (HocclError, HocclTimeoutError, InvalidArgumentError, PeerClosedError,
                      PeerDeadError)

__all__ = ["Mailboxes", "Notice", "MESSAGE_BYTES", "NOTICE_BYTES", "SLOTS", "SLOT_BYTES",
           "made_call", "wait_until"]

SLOTS = 64
SLOT_BYTES = 16 << 10
_LENGTH = struct.Struct("<I")  # a slot starts with the length of its message
MESSAGE_BYTES = SLOT_BYTES - _LENGTH.size  # the largest pickled message a slot holds
# glibc's sem_t is 32 bytes, 8-byte aligned, on 64-bit Linux (x86_64 and aarch64:
# __SIZEOF_SEM_T in bits/semaphore.h); each semaphore gets a cache line to itself.
_SEMAPHORE_BYTES = 64
_HEADER = 2 * _SEMAPHORE_BYTES  # filled, free
_RING = _HEADER + SLOTS * SLOT_BYTES
_CHECK_PERIOD = 0.05  # seconds between two ``check`` calls of a waiting ``wait_until``
NOTICE_BYTES = 4 << 10  # the largest pickled notice
_NOTICE_KINDS = ("abort", "close")  # a segment's notices, in the order they lie in it
_REASON_CHARS = 2000  # an abort's reason is cut to this many characters in its notice

# sem_* live in libc (glibc 2.34 on) or in libpthread, which CPython links before that.
_LIBC = ctypes.CDLL(None, use_errno=True)


def _c_function(name: str, *argtypes: Any) -> Any:
    function = getattr(_LIBC, name)
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


_sem_init = _c_function("sem_init", ctypes.c_void_p, ctypes.c_int, ctypes.c_uint)
_sem_destroy = _c_function("sem_destroy", ctypes.c_void_p)
_sem_post = _c_function("sem_post", ctypes.c_void_p)
_sem_trywait = _c_function("sem_trywait", ctypes.c_void_p)


class _Semaphore:
    """A process-shared POSIX semaphore inside a mapped segment (valid while it is mapped)."""

    __slots__ = ("_address", "what")

    def __init__(self, address: int, what: str):
        self._address = ctypes.c_void_p(address)
        self.what = what

    def initialize(self, value: int, call: str) -> None:
        if _sem_init(self._address, 1, value):
            self._fail(call, "sem_init")

    def post(self, call: str) -> None:
        if _sem_post(self._address):
            self._fail(call, "sem_post")

    def take(self, call: str) -> bool:
        """Take one unit if there is one; never blocks."""
        if _sem_trywait(self._address) == 0:
            return True
        if ctypes.get_errno() != errno.EAGAIN:
            self._fail(call, "sem_trywait")
        return False

    def destroy(self, call: str) -> None:
        if _sem_destroy(self._address):
            self._fail(call, "sem_destroy")

    def _fail(self, call: str, function: str) -> None:
        code = ctypes.get_errno()
        raise HocclError(f"{call}: {function} on {self.what} failed: "
                         f"{errno.errorcode.get(code, code)} ({os.strerror(code)})")


class _Ring:
    """The ring ``sender`` writes in ``owner``'s segment, as one side (writer or reader)
    sees it: ``count`` is the number of messages this side has moved through it."""

    __slots__ = ("_box", "_slots", "filled", "free", "count", "held")

    def __init__(self, box: mmap.mmap, base: int, owner: int, sender: int):
        start = sender * _RING
        self._box, self._slots = box, start + _HEADER
        where = f"rank {sender}'s ring in rank {owner}'s mailbox"
        self.filled = _Semaphore(base + start, f"the messages of {where}")
        self.free = _Semaphore(base + start + _SEMAPHORE_BYTES, f"the free slots of {where}")
        self.count = 0
        self.held = False  # the reader has taken a message's ``filled`` unit, not the message

    def write(self, data: bytes) -> None:
        at = self._slots + (self.count % SLOTS) * SLOT_BYTES
        _LENGTH.pack_into(self._box, at, len(data))
        self._box[at + _LENGTH.size:at + _LENGTH.size + len(data)] = data
        self.count += 1

    def read(self) -> bytes:
        at = self._slots + (self.count % SLOTS) * SLOT_BYTES
        (length,) = _LENGTH.unpack_from(self._box, at)
        self.count += 1
        return self._box[at + _LENGTH.size:at + _LENGTH.size + length]


class _Process(NamedTuple):
    """A rank's process, as it described itself at construction."""

    host: str
    pid: int
    start: Optional[int]  # see _start_time
    namespace: Optional[str]  # the pid namespace that ``pid`` belongs to

    @classmethod
    def this(cls) -> "_Process":
        try:
            namespace: Optional[str] = os.readlink("/proc/self/ns/pid")
        except OSError:
            namespace = None
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _start_time(pid), namespace)

    def alive(self) -> bool:
        """False once the process has exited: gone, dead but not yet reaped (a zombie), or
        its pid now names a newer process."""
        return _start_time(self.pid) == self.start


class Notice(NamedTuple):
    """What a rank tells its peers once (``Mailboxes.announce``).  An abort's: ``kind``
    "diverged" (its calls diverged from a peer's: ``DivergedError``) or "aborted" (any
    other reason), and ``reason``.  A close's: ``kind`` "closed" and ``made``, how many
    calls of each sequence the rank had made (``made_call``), or None if it had been
    aborted."""
    kind: str
    reason: str = ""
    made: Any = None


def made_call(key: tuple, made: Tuple[int, Dict[tuple, int]]) -> bool:
    """Whether a rank that had made ``made`` (collectives, calls per (sender, receiver)
    pair) had made the call of ``key`` (``("coll", n)`` or ``("pair", s, r, n)``)."""
    if key[0] == "coll":
        return key[1] < made[0]
    return key[-1] < made[1].get(tuple(key[1:-1]), 0)


class Mailboxes:
    """This rank's view of every rank's mailbox segment, and of every rank's process."""

    def __init__(self, rank: int, world_size: int, allgather: Callable[[Any], List[Any]],
                 barrier: Callable[[], None], *, call: str = "init",
                 on_lost: Callable[[str], None] = lambda gone: None):
        self.rank, self.world_size = rank, world_size
        self._maps: List[mmap.mmap] = []
        self._incoming: List[_Ring] = []  # in this rank's segment, by sender
        self._outgoing: List[_Ring] = []  # in each peer's segment, written by this rank
        #: where each notice lies in a segment: its readers' semaphores, then its length
        #: and bytes
        self._notice_at = [_RING * world_size + index * _notice_bytes(world_size)
                           for index in range(len(_NOTICE_KINDS))]
        nbytes = _RING * world_size + len(_NOTICE_KINDS) * _notice_bytes(world_size)
        #: per notice, the peers' notices taken so far (``notice``) and whether this rank
        #: has told its own (``announce``)
        self._notices: List[List[Optional[Notice]]] = [[None] * world_size
                                                       for _ in _NOTICE_KINDS]
        self._announced = [False] * len(_NOTICE_KINDS)
        self._notice_lock = threading.Lock()
        self._on_lost, self._lost = on_lost, False
        name = f"/dev/shm/hoccl-{uuid.uuid4().hex}-{rank}"
        own = _map(name, nbytes, call, create=True)
        try:
            base = _address(own)
            self._incoming = [_Ring(own, base, rank, sender) for sender in range(world_size)]
            for ring in self._incoming:
                ring.filled.initialize(0, call)
                ring.free.initialize(SLOTS, call)
            for reader in range(world_size):
                for kind in range(len(_NOTICE_KINDS)):
                    self._notice_semaphore(own, base, rank, kind, reader).initialize(0, call)
            me = _Process.this()
            everyone = allgather((name, me))
            self.processes: List[_Process] = [_Process(*process) for _, process in everyone]
            for peer, process in enumerate(self.processes):
                if process.host != me.host:
                    raise InvalidArgumentError(
                        f"{call}: rank {peer} runs on host {process.host}, rank {rank} on "
                        f"{me.host}; mailboxes connect the ranks of one host")
            self._maps = [own if peer == rank else _map(peer_name, nbytes, call, create=False)
                          for peer, (peer_name, _) in enumerate(everyone)]
            self._outgoing = [_Ring(mapped, _address(mapped), peer, rank)
                              for peer, mapped in enumerate(self._maps)]
            # The barrier also orders the semaphores' initialisation before any peer's use.
            barrier()
        finally:
            os.unlink(name)  # every rank has it mapped (or this rank failed): nothing is left
        # A peer's pid means something here only within the same pid namespace (a
        # container may have its own) and with /proc to read.
        self._watched = [process.start is not None and me.namespace is not None
                         and process.namespace == me.namespace for process in self.processes]

    # -- notices ----------------------------------------------------------------------------
    def _notice_semaphore(self, mapped: mmap.mmap, base: int, owner: int, kind: int,
                          reader: int) -> _Semaphore:
        """The semaphore that tells ``reader`` notice ``kind`` of ``owner``'s segment."""
        return _Semaphore(base + self._notice_at[kind] + reader * _SEMAPHORE_BYTES,
                          f"rank {reader}'s {_NOTICE_KINDS[kind]} notice in rank {owner}'s "
                          f"mailbox")

    def announce(self, notice: Notice) -> bool:
        """Tell every peer ``notice`` (an abort's or a close's, by its kind), unless this
        rank told that notice already (the first stays) or has closed its mailboxes.
        Never waits; False if nothing was told."""
        kind = 1 if notice.kind == "closed" else 0
        notice = notice._replace(reason=notice.reason[:_REASON_CHARS])
        data = pickle.dumps(tuple(notice), protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > NOTICE_BYTES:  # many pair sequences: their counts do not fit
            data = pickle.dumps(tuple(notice._replace(made=None)),
                                protocol=pickle.HIGHEST_PROTOCOL)
        with self._notice_lock:
            if self._announced[kind] or not self._maps:
                return False
            self._announced[kind] = True
            own = self._maps[self.rank]
            at = self._notice_at[kind] + self.world_size * _SEMAPHORE_BYTES
            _LENGTH.pack_into(own, at, len(data))
            own[at + _LENGTH.size:at + _LENGTH.size + len(data)] = data
            base = _address(own)
            for reader in range(self.world_size):
                if reader != self.rank:
                    self._notice_semaphore(own, base, self.rank, kind, reader).post("announce")
        return True

    def notice(self, peer: int, kind: str) -> Optional[Notice]:
        """``peer``'s notice of ``kind`` ("abort" or "close") if it has told it (and this
        rank's mailboxes are open); never waits."""
        index = _NOTICE_KINDS.index(kind)
        with self._notice_lock:
            known = self._notices[index][peer]
            if known is not None or peer == self.rank or not self._maps:
                return known
            mapped = self._maps[peer]
            if not self._notice_semaphore(mapped, _address(mapped), peer, index,
                                          self.rank).take("notice"):
                return None
            at = self._notice_at[index] + self.world_size * _SEMAPHORE_BYTES
            (length,) = _LENGTH.unpack_from(mapped, at)
            known = Notice(*pickle.loads(mapped[at + _LENGTH.size:at + _LENGTH.size + length]))
            self._notices[index][peer] = known
            return known

    def closed(self, peers: Iterable[int]) -> Optional[str]:
        """The first of ``peers`` that has closed its communicator, said as "rank 2, which
        closed the communicator"; None while none has."""
        for peer in peers:
            if self.notice(peer, "close") is not None:
                aborted = self.notice(peer, "abort")
                if aborted is None:
                    return f"rank {peer}, which closed the communicator"
                why = f" ({aborted.reason})" if aborted.reason else ""
                return f"rank {peer}, which aborted the communicator{why} and closed it"
        return None

    def send(self, peer: int, message: Any, deadline: float, call: str) -> None:
        """Copy ``message`` into ``peer``'s mailbox, waiting (until ``deadline``) while its
        ring from this rank is full."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > MESSAGE_BYTES:
            raise InvalidArgumentError(
                f"{call}: a descriptor message of {len(data)} bytes (pickled) does not fit a "
                f"mailbox slot, which holds at most {MESSAGE_BYTES}")
        ring = self._ring(self._outgoing, peer, call)
        if not ring.free.take(call):
            wait_until(lambda: ring.free.take(call), deadline,
                       lambda: f"{call}: rank {self.rank}'s mailbox to rank {peer} stayed full "
                               f"({SLOTS} messages): rank {peer} stopped taking messages",
                       check=lambda: self.check_alive([peer], call))
        ring.write(data)
        ring.filled.post(call)

    def ready(self, peer: int) -> bool:
        """Whether a message from ``peer`` is waiting (it is then kept for ``receive``)."""
        ring = self._ring(self._incoming, peer, "ready")
        if not ring.held:
            ring.held = ring.filled.take("ready")
        return ring.held

    def receive(self, peer: int) -> Any:
        """The next message from ``peer`` (call only when ``ready(peer)``)."""
        ring = self._ring(self._incoming, peer, "receive")
        if not ring.held and not ring.filled.take("receive"):
            raise HocclError(f"receive: rank {self.rank} has no message from rank {peer}; "
                             f"receive only when ready({peer}) is true")
        data = ring.read()
        ring.held = False
        ring.free.post("receive")
        return pickle.loads(data)

    def alive(self, peer: int) -> bool:
        """False once ``peer``'s process has exited (``_Process.alive``); True while it
        runs, and for a peer whose process this rank cannot see."""
        return not self._watched[peer] or self.processes[peer].alive()

    def dead(self, peers: Iterable[int]) -> Optional[str]:
        """The first of ``peers`` whose process has exited without closing its
        communicator, said as "rank 2, whose process (pid 1234 on host h) has exited";
        None while they all run (or left after closing).  The first such peer found is
        told to ``on_lost``."""
        for peer in peers:
            if not self.alive(peer) and self.notice(peer, "close") is None:
                process = self.processes[peer]
                gone = (f"rank {peer}, whose process (pid {process.pid} on host "
                        f"{process.host}) has exited")
                if not self._lost:
                    self._lost = True
                    self._on_lost(gone)
                return gone
        return None

    def check_alive(self, peers: Iterable[int], call: str) -> None:
        """Raise PeerDeadError if one of ``peers`` has exited, PeerClosedError if one has
        closed its communicator (the check of a wait for a message from them, or for room
        in their rings)."""
        peers = list(peers)
        gone = self.dead(peers)
        if gone is not None:
            raise PeerDeadError(f"{call}: rank {self.rank} waited for {gone}")
        closed = self.closed(peers)
        if closed is not None:
            raise PeerClosedError(f"{call}: rank {self.rank} waited for {closed}: the call "
                                  f"will never come")

    def _ring(self, rings: List[_Ring], peer: int, call: str) -> _Ring:
        if not 0 <= peer < len(rings):
            raise InvalidArgumentError(
                f"{call}: rank {self.rank} has no mailbox to rank {peer} (world size "
                f"{self.world_size}{', closed' if not rings else ''})")
        return rings[peer]

    def close(self) -> None:
        """Unmap every segment; twice is harmless.  The semaphores of this rank's rings
        are destroyed first: no process ever blocks on them, so no waiter is stranded, and
        glibc's sem_destroy releases nothing, so a peer still polling them touches memory
        its own mapping keeps.  The notices' semaphores are left as they are: a peer may
        take them after this rank has gone (its mapping keeps the memory)."""
        incoming, self._incoming, self._outgoing = self._incoming, [], []
        with self._notice_lock:
            maps, self._maps = self._maps, []
        for ring in incoming:
            ring.filled.destroy("close")
            ring.free.destroy("close")
        for mapped in maps:
            mapped.close()


def wait_until(ready: Callable[[], bool], deadline: float, describe: Callable[[], str],
               check: Optional[Callable[[], None]] = None, longest_sleep: float = 1e-3) -> None:
    """Poll ``ready()``: without sleeping for 2 ms (a peer usually answers within
    microseconds; each poll yields the GIL, so the process's other threads are not held
    back by the interpreter's 5 ms switch interval), then with sleeps backing off to
    ``longest_sleep``;
    HocclTimeoutError(``describe()``) after ``deadline``.  Every 50 ms of waiting,
    ``check()`` (which raises to end the wait: a dead peer, or one that closed); a wait that ``check`` ends looks at ``ready()`` once
    more, as what it waited for (a closed peer's last message) may have come meanwhile."""
    start = time.monotonic()
    spin_until, check_at = start + 2e-3, start + _CHECK_PERIOD
    delay = min(50e-6, longest_sleep)
    while not ready():
        now = time.monotonic()
        if check is not None and now >= check_at:
            try:
                check()
            except HocclError:
                if ready():
                    return
                raise
            check_at = now + _CHECK_PERIOD
        if now > deadline:
            raise HocclTimeoutError(describe())
        if now > spin_until:
            time.sleep(delay)
            delay = min(delay * 2, longest_sleep)
        else:
            os.sched_yield()  # lets the process's other threads take the GIL


def _notice_bytes(world_size: int) -> int:
    """The bytes of one notice in a segment: a semaphore per reader, a length, the notice,
    rounded up to whole cache lines (the next notice's semaphores stay aligned)."""
    nbytes = world_size * _SEMAPHORE_BYTES + _LENGTH.size + NOTICE_BYTES
    return -(-nbytes // _SEMAPHORE_BYTES) * _SEMAPHORE_BYTES


def _map(name: str, nbytes: int, call: str, create: bool) -> mmap.mmap:
    """Map the segment ``name`` (created, zero-filled, when ``create``)."""
    try:
        descriptor = os.open(name, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(descriptor, nbytes)
            return mmap.mmap(descriptor, nbytes)
        finally:
            os.close(descriptor)
    except OSError as error:
        raise HocclError(f"{call}: could not {'create' if create else 'open'} the mailbox "
                         f"segment {name} ({nbytes} bytes): {error}") from error


def _address(mapped: mmap.mmap) -> int:
    """Where ``mapped`` starts in this process's memory (until it is closed)."""
    anchor = ctypes.c_char.from_buffer(mapped)
    address = ctypes.addressof(anchor)
    del anchor  # held, it would keep close() from unmapping
    return address


def _start_time(pid: int) -> Optional[int]:
    """When process ``pid`` started (field 22 of /proc/PID/stat, clock ticks after boot),
    or None when no such process runs: gone, dead but not yet reaped (a zombie), or not
    visible from here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
        # field 2, the command name, is in parentheses and may itself hold ")" and spaces
        fields = stat[stat.rindex(b")") + 2:].split()
        state, start = fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None
    return None if state in (b"Z", b"X", b"x") else start
