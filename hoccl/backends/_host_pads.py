"""The host backend's signal pads: every pad of the process, in use, released by its
owner, or free for reuse (``_PadPool``)."""

from __future__ import annotations

import logging
import threading
from typing import Dict, List, Tuple

import numpy as np

from ..config import environ
from ._segments import held_elsewhere, shared_bytes

__all__ = ["released_pad_writes", "pad_counts"]

log = logging.getLogger("hoccl")


class _PadPool:
    """Every signal pad of the process: in use, let go by its owner, or free for reuse.

    Peers write into a pad by address: a signal from a peer's lane, a direct kernel's,
    and the poison of a peer's abort, which the abort's pump writes again every 50 ms
    until that peer closes.  A pad is a shared segment (``shared_bytes``): a peer in
    another process maps it and holds the mapping (``HeldSegments``) until its own
    writers have stopped, so its writes land in that mapping, never in memory this
    process has freed, even after the owner has exited.  Peers in this process
    (``init_local``) write by plain address; their group gives a pad back only once
    every one of them has closed.

    A pad given back (``give_back``) is *released*: nothing of its owner reads it any
    more.  It is reused only once no mapping of another process holds it
    (``held_elsewhere``): a write into a reused pad would read as an abort of the
    communicator that has it.  Free pads are kept by size, at most ``FREE`` of each: a
    program that makes groups (or splits) often reuses the same few, and its memory
    and open files stay flat.

    With ``HOCCL_HOST_CHECK_SIGNALS=1`` a released pad is filled with ``RELEASED`` and
    checked when it is reused (and by ``released_pad_writes``): every word that changed
    is a write into a pad after its owner let go, counted in ``released_writes``."""

    FREE = 64
    #: what fills a released pad under HOCCL_HOST_CHECK_SIGNALS (no signal value)
    RELEASED = 0x5E1E_A5ED_5E1E_A5ED

    def __init__(self):
        self._lock = threading.Lock()
        self._used: Dict[int, np.ndarray] = {}  # by address
        self._released: Dict[int, np.ndarray] = {}  # by address: let go, maybe still held
        self._free: Dict[int, List[np.ndarray]] = {}  # by slots
        self.released_writes = 0

    def take(self, slots: int) -> int:
        with self._lock:
            self._sweep()
            free = self._free.get(slots)
            array = free.pop() if free else None
            if array is not None:
                self._count_writes(array)
        if array is None:
            array = shared_bytes(8 * slots).view(np.uint64)
        array[...] = 0
        with self._lock:
            self._used[array.ctypes.data] = array
        return array.ctypes.data

    def give_back(self, address: int) -> None:
        """The owner of the pad at ``address`` is done with it, and so is every peer in
        this process; peers elsewhere may still hold it."""
        with self._lock:
            array = self._used.pop(address, None)
            if array is None:
                return
            if _checking():
                array[...] = self.RELEASED
            self._released[address] = array
            self._sweep()

    def _sweep(self) -> None:
        """Released pads that no other process holds any more become free (or go)."""
        for address, array in list(self._released.items()):
            if held_elsewhere(array):
                continue
            del self._released[address]
            free = self._free.setdefault(len(array), [])
            if len(free) < self.FREE:
                free.append(array)
            else:
                self._count_writes(array)  # its segment is freed with the array

    def _count_writes(self, array: np.ndarray) -> None:
        if not _checking():
            return
        changed = int(np.count_nonzero(array != np.uint64(self.RELEASED)))
        if changed:
            self.released_writes += changed
            log.error("signal pad at %#x: %d word(s) written after its owner released it "
                      "(HOCCL_HOST_CHECK_SIGNALS)", array.ctypes.data, changed)
        array[...] = self.RELEASED

    def check_released(self) -> int:
        """Check every released and free pad now; ``released_writes``."""
        with self._lock:
            self._sweep()
            if _checking():
                for array in self._released.values():
                    self._count_writes(array)
                for free in self._free.values():
                    for array in free:
                        self._count_writes(array)
            return self.released_writes

    def counts(self) -> Tuple[int, int]:
        """(pads in use or released but still held by another process, free pads)."""
        with self._lock:
            self._sweep()
            return (len(self._used) + len(self._released),
                    sum(len(free) for free in self._free.values()))


def _checking() -> bool:
    return environ("HOCCL_HOST_CHECK_SIGNALS") == "1"


_PADS = _PadPool()


def released_pad_writes() -> int:
    """How many words of this process's signal pads were written after their owner had
    released them (``HOCCL_HOST_CHECK_SIGNALS=1``; 0 when unchecked).  Peers' writes
    into a pad that still holds its place in their mapping are not such writes until
    the owner has let go of it."""
    return _PADS.check_released()


def pad_counts() -> Tuple[int, int]:
    """(signal pads in use or held by a peer, free pads) of this process."""
    return _PADS.counts()
