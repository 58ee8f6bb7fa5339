"""A rank's calls in flight: from ``Engine.enqueue`` until the device has finished them."""

from __future__ import annotations

import collections
from typing import Any, Deque, Dict, Iterator, List, Sequence, Tuple

from ..sched.plan import Plan
from ..streams import StreamManager
from .calls import Call

__all__ = ["InFlight"]


class InFlight:
    """The enqueued calls, in call order, and those of them not issued yet, by number
    (``held``: scanning the deque, which holds every call the device has not finished,
    cost each call a pass over hundreds of calls when the host runs far ahead of the
    device).  Guarded by the engine's ``lock`` (the watchdog reads it); a finished call's
    entry event goes back to the stream manager's pool."""

    def __init__(self, streams: StreamManager, lock: Any):
        self._streams = streams
        self._lock = lock
        self._calls: Deque[Call] = collections.deque()  # enqueued, in call order
        self._unissued: Dict[int, Call] = {}

    def __iter__(self) -> Iterator[Call]:
        with self._lock:
            return iter(list(self._calls))

    def add(self, call: Call, done: int) -> None:
        """``call`` was enqueued; calls issued and finished (completion ``done``) go."""
        with self._lock:
            calls = self._calls
            while calls and calls[0].issued and calls[0].value <= done:
                self._retire(calls.popleft())  # finished: its buffers may go
            calls.append(call)
            self._unissued[call.value] = call

    def needs(self) -> List[Tuple[Plan, int]]:
        """(plan, marks) of every call not issued yet: the lanes and events they will take."""
        with self._lock:
            return [(held.plan, held.prepared.marks) for held in self._unissued.values()]

    def issued(self, calls: Sequence[Call], now: float) -> None:
        """``calls`` were issued (or released) at ``now``: the watchdog's clock starts."""
        with self._lock:
            for call in calls:
                call.issued_at = now
                call.issued = True
                self._unissued.pop(call.value, None)

    def held(self) -> List[Call]:
        """Enqueued calls not yet issued."""
        with self._lock:
            return list(self._unissued.values())

    def unfinished(self, done: int) -> List[Call]:
        """Issued calls past completion value ``done``, oldest first."""
        with self._lock:
            return [call for call in self._calls if call.issued and call.value > done]

    def waiting(self) -> Tuple[List[Any], int]:
        """The entry events of the unfinished calls, and the value of the latest call run on
        its caller's stream (0: none): what ``Engine.drained`` waits for."""
        with self._lock:
            entries = [call.entry for call in self._calls if call.entry is not None]
            # a kernel on its caller's stream has run once its completion value is written
            last = max((call.value for call in self._calls if call.on_caller), default=0)
        return entries, last

    def finish(self) -> None:
        """Every call has completed: retire them all."""
        with self._lock:
            for call in self._calls:
                self._retire(call)
            self.clear()

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()
            self._unissued.clear()

    def _retire(self, call: Call) -> None:
        """``call`` finished: its entry event goes back to the pool."""
        if call.entry is not None:
            self._streams.release(call.entry)
            call.entry = None
