"""A rank's device memory beyond its pad: the device it shares with the communicators
split from it (``DeviceShare``), and its reduction scratch and direct-kernel ring
(``Memory``), each made larger when a call needs more, with its export descriptor."""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Tuple

from .._errors import InvalidArgumentError
from ..backends._base import Device

__all__ = ["DeviceShare", "Memory"]


class DeviceShare:
    """The communicators of this process that use one device: the one that opened it
    (``init``, ``init_local``) and those split from it, which borrow it (and with it the
    CUDA context, peer access and the cache of imported IPC mappings, which must be one
    per process and context).  The device is closed when the last of them leaves, kept
    (``leak``) if any of them left work stuck behind a caller's stream."""

    def __init__(self, device: Device):
        self.device = device
        self._users = 1
        self._leak = False
        self._lock = threading.Lock()

    def borrow(self, call: str) -> "DeviceShare":
        """One more communicator uses the device."""
        with self._lock:
            if not self._users:
                raise InvalidArgumentError(f"{call}: the device is closed")
            self._users += 1
        return self

    def leave(self, leak: bool) -> bool:
        """One communicator is done with the device; True if it was the last, and the
        device is now closed."""
        with self._lock:
            self._users -= 1
            self._leak = self._leak or leak
            last = self._users == 0
        if last:
            self.device.close(leak=self._leak)
        return last


class Memory:
    """This rank's scratch and ring.  ``scratch_of`` and ``ring_of`` say whether they
    made a new allocation: prepared calls bound to the old one must not be reused
    (``Engine.layout_epoch``)."""

    def __init__(self, device: Device):
        self.device = device
        self.scratch: Tuple[Any, int] = (None, 0)
        #: the direct kernels' double-buffered staging (``plan.RING``): (address, half);
        #: a ring is never freed before close (a peer one call ahead may store into it,
        #: a graph may replay it), a larger one replaces it for later calls
        self.ring: Tuple[Any, int] = (None, 0)
        self.retired: List[Any] = []
        #: scratch captured into a CUDA graph: kept until the device is left
        self.pinned: set = set()
        self.kept: List[Any] = []
        #: the export descriptor of the current scratch and ring, made once per allocation
        self._exports: Dict[int, Any] = {}

    def scratch_of(self, nbytes: int) -> Tuple[Any, bool]:
        """(scratch of at least ``nbytes``, whether it is a new allocation)."""
        address, size = self.scratch
        if size >= nbytes:
            return address, False
        if address in self.pinned:
            self.kept.append(address)  # a captured graph may use it: freed at close
        elif address is not None:
            self.retired.append(address)  # earlier calls may still use it; freed on sync
        address = self.device.alloc(nbytes)
        self.scratch = (address, nbytes)
        self._exports.clear()
        return address, True

    def ring_of(self, nbytes: int, largest: int) -> Tuple[Tuple[Any, int], bool]:
        """((address, half) of a ring of two halves of at least ``nbytes`` each, whether
        it is a new allocation).  A new one is at least ``largest`` (what any direct
        kernel of the options may need), so that once the peers have learned it every
        later direct call goes without a message on every rank alike."""
        address, half = self.ring
        if half >= nbytes:
            return (address, half), False
        if address is not None:
            self.kept.append(address)  # a peer or a graph may still use it: freed at close
        half = max(nbytes, 2 * half, largest, 64 << 10)
        address = self.device.alloc(2 * half)
        self.ring = (address, half)
        self._exports.clear()
        return (address, half), True

    def export(self, address: Any, nbytes: int) -> Any:
        """The export descriptor of the scratch or ring at ``address`` (of which peers
        reach ``nbytes``, inside the allocation): made once per allocation (forgotten when
        either is replaced, so that a later allocation at the same address is exported
        afresh)."""
        key = int(address)
        where = self._exports.get(key)
        if where is None:
            where = self._exports[key] = self.device.export(address, nbytes)
        return where

    def free_retired(self) -> None:
        for address in self.retired:
            self.device.free(address)
        self.retired.clear()

    def free(self) -> None:
        """Free the scratch, the ring and every older one (the caller knows nothing uses
        them: this rank has closed, and so have its peers' calls with it)."""
        for address in self.retired + self.kept + [self.scratch[0], self.ring[0]]:
            if address is not None:
                self.device.free(address)
        self.retired, self.kept, self.scratch, self.ring = [], [], (None, 0), (None, 0)
        self.pinned.clear()
        self._exports.clear()
