"""The stream manager: copy lanes per device, fences against the caller's stream.

Each rank owns ``lanes`` non-blocking, high-priority copy streams.  A collective
is ordered among the caller's kernels by two fences::

    caller ──record(E)──wait_value(done >= k)──────────────────────► later work
    lane 0          wait_event(E) ─ plan steps ─ join(lanes) ─ write_value(done, k)
    lane i          wait_event(E) ─ plan steps ─ record(J_i) ┘

The exit fence is a stream memory wait on the rank's completion word, enqueued
at call time, so the call may return before its copies are issued (a peer's
buffers may not be known yet) and still keep its place on the caller's stream.
Lane 0 joins every other lane before writing the completion value, so one
collective's lanes are idle before the next one's start on that rank.
"""

from __future__ import annotations

from typing import Any, List

from ..backends._base import Device

__all__ = ["StreamManager"]


class StreamManager:
    """Lanes, an event pool and the completion counter of one rank."""

    def __init__(self, device: Device, completion_address: Any):
        self.device = device
        self.lanes: List[Any] = []
        self._free_events: List[Any] = []
        self._all_events: List[Any] = []
        self._completion = completion_address
        self.completed_value = 0  # the value the last issued collective writes

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

    def fence_in(self, caller: Any, value: int) -> Any:
        """At call time: mark the caller's position (event) and make the caller wait for
        completion value ``value`` before anything it enqueues later."""
        event = self.event()
        self.device.record(caller, event)
        self.device.wait_value(caller, self._completion, value)
        return event

    def enter(self, lane_count: int, entry_event: Any) -> None:
        """At issue time: every lane the plan uses starts after the caller's mark."""
        self.ensure_lanes(lane_count)
        for lane in self.lanes[:lane_count]:
            self.device.wait_event(lane, entry_event)
        self.release(entry_event)

    def leave(self, lane_count: int, value: int, host_word_address: Any = None) -> None:
        """Join the lanes on lane 0 and publish ``value`` to the caller's fence."""
        device, first = self.device, self.lanes[0]
        for lane in self.lanes[1:lane_count]:
            event = self.event()
            device.record(lane, event)
            device.wait_event(first, event)
            self.release(event)
        device.write_value(first, self._completion, value)
        if host_word_address is not None:
            device.write_value(first, host_word_address, value)
        self.completed_value = value

    def close(self) -> None:
        for event in self._all_events:
            self.device.destroy_event(event)
        for lane in self.lanes:
            self.device.destroy_stream(lane)
        self._all_events.clear()
        self._free_events.clear()
        self.lanes.clear()
