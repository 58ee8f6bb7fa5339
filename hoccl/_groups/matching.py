"""What one ``ProcessGroup.complete`` waits for: a rank's calls (one, or its calls of one
``hoccl.group()`` on one communicator) while their peers' messages come.

A collective's message must be the peer's next one: the ranks make their collectives in
one order.  A send's or recv's need not: the k-th send from rank s to rank r matches the
k-th recv of r from s (the key ``("pair", s, r, k)``), however each rank batches its
sends and receives, so a pair's message that comes before this rank makes its call is
kept (``Early``) until it does.  The calls go out in call order (the engine's completion
values grow with it), each as soon as it and the calls before it are matched where a
send or recv still waits, once those issued before it have finished, so that ranks that
batch their pairs differently never wait for each other in a cycle::

    rank 0:  group[send A to 1, recv B from 1]   A goes out when rank 1's recv A comes
    rank 1:  group[recv A from 0]  ...  group[send B to 0, recv C from 0]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from .._mailbox import wait_until
from .base import _disagreement, _misplaced, _named

if TYPE_CHECKING:
    from .._engine import Call

__all__ = ["Early", "Matching", "is_pair"]

#: a peer's message: (key, description, used)
Message = Tuple[tuple, Any, Any]


def is_pair(key: tuple) -> bool:
    """Whether ``key`` is a send's or recv's (matched by its pair's sequence)."""
    return bool(key) and key[0] == "pair"


class Early:
    """The peers' messages for sends and receives this rank has not made yet, by key."""

    def __init__(self) -> None:
        self._messages: Dict[tuple, Tuple[int, Message]] = {}

    def keep(self, peer: int, message: Message) -> None:
        self._messages[message[0]] = (peer, message)

    def take(self, key: tuple) -> Optional[Tuple[int, Message]]:
        return self._messages.pop(key, None)

    def from_peers(self, peers: Sequence[int]) -> List[tuple]:
        """The keys kept from ``peers``, oldest first."""
        return [key for key, (peer, _) in self._messages.items() if peer in peers]

    def clear(self) -> None:
        self._messages.clear()


class Matching:
    """``calls`` (in call order) and their participants' messages so far: ``received[key]``
    maps a peer to its (signature, shared, used); ``issued`` calls have gone out."""

    def __init__(self, calls: Sequence["Call"], rank: int):
        self.calls = list(calls)
        self.issued = 0
        self.received: Dict[tuple, Dict[int, Tuple[tuple, Any, Any]]] = {
            call.key: {} for call in calls}
        self._expected: Dict[int, List[tuple]] = {}
        self._needed: Dict[tuple, int] = {}
        for call in calls:
            peers = [peer for peer in call.plan.participants if peer != rank]
            self._needed[call.key] = len(peers)
            for peer in peers:
                self._expected.setdefault(peer, []).append(call.key)
        self.prepared = {call.key: call.prepared for call in calls}
        self.names = {call.key: call.name for call in calls}

    def expects(self, peer: int, key: tuple) -> bool:
        return key in self._expected.get(peer, ())

    def expected_of(self, peer: int) -> List[tuple]:
        return self._expected[peer]

    def take(self, peer: int, key: tuple, signature: tuple, shared: Any, used: Any) -> None:
        keys = self._expected[peer]
        keys.remove(key)
        if not keys:
            del self._expected[peer]
        self.received[key][peer] = (signature, shared, used)

    def missing(self, pairs: bool = True) -> List[int]:
        """The peers whose messages are still to come (``pairs=False``: for a call that is
        not a send or recv)."""
        return sorted(peer for peer, keys in self._expected.items()
                      if pairs or not all(is_pair(key) for key in keys))

    @property
    def waiting(self) -> List["Call"]:
        """The calls not gone out yet."""
        return self.calls[self.issued:]

    def ready(self) -> List["Call"]:
        """The calls to issue now: every waiting call once all are matched; else, where a
        send or recv still waits for its peer, the matched ones before the first that
        waits; else none (a group of collectives goes out whole, side by side)."""
        waiting = self.waiting
        unmatched = [index for index, call in enumerate(waiting)
                     if len(self.received[call.key]) < self._needed[call.key]]
        if not unmatched:
            return waiting
        if any(is_pair(waiting[index].key) for index in unmatched):
            return waiting[:unmatched[0]]
        return []

    def wait_issued(self, rank: int, timeout: float, deadline: float,
                    check: Callable[[List[int], str], None]) -> None:
        """Wait until the calls issued so far have finished (``check(peers, name)``: the
        peers' liveness), before the next go: calls issued apart take lanes of their own,
        and a later one's completion value or signals must not land before an earlier
        one's."""
        last = self.calls[self.issued - 1]
        engine = last.engine
        peers = [peer for peer in last.plan.participants if peer != rank]
        wait_until(lambda: engine.completed >= last.value, deadline,
                   lambda: f"{last.name}: rank {rank} waited {timeout:g} s for its "
                           f"{_named(last.key)} to finish before the calls of its group after "
                           f"it (ranks {peers})",
                   check=lambda: check(peers, last.name))

    def disagreement(self, ready: Sequence["Call"], rank: int
                     ) -> Tuple[Optional[str], Optional[str]]:
        """Whether the participants of ``ready`` disagree with this rank (``rank``): a
        description of the first call that differs, and of the first a peer ran already
        taking this rank's buffers to be elsewhere (registered buffers), or None."""
        problem: Optional[str] = None
        diverged: Optional[str] = None
        for call in ready:
            for peer, (signature, _, used) in self.received[call.key].items():
                if signature != call.signature and problem is None:
                    problem = _disagreement(call, rank, peer, signature)
                if used is not None and diverged is None:
                    diverged = _misplaced(call.name, peer, rank, used, call.shared)
        return problem, diverged

    def unmatched(self, rank: int, host: str, timeout: float, missing: Sequence[int],
                  early: Sequence[tuple]) -> str:
        """Why a wait for ``missing``'s messages timed out: the calls they have not made
        (the ranks of a process group share one host), and ``early``, what they sent
        instead (sends and receives that wait for each other made outside
        ``hoccl.group()``)."""
        calls = [_named(key) for peer in missing for key in self._expected[peer]]
        instead = (f"; their calls with it that came instead: {[_named(k) for k in early]} "
                   f"(sends and receives that wait for each other must be made inside one "
                   f"hoccl.group())" if early else "")
        return (f"{self.waiting[0].name}: rank {rank} (host {host}) waited {timeout:g} s for "
                f"ranks {list(missing)} (host {host}) to make the matching calls {calls}; they "
                f"never did: a mismatched sequence of calls or a dead process{instead}")
