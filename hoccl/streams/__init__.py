"""The stream manager: copy lanes per device, fences against the caller's stream.

Each rank owns ``lanes`` non-blocking, high-priority copy streams, a pool of events
and a *completion* word in its signal pad.  A call fences the caller's stream at
call time::

    caller ──record(E_k)──wait(completion >= k)──────────────────────► later work
    lane 0       wait_event(E_k) ─ plan steps ─ join(lanes) ─ write(completion = k)
    lane i       wait_event(E_k) ─ plan steps ─ record(J_i) ┘

``k`` counts this rank's calls.  The entry is an event of its own per call (taken
from the pool at call time, returned when the call has finished): a lane waits for
exactly its caller's position, whichever streams other calls came from, and the
event tells teardown whether the caller's stream has reached the call at all.
The exit is a wait on a value rather than on an event, so the call may return
before its copies are issued (a peer's buffers may not be known yet) and still keep
its place on the caller's stream; lane 0 joins every other lane and runs the calls
in order, so completion values only grow.

A direct kernel's call across processes, or a call whose plan takes one lane
(``Executor.issue_on_caller``), runs on the caller's stream itself and writes the
completion value at its end; a stream not yet ordered after the previous call waits for
its value first, and the lanes of the next call wait for this one's before their first
step (``Executor.issue`` with ``after``), so values still grow in call order and each
rank's signals into a peer's slot land in call order.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, List

from ..backends._base import Device, MemOp

__all__ = ["StreamManager"]


class StreamManager:
    """Lanes, an event pool and the entry/completion words of one rank."""

    def __init__(self, device: Device, completion_address: Any, host_word_address: Any,
                 error_word_address: Any = None):
        self.device = device
        self.lanes: List[Any] = []
        #: lanes of calls captured into CUDA graphs: while a capture is open, the lanes it
        #: has forked stay in it, so eager calls must never share them
        self.capture_lanes: List[Any] = []
        self._free_events: List[Any] = []
        self._all_events: List[Any] = []
        self.completion = completion_address
        self.host_word = host_word_address
        #: where a direct kernel that met a peer's other call writes that call's value
        self.error_word = error_word_address

    def ensure_lanes(self, count: int) -> None:
        while len(self.lanes) < count:
            self.lanes.append(self.device.create_stream())

    def ensure_capture_lanes(self, count: int) -> None:
        while len(self.capture_lanes) < count:
            self.capture_lanes.append(self.device.create_stream())

    def reserve_events(self, count: int) -> None:
        """Have at least ``count`` events in the pool, created now rather than mid-call."""
        while len(self._free_events) < count:
            event = self.device.create_event()
            self._all_events.append(event)
            self._free_events.append(event)

    def event(self) -> Any:
        if self._free_events:
            return self._free_events.pop()
        event = self.device.create_event()
        self._all_events.append(event)
        return event

    def release(self, event: Any) -> None:
        """Return ``event`` to the pool: safe once every wait on it has been enqueued."""
        self._free_events.append(event)

    def fence_in(self, caller: Any, value: int, wait: bool = True) -> Any:
        """At call time: mark the caller's position with an event of this call's own, and
        (``wait``) make the caller wait for ``completion >= value`` before anything
        enqueued later.  Returns the event; ``release`` it once the call has finished.

        The calls of one ``hoccl.group()`` mark their positions only; ``fence_out``
        then makes each caller wait once for the group's last value (a wait between
        them would hold the later calls' entries behind a completion written only after
        all of them)."""
        event = self.event()
        self.device.record(caller, event)
        if wait:
            self.device.wait_value(caller, self.completion, value)
        return event

    def fence_out(self, caller: Any, value: int) -> None:
        """Make ``caller`` wait for ``completion >= value`` before its later work."""
        self.device.wait_value(caller, self.completion, value)

    def reach(self, value: int) -> list:
        """The memop that holds a stream until the completion word reaches ``value`` (a
        call that ran on its caller's stream, which later calls must follow: their
        signals share the peers' slots, and completion values only grow); none for 0."""
        return [(MemOp.WAIT, self.completion, value)] if value else []

    def completion_writes(self, value: int, after: int = 0) -> list:
        """The memops lane 0 ends with: tell the host, then release the caller (``after``:
        first wait for the completion word to reach it, the value of an earlier call that
        ran on its caller's stream rather than on the lanes).  The host's word goes first:
        a later call on another stream starts once the completion word has the value and
        writes its own into the host's word; written second, this call's could land after
        it and lower it, and the host would wait for the later call for ever."""
        return self.reach(after) + [(MemOp.WRITE, self.host_word, value),
                                    (MemOp.WRITE, self.completion, value)]

    def drained(self, entries: Iterable[Any], timeout: float,
                until: Callable[[], bool] = lambda: True) -> bool:
        """Whether, within ``timeout`` s, every caller stream has reached its call (the
        ``entries``), ``until()`` holds (the kernels run on callers' streams have written
        their completion values) and every lane is idle: then no queued work of this rank
        will touch its pad, scratch or mappings again.  After an abort a caller stream can
        be held by the user's own work for ever; teardown must then keep the memory."""
        marks = []
        for lane in self.lanes:
            event = self.event()
            self.device.record(lane, event)
            marks.append(event)
        waiting = list(entries) + marks
        deadline = time.monotonic() + timeout
        delay = 0.0
        try:
            while True:
                waiting = [event for event in waiting if not self.device.done(event)]
                if not waiting and until():
                    return True
                if time.monotonic() > deadline:
                    return False
                time.sleep(delay)
                delay = min(delay * 2 + 1e-5, 0.01)
        finally:
            for event in marks:
                self.release(event)

    def close(self) -> None:
        for event in self._all_events:
            self.device.destroy_event(event)
        for lane in self.lanes + self.capture_lanes:
            self.device.destroy_stream(lane)
        self._all_events.clear()
        self._free_events.clear()
        self.lanes.clear()
        self.capture_lanes.clear()
