"""Call matching: what every ``Group`` offers, and what its two kinds share.

A ``Group`` takes each rank's enqueued calls from its engine (``Engine.submit``, or
``group_end`` for a ``hoccl.group()``'s; ``Engine.enqueue`` has already fenced the
caller's stream), matches them with the other participants' calls, checks that every
participant agrees on what the call is, and hands each matched call back to its rank's
engine (``Engine.issue``) — or, on a disagreement, completes every participant's call
unrun (``Engine.release``) and raises ``MismatchError``.  It talks to an engine only
through its methods (``hoccl._engine.CallEngine`` for a call's engine).  A call flows
Communicator → Engine.submit → Group → Engine.issue.
"""

from __future__ import annotations

import logging
import pickle
from typing import (TYPE_CHECKING, Any, Dict, FrozenSet, List, Optional, Protocol, Sequence,
                    Tuple)

from .._errors import InvalidArgumentError, MismatchError
from .._mailbox import Notice
from .._windows import window_ref

if TYPE_CHECKING:
    from .._engine import Call, Engine, PeerBuffer
    from .._health import Health

log = logging.getLogger("hoccl")

__all__ = ["Group"]


class Group(Protocol):
    """What the Communicator hands its calls to."""

    #: peers live in other processes: buffers travel as export descriptors
    exported: bool
    #: the ranks of the communicator
    world_size: int

    def post(self, calls: Sequence["Call"]) -> None:
        """Offer ``calls`` (one rank's enqueued calls, in call order; several inside
        ``hoccl.group()``) to the other participants."""

    def complete(self, calls: Sequence["Call"]) -> None:
        """Match the posted ``calls`` with the other participants' and issue them, now or
        when the peers' calls arrive (``LocalGroup``).  A disagreement releases the
        participants' calls and raises ``MismatchError``."""

    def issued_without_asking(self, calls: Sequence["Call"]) -> None:
        """The posted ``calls`` were issued at once, their peers' buffers told without
        asking (a replay across processes, ``Engine.replay``): check the peers'
        descriptions of them when they come."""

    def withdraw(self, call: "Call") -> None:
        """``call`` will never be issued (its rank closes): forget it."""

    def siblings(self, health: "Health") -> List["Health"]:
        """The monitors of the other ranks of this process."""

    def forget_calls(self) -> None:
        """After an abort: no held call will ever be issued."""

    def waiting_for(self, call: "Call") -> List[int]:
        """The participants that have not made ``call`` yet."""

    def dead_peer(self) -> Optional[str]:
        """A description of a peer whose process is gone, if one is."""

    def closed_peer(self, calls: Sequence["Call"]) -> Optional[str]:
        """A description of a participant of one of ``calls`` that closed the communicator
        without making that call (it never will), if one did."""

    def gone_peers(self) -> FrozenSet[int]:
        """The peers known to have closed the communicator or exited: nothing of theirs
        waits for a signal any more, so an abort's poison skips them."""

    def announce(self, kind: str, reason: str) -> None:
        """This rank aborted (``kind``: "diverged" or "aborted", and why): tell the peers,
        whose waits its poison releases, why."""

    def peer_abort(self, peer: int) -> Optional[Notice]:
        """Why ``peer`` aborted, if it has said (``announce``)."""

    def leave(self, engine: "Engine", leak: bool) -> None:
        """``engine``'s rank has closed its streams: free what can be freed."""

    def register(self, engine: "Engine", buffer: Any, verdict: Optional[str]) -> Any:
        """Register ``buffer`` as ``engine``'s next window (``Communicator.register``)."""

    def deregister(self, engine: "Engine", window: Any, verdict: Optional[str]) -> None:
        """Drop ``window`` (``Communicator.deregister``)."""

    def check(self) -> None:
        """Check what has come of the peers' descriptions of calls issued without them
        (registered buffers); raise DivergedError on a difference.  Never waits."""

    def settle(self, call: str) -> None:
        """Wait for, and check, every description still due for such calls."""

    def flush_stale(self) -> None:
        """Send the folds of calls issued without asking that have waited long enough
        (``hoccl._groups.folds``): the watchdog's part, for a rank that stopped calling."""

    def refuse(self, name: str, key: tuple, participants: Sequence[int], reason: str,
               rank: int) -> None:
        """Rank ``rank`` refused its call ``name`` of ``key`` (wrong arguments): offer the
        refusal in its place, so the participants' matching calls are released."""


def refused_signature(name: str, reason: str) -> Tuple:
    """What a rank offers in place of its call ``name`` that it refused (``reason``: its
    error), so that its peers release their matching calls: no call's signature."""
    return (("refused", name), ("reason", reason))


def _disagreement(call: "Call", rank: int, peer: int, theirs: Tuple) -> str:
    if theirs and theirs[0][0] == "refused":
        return (f"{call.name}: rank {peer} refused its matching {theirs[0][1]} "
                f"({dict(theirs).get('reason', '')}): this rank's call is not run either; "
                f"the communicator stays usable")
    return (f"{call.name}: rank {rank} called {_describe(call.signature)} but rank {peer} "
            f"called {_describe(theirs)}")


def _named(key: tuple) -> str:
    """A call's key as the user knows it: "collective call 3", "send/recv 2 from rank 0
    to rank 1", "register"."""
    if key and key[0] == "coll":
        return f"collective call {key[1]}"
    if key and key[0] == "pair":
        return f"send/recv {key[3]} from rank {key[1]} to rank {key[2]}"
    if key and key[0] == "agree":
        return str(key[1])
    return repr(key)


def _silent(call: "Call") -> bool:
    """Whether ``call`` goes without a message to its peers: a direct kernel's eager call
    (on its caller's stream) whose peers' rings are known (``Call.fast``).  Its peers touch
    nothing of this rank's but its ring, within the size they learned, and its kernel
    compares the call's signature with theirs on the device (``DirectProgram``): a peer
    making another call is reported by both ranks' next call or synchronize
    (``Communicator._diverged``).  Both sides of a call always agree on this: it depends
    on the call and on what each learned of the other's ring in the calls before, the
    same on every rank while their sequences of calls agree."""
    return (call.on_caller and bool(call.prepared.direct) and call.fast is not None
            and not call.captured)


def _describe(signature: Tuple) -> str:
    return "(" + ", ".join(f"{key}={value!r}" for key, value in signature) + ")"


#: how every DivergedError ends
_ABORTED = ("the communicator is aborted (outputs undefined, nothing written outside the "
            "registered windows)")


def _where(where: Any) -> str:
    ref = window_ref(where)
    if ref is not None:
        return f"offset {ref[1]} of registered window #{ref[0]}"
    return "an unregistered buffer"


def _misplaced(name: str, taker: int, owner: int, took: tuple,
               passed: Dict[str, "PeerBuffer"]) -> Optional[str]:
    """What ``taker``, which issued call ``name`` without asking, took ``owner``'s buffers
    to be (``took``: (buffer name, where) pairs, at the same places as its own), against
    what ``owner`` passed: a description of the first difference, if any."""
    for buffer_name, where in took:
        declared = passed.get(buffer_name)
        if declared is None or declared.where != where:
            return (f"{name}: rank {taker} ran its call on registered buffers taking rank "
                    f"{owner}'s {buffer_name} to be {_where(where)} (where its own is), but "
                    f"rank {owner} passed {_where(declared.where) if declared else 'none'}; a "
                    f"call on registered buffers needs every rank's buffer at the same offset "
                    f"of the same registered window; {_ABORTED}")
    return None


def _raise_verdicts(call: str, values: List[Any]) -> None:
    """Every rank's (index, verdict, ...) of a registration step: raise on every rank if
    any rank could not take part, or if their window indices differ."""
    problems = [f"rank {rank}: {value[1]}" for rank, value in enumerate(values) if value[1]]
    if problems:
        raise InvalidArgumentError(f"{call}: " + "; ".join(problems))
    indices = {value[0] for value in values}
    if len(indices) > 1:
        raise MismatchError(f"{call}: the ranks name different windows "
                            f"({[value[0] for value in values]}): every rank must register "
                            f"and deregister its buffers in the same order")


def _described(prepared: Any, peer: int, description: bytes
               ) -> Tuple[tuple, Dict[str, "PeerBuffer"]]:
    """``peer``'s ``(signature, shared)`` from its description of a call matched with
    ``prepared``.  Equal bytes are equal contents, so a repeated description (the peer's
    same call on the same buffers) is unpickled once and its objects reused (the engine
    then finds the prepared call's bound program by them)."""
    known = prepared.received.get(peer)
    if known is None or known[0] != description:
        known = prepared.received[peer] = (description, pickle.loads(description))
    return known[1]
