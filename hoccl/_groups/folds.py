"""Calls issued without asking, checked without a message each: folds.

A call a rank issues without its peers' descriptions (``Call.fast``: its peers' buffers
told by registered windows, or rings and scratch described before) is checked all the
same: every participant must agree on its signature, and each must have taken its
peers' buffers to be where those peers passed them (``base._misplaced``).  The first
call of a prepared call with a peer sends the peer its description, as every other call
does.  Its repeats with that peer send nothing: each side folds the call into a record
of its own, and the two records are compared by digest when a message goes anyway.

What a call's fold holds (``view``) is built on each side from what that side knows, in
an order both share: the signature, then for the lower rank of the pair and then the
higher, where that rank's buffers are (a rank's own as it passed them, its peer's as it
took them).  The two views of a call are the same bytes exactly when the two ranks
agree on it.  A fold's digest is the blake2b of its calls' keys and views, in call order.

When the records are compared: a sender's fold with a peer goes as one digest message
(``DIGEST``) before any other message to that peer (a call that asks, a refusal, a
registration), at ``synchronize`` and ``close``, every ``FOLD_CALLS`` calls, and, from
the watchdog, once it is ``FOLD_SECONDS`` old.  The receiver folds its own calls as it
makes them and compares once it has made as many (``Due``); a difference aborts the
communicator with a DivergedError naming the calls the digest covered, on both ranks
(the one that found it aborts, and its peers' waits end on its abort notice).
"""

from __future__ import annotations

import hashlib
import pickle
import time
from collections import deque
from typing import Any, List, Optional, Tuple

from ..sched.plan import RING

__all__ = ["FOLD_CALLS", "FOLD_SECONDS", "DIGEST", "view", "Folds", "Due"]

#: the most calls a fold holds before it goes as a digest
FOLD_CALLS = 256
#: the age at which the watchdog sends a fold (a rank that stops calling)
FOLD_SECONDS = 0.05
#: the key of a digest message: ``(DIGEST, None, (calls, digest, first key, last key))``
DIGEST = ("digest",)


def view(prepared: Any, rank: int, peer: int) -> bytes:
    """What ``rank`` and ``peer`` must agree on in each call of ``prepared`` (a call
    ``rank`` issued without asking), as ``rank`` knows it.  Made once per prepared call
    and peer."""
    known = prepared.views.get(peer)
    if known is not None:
        return known
    plan = prepared.plan
    # the names of this rank's buffers the peer's plan touches, as ``_fast_peers`` takes them
    names = [RING] if plan.kernel_blocks else []
    names += [name for name in plan.shared(rank)
              if name != RING and plan.buffer(rank, name).nbytes]
    shared = prepared.shared
    mine = tuple(sorted((name, shared[name].where if name in shared else None)
                        for name in names))
    theirs = tuple(sorted(prepared.used[peer]))
    low, high = (mine, theirs) if rank < peer else (theirs, mine)
    known = prepared.views[peer] = pickle.dumps((prepared.signature, low, high),
                                                protocol=pickle.HIGHEST_PROTOCOL)
    return known


def _digest() -> Any:
    return hashlib.blake2b(digest_size=16)


def _add(digest: Any, key: tuple, seen: bytes) -> None:
    digest.update(repr(key).encode())
    digest.update(b"\0")
    digest.update(seen)


class Folds:
    """A rank's folds with each peer: the calls not yet sent as a digest."""

    def __init__(self, world_size: int):
        self._calls: List[List[Tuple[tuple, bytes]]] = [[] for _ in range(world_size)]
        self._since: List[float] = [0.0] * world_size  # when each fold's first call came

    def add(self, peer: int, key: tuple, seen: bytes) -> bool:
        """Fold call ``key`` (its ``view``) with ``peer``; True once the fold is full."""
        calls = self._calls[peer]
        if not calls:
            self._since[peer] = time.monotonic()
        calls.append((key, seen))
        return len(calls) >= FOLD_CALLS

    def take(self, peer: int) -> Optional[tuple]:
        """The digest message's payload of the fold with ``peer`` (then empty), or None."""
        calls = self._calls[peer]
        if not calls:
            return None
        self._calls[peer] = []
        digest = _digest()
        for key, seen in calls:
            _add(digest, key, seen)
        return (len(calls), digest.digest(), calls[0][0], calls[-1][0])

    def peers(self, older_than: float = 0.0) -> List[int]:
        """The peers with a fold (first folded more than ``older_than`` s ago)."""
        now = time.monotonic()
        return [peer for peer, calls in enumerate(self._calls)
                if calls and now - self._since[peer] >= older_than]


class Due:
    """A peer's digest, compared with this rank's own calls with it as they are checked."""

    def __init__(self, payload: tuple):
        self.left, self.expected, self.first, self.last = payload
        self.digest = _digest()
        self.names: List[str] = []

    def feed(self, records: deque, rank: int, peer: int) -> Optional[str]:
        """Fold this rank's records of its calls with ``peer`` (``(key, name, signature,
        took, prepared)``, oldest first) into the digest until it covers as many calls
        as the peer's; then the disagreement found, if any ("" while more are due)."""
        while self.left and records:
            key, name, _, _, prepared = records.popleft()
            _add(self.digest, key, view(prepared, rank, peer))
            if not self.names or self.names[-1] != name:
                self.names.append(name)
            self.left -= 1
        if self.left:
            return ""
        if self.digest.digest() == self.expected:
            return None
        return (f"{self.names[0] if self.names else 'call'}: rank {rank} and rank {peer} "
                f"ran calls {self.first} to {self.last} ({', '.join(self.names)}) on "
                f"registered buffers, and disagree on one of them: its arguments, or where "
                f"a rank's buffers are in its windows")
