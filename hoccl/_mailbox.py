"""Shared-memory mailboxes: how the ranks of one host swap per-call descriptors.

Every rank owns one segment in ``/dev/shm`` holding one single-producer,
single-consumer ring per peer (the messages that peer sends it).  A ring is a
header of two counters (messages written, messages read) and ``SLOTS`` slots; the
writer fills slot ``written % SLOTS`` then bumps ``written``; the reader reads slot
``read % SLOTS`` then bumps ``read``.  Each counter has one writer, and x86 keeps
stores in order, so no lock is needed.  A message costs a pickle and two memory
copies (microseconds) instead of an MPI round trip; MPI is used only to agree on
the segments' names.  Segments are unlinked as soon as every rank has mapped them.
"""

from __future__ import annotations

import mmap
import os
import pickle
import time
import uuid
from typing import Any, Callable, List, Optional


__all__ = ["Mailboxes", "SLOT_BYTES", "wait_until"]

SLOTS = 64
SLOT_BYTES = 16 << 10
_HEADER = 64  # two counters, padded to a cache line
_RING = _HEADER + SLOTS * SLOT_BYTES


class Mailboxes:
    """This rank's view of every rank's mailbox segment."""

    def __init__(self, rank: int, world_size: int, allgather: Callable[[Any], List[Any]],
                 barrier: Callable[[], None]):
        self.rank, self.world_size = rank, world_size
        name = f"/dev/shm/hoccl-{uuid.uuid4().hex}-{rank}"
        descriptor = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(descriptor, _RING * world_size)
            own = mmap.mmap(descriptor, _RING * world_size)
        finally:
            os.close(descriptor)
        names = allgather(name)
        self._maps: List[mmap.mmap] = []
        for peer, peer_name in enumerate(names):
            if peer == rank:
                self._maps.append(own)
                continue
            descriptor = os.open(peer_name, os.O_RDWR)
            try:
                self._maps.append(mmap.mmap(descriptor, _RING * world_size))
            finally:
                os.close(descriptor)
        barrier()
        os.unlink(name)  # every rank has it mapped: nothing is left behind in /dev/shm
        # [written, read] of every ring, as 64-bit views made once (a call reads them often)
        self._views = [[memoryview(mapped)[sender * _RING:sender * _RING + 16].cast("Q")
                        for sender in range(world_size)] for mapped in self._maps]

    def _counters(self, owner: int, sender: int) -> memoryview:
        """[written, read] of the ring in ``owner``'s segment that ``sender`` writes."""
        return self._views[owner][sender]

    def send(self, peer: int, message: Any, deadline: float, call: str) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) + 4 > SLOT_BYTES:
            raise ValueError(f"{call}: a descriptor message of {len(data)} bytes does not fit "
                             f"a mailbox slot of {SLOT_BYTES}")
        counters = self._counters(peer, self.rank)
        written = counters[0]
        wait_until(lambda: written - counters[1] < SLOTS, deadline,
              lambda: f"{call}: rank {self.rank}'s mailbox to rank {peer} stayed full: rank "
                      f"{peer} stopped taking messages")
        start = self.rank * _RING + _HEADER + (written % SLOTS) * SLOT_BYTES
        box = self._maps[peer]
        box[start:start + 4] = len(data).to_bytes(4, "little")
        box[start + 4:start + 4 + len(data)] = data
        counters[0] = written + 1  # publish after the payload (stores stay in order)

    def ready(self, peer: int) -> bool:
        counters = self._views[self.rank][peer]
        return counters[0] > counters[1]

    def receive(self, peer: int) -> Any:
        """The next message from ``peer`` (call only when ``ready(peer)``)."""
        counters = self._counters(self.rank, peer)
        read = counters[1]
        start = peer * _RING + _HEADER + (read % SLOTS) * SLOT_BYTES
        box = self._maps[self.rank]
        length = int.from_bytes(box[start:start + 4], "little")
        message = pickle.loads(box[start + 4:start + 4 + length])
        counters[1] = read + 1
        return message

    def close(self) -> None:
        for views in getattr(self, "_views", ()):
            for view in views:
                view.release()
        self._views = []
        for mapped in self._maps:
            try:
                mapped.close()
            except BufferError:  # a numpy view still exists; the mapping goes with it
                pass
        self._maps.clear()


def wait_until(ready: Callable[[], bool], deadline: float, describe: Callable[[], str],
               check: Optional[Callable[[], None]] = None) -> None:
    """Poll ``ready()``: without sleeping for 2 ms (a peer usually answers within
    microseconds), then with sleeps backing off to 1 ms; HocclTimeoutError(``describe()``)
    after ``deadline``.  ``check()`` runs every 100 ms meanwhile (it raises to give up)."""
    from ._errors import HocclTimeoutError
    spin_until = time.monotonic() + 2e-3
    next_check = time.monotonic() + 0.1
    delay = 50e-6
    while not ready():
        now = time.monotonic()
        if now > deadline:
            raise HocclTimeoutError(describe())
        if check is not None and now > next_check:
            check()
            next_check = now + 0.1
        if now > spin_until:
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
