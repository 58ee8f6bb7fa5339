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
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

from .._errors import DivergedError
from .._mailbox import Mailboxes, wait_until
from ..sched.plan import RING
from .base import _ABORTED, _describe, _described, _misplaced, _silent

if TYPE_CHECKING:
    from .._engine import Call

__all__ = ["FOLD_CALLS", "FOLD_SECONDS", "DIGEST", "view", "Folds", "Due", "Unasked"]

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


class Unasked:
    """A process group's checks of the calls it issued without asking (``ProcessGroup``):
    the peers' descriptions and digests of them, and this rank's folds.  What it uses of
    its group is named below."""

    rank: int
    world_size: int
    timeout: float
    mailboxes: Mailboxes
    #: per peer, in call order: this rank's calls issued without the peer's description,
    #: each checked when the peer's description or digest comes
    _unchecked: List[deque]
    _folds: Folds
    _due: List[Optional[Due]]
    _sending: threading.Lock

    #: whether a peer's message is for a call this rank refused; the check of a wait for
    #: peers (alive, not aborted)
    _stale: Callable[[tuple], bool]
    _check_peers: Callable[[Sequence[int], str], None]

    def _send(self, peer: int, message: tuple, deadline: float, call: str) -> None:
        """``message`` to ``peer``, after the digest of this rank's fold with it: the peer
        checks what was folded before it takes anything sent after."""
        with self._sending:
            payload = self._folds.take(peer)
            if payload is not None:
                self.mailboxes.send(peer, (DIGEST, None, payload), deadline, call)
            self.mailboxes.send(peer, message, deadline, call)

    def _flush(self, peer: int, deadline: float, call: str) -> None:
        with self._sending:
            payload = self._folds.take(peer)
            if payload is not None:
                self.mailboxes.send(peer, (DIGEST, None, payload), deadline, call)

    def flush(self, older_than: float = 0.0) -> None:
        """Send the digest of every fold (first folded at least ``older_than`` s ago)."""
        deadline = time.monotonic() + self.timeout
        for peer in self._folds.peers(older_than):
            self._flush(peer, deadline, "flush")

    def flush_stale(self) -> None:
        """The watchdog's part: send the folds of a rank that stopped calling."""
        self.flush(FOLD_SECONDS)

    def _expect(self, call: "Call") -> None:
        """``call`` was issued without its peers' descriptions: check them when they come."""
        if _silent(call):
            return
        used = call.prepared.used
        assert used is not None and call.peers is call.fast, "issued without asking"
        for peer, took in used.items():
            self._unchecked[peer].append((call.key, call.name, call.signature, took,
                                          call.prepared))

    def _ready(self, peer: int) -> bool:
        """Whether ``peer``'s next message for a call still to be matched has come (the
        checks of calls issued without it are taken first)."""
        self._check_peer(peer)
        due = self._due[peer]
        if due is not None:  # the peer folded calls that this rank makes otherwise
            self._refuse_digest(peer, DIGEST, (due.left, b"", due.first, due.last), "call")
        return not self._unchecked[peer] and self.mailboxes.ready(peer)

    def _refuse_digest(self, peer: int, key: tuple, payload: Any, call: str) -> None:
        """A digest where this rank waits for a call's message: the peer ran calls on
        registered buffers, without asking, that this rank did not make so."""
        if key == DIGEST:
            calls, _, first, last = payload
            raise DivergedError(
                f"{call}: rank {peer} ran {calls} call(s) ({first} to {last}) on registered "
                f"buffers without asking, but rank {self.rank} made them otherwise (its "
                f"buffers of them are not in its windows, or it made other calls); {_ABORTED}")

    def check(self) -> None:
        """Check every peer's description or digest that has come for calls issued without
        it; raise DivergedError if one differs from what this rank took it to be.  Never
        waits."""
        for peer in range(self.world_size):
            if self._unchecked[peer]:
                self._check_peer(peer)

    def _check_peer(self, peer: int) -> None:
        pending = self._unchecked[peer]
        self._compare(peer)
        while pending and self.mailboxes.ready(peer):
            got_key, description, payload = self.mailboxes.receive(peer)
            if self._stale(got_key):
                continue
            if got_key == DIGEST:
                self._due[peer] = Due(payload)
                self._compare(peer)
                continue
            key, name, signature, used, prepared = pending.popleft()
            if got_key != key:
                raise DivergedError(
                    f"{name}: rank {self.rank} ran call {key} on registered buffers, but rank "
                    f"{peer}'s call was {got_key}: the ranks' sequences of calls differ; "
                    f"{_ABORTED}")
            theirs, shared = _described(prepared, peer, description)
            if theirs != signature:
                raise DivergedError(
                    f"{name}: rank {self.rank} ran {_describe(signature)} on registered "
                    f"buffers, but rank {peer} called {_describe(theirs)}; {_ABORTED}")
            problem = _misplaced(name, self.rank, peer, used, shared)
            if problem is not None:
                raise DivergedError(problem)

    def _compare(self, peer: int) -> None:
        """Fold this rank's records of its calls with ``peer`` into the peer's digest that
        came (``Due``); raise DivergedError once it covers them all and differs."""
        due = self._due[peer]
        if due is None:
            return
        problem = due.feed(self._unchecked[peer], self.rank, peer)
        if problem == "":
            return
        self._due[peer] = None
        if problem is not None:
            raise DivergedError(f"{problem}; {_ABORTED}")

    def settle(self, call: str) -> None:
        """Send this rank's folds, then wait (bounded by the timeout and the peers'
        liveness) for the descriptions or digests of every call issued without them, and
        check them (``check``)."""
        self.flush()
        deadline = time.monotonic() + self.timeout
        # a peer's digest may have come before this rank made the calls it covers: its
        # calls made since are compared now, or the wait would be for a message the peer
        # has sent already
        self.check()
        waiting = [peer for peer in range(self.world_size) if self._unchecked[peer]]
        while waiting:
            wait_until(lambda: any(self.mailboxes.ready(peer) for peer in waiting), deadline,
                       lambda: f"{call}: rank {self.rank} waited {self.timeout:g} s for ranks "
                               f"{waiting} to make the calls it ran on registered buffers; they "
                               f"never did",
                       check=lambda: self._check_peers(waiting, call))
            self.check()
            waiting = [peer for peer in waiting if self._unchecked[peer]]
