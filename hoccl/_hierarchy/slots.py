"""The staged engine's memory on a device: pinned slots, two lanes and their events
(``Stager``), and the same interface for a member whose arrays are in host memory
(``HOST_COPIES``: it stages nothing, but cuts its steps into its peers' chunks)."""

from __future__ import annotations

import ctypes
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["HOST_COPIES", "SLOTS", "Stager"]

#: pinned slots per direction, and so the transfers of one step in flight at a time on
#: every member (a member in host memory keeps as many)
SLOTS = 2


class Stager:
    """Pinned slots, two lanes and their events on one GPU (hoccl's device handle)."""

    def __init__(self, device: Any, slot_bytes: int, allocate: Callable[[int], np.ndarray],
                 release: Optional[Callable[[np.ndarray], None]] = None):
        self.device, self.slot_bytes, self.release = device, slot_bytes, release
        self.lanes = (device.create_stream(), device.create_stream())   # out, in
        self.out_done = [device.create_event() for _ in range(SLOTS)]
        self.in_done = [device.create_event() for _ in range(SLOTS)]
        self.in_used = [False] * SLOTS
        self.started = device.create_event()
        self.pinned: List[Tuple[np.ndarray, np.ndarray]] = [
            (allocate(slot_bytes), allocate(slot_bytes)) for _ in range(SLOTS)]  # (out, in)

    def close(self, timeout: float) -> None:
        """After the copies in flight (a copy in reads the pinned slots)."""
        for lane in self.lanes:
            self.device.synchronize_stream(lane, timeout)
        if self.release is not None:
            for pair in self.pinned:
                for slot in pair:
                    self.release(slot)
        for event in self.out_done + self.in_done + [self.started]:
            self.device.destroy_event(event)
        for lane in self.lanes:
            self.device.destroy_stream(lane)


class _HostCopies:
    """The device interface for arrays in host memory: each copy is done when issued, so
    every event has been reached (a rank on hoccl's host backend stages nothing, but
    cuts its steps into the chunks its peers cut theirs)."""

    def activate(self) -> None:
        pass

    def resolve_stream(self, stream: Any, arrays: Sequence[Any]) -> None:
        return None

    def create_stream(self) -> None:
        return None

    def destroy_stream(self, stream: Any) -> None:
        pass

    def create_event(self) -> None:
        return None

    def destroy_event(self, event: Any) -> None:
        pass

    def record(self, stream: Any, event: Any) -> None:
        pass

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def done(self, event: Any) -> bool:
        return True

    def synchronize_stream(self, stream: Any, timeout: float) -> None:
        pass

    def copy(self, stream: Any, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)


HOST_COPIES = _HostCopies()
