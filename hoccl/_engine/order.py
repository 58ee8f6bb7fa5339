"""What a rank's caller streams and lanes are ordered after: a call waits for the one
before it only where nothing orders it yet."""

from __future__ import annotations

import collections
from typing import Any, Deque, Optional, Sequence, Tuple

from .calls import stream_key

__all__ = ["Order"]


class Order:
    """The latest completion value the caller streams and lane 0 are known to wait for,
    and the latest direct calls (to name the one a kernel found a peer's other call
    beside, ``Engine.diverged_call``)."""

    def __init__(self) -> None:
        #: the latest completion value some caller streams are known to wait for, and
        #: those streams (by ``stream_key``): a direct kernel on one of them needs no wait
        #: for the previous call (``Engine.issue``)
        self.ordered: Tuple[int, set] = (0, set())
        #: the value of the latest call run on its caller's stream that lane 0 has not been
        #: ordered after yet: its next completion write waits for it first
        self.lanes_after = 0
        #: (value, name, signature) of the latest direct calls on callers' streams
        self._direct_calls: Deque[Tuple[int, str, tuple]] = collections.deque(maxlen=256)

    def note(self, value: int, callers: Sequence[Any]) -> None:
        """``callers`` now wait for completion ``value`` before their later work."""
        keys = {stream_key(caller) for caller in callers}
        if value > self.ordered[0]:
            self.ordered = (value, keys)
        elif value == self.ordered[0]:
            self.ordered[1].update(keys)

    def direct(self, value: int, name: str, signature: tuple) -> None:
        """Direct call ``value`` (``name``, ``signature``) was issued on its caller's stream."""
        self._direct_calls.append((value, name, signature))

    def direct_call(self, value: int) -> Optional[Tuple[int, str, tuple]]:
        """(value, name, signature) of direct call ``value``, if it is among the latest."""
        for known in self._direct_calls:
            if known[0] == value:
                return known
        return None
