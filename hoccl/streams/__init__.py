"""The stream manager: copy lanes per device, fences against the caller's stream.

Each rank owns ``lanes`` non-blocking, high-priority copy streams and two words of
its signal pad: *entry* and *completion*.  A call fences the caller's stream with one
batched stream-memory operation, enqueued at call time::

    caller ──write(entry = k)──wait(completion >= k)───────────────────► later work
    lane 0          wait(entry >= k) ─ plan steps ─ join(lanes) ─ write(completion = k)
    lane i          wait(entry >= k) ─ plan steps ─ record(J_i) ┘

``k`` counts this rank's calls.  Because the exit fence is a wait on a value rather
than on an event, the call may return before its copies are issued (a peer's buffers
may not be known yet) and still keep its place on the caller's stream; and because
the entry is a value, the lanes may be told to wait for it later.  Lane 0 joins
every other lane before publishing completion, so one call's lanes are idle before
the next call's steps start on that rank.
"""

from __future__ import annotations

from typing import Any, List

from ..backends._base import Device

__all__ = ["StreamManager", "WRITE", "WAIT"]

WRITE, WAIT = True, False


class StreamManager:
    """Lanes, an event pool and the entry/completion words of one rank."""

    def __init__(self, device: Device, entry_address: Any, completion_address: Any,
                 host_word_address: Any):
        self.device = device
        self.lanes: List[Any] = []
        self._free_events: List[Any] = []
        self._all_events: List[Any] = []
        self.entry = entry_address
        self.completion = completion_address
        self.host_word = host_word_address

    def ensure_lanes(self, count: int) -> None:
        while len(self.lanes) < count:
            self.lanes.append(self.device.create_stream())

    def event(self) -> Any:
        if self._free_events:
            return self._free_events.pop()
        event = self.device.create_event()
        self._all_events.append(event)
        return event

    def release(self, event: Any) -> None:
        """Return ``event`` to the pool: safe once every wait on it has been enqueued."""
        self._free_events.append(event)

    def fence_in(self, caller: Any, value: int) -> None:
        """At call time: publish the caller's position as ``entry = value`` and make the
        caller wait for ``completion >= value`` before anything it enqueues later."""
        self.device.memops(caller, [(WRITE, self.entry, value), (WAIT, self.completion, value)])

    def entry_waits(self, value: int) -> list:
        """The memop each lane starts with: wait for the caller to reach the call."""
        return [(WAIT, self.entry, value)]

    def completion_writes(self, value: int) -> list:
        """The memops lane 0 ends with: release the caller and tell the host."""
        return [(WRITE, self.completion, value), (WRITE, self.host_word, value)]

    def close(self) -> None:
        for event in self._all_events:
            self.device.destroy_event(event)
        for lane in self.lanes:
            self.device.destroy_stream(lane)
        self._all_events.clear()
        self._free_events.clear()
        self.lanes.clear()
