"""A call of one rank (``Call``), what it tells its peers of a buffer (``PeerBuffer``),
and the small helpers the engine's stages share."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..sched.plan import Plan

if TYPE_CHECKING:
    from .engine import Engine
    from .prepared import PreparedCall

__all__ = ["PeerBuffer", "Call", "SYMMETRIC", "digest", "callers_of", "stream_key"]


class PeerBuffer(NamedTuple):
    """What a rank tells its peers about one of its buffers for one call: ``where`` (an
    address in one process, an exported descriptor across processes) and ``nbytes``, the
    size it registered, which bounds every byte a peer's plan may touch in it.  A named
    tuple: it crosses processes in every call's message, and pickles as cheaply as one."""
    where: Any
    nbytes: int


@dataclass(eq=False, slots=True)  # slots: built on every call, and half the cost to build
class Call:
    """One call of one rank, from ``prepare`` to the end of its work: what is its own
    (its number, its caller's stream, its peers' buffers) beside its ``prepared`` part,
    which calls of the same shape on the same buffers share."""
    name: str                  # the public call: "all_gather", "send", ...
    plan: Plan
    key: tuple                 # matches it across ranks: ("coll", n) or ("pair", s, r, n)
    signature: tuple           # what every participant must agree on
    local: Dict[str, Any]      # buffer name -> address on this rank
    shared: Dict[str, PeerBuffer]  # what the peers need of this rank's buffers
    keepalive: Tuple[Any, ...]
    caller: Any                # the caller's stream
    engine: "Engine"
    prepared: "PreparedCall"
    value: int = 0             # this rank's call number: its entry and completion value
    issued: bool = False
    #: whether the caller's stream waits for the call yet (``enqueue``, ``fence_callers``)
    fenced: bool = False
    #: captured into a CUDA graph (``Executor.issue`` with callers): not numbered, not in flight
    captured: bool = False
    #: run on the caller's stream itself (``Executor.issue_on_caller``): a direct kernel, or
    #: a one-lane plan's memory operations and copies; no entry event, no fence, the
    #: call's last step writes the completion value
    on_caller: bool = False
    base: int = 0              # the signal base it was issued with
    entry: Any = None          # event marking the caller's position at call time
    issued_at: float = 0.0     # when its steps were enqueued (the watchdog's clock)
    peers: Dict[int, Dict[str, PeerBuffer]] = field(default_factory=dict)
    #: the peers' buffers as this rank can tell them without asking (registered windows,
    #: see ``hoccl._windows``): the call may be issued at once; None if it cannot
    fast: Optional[Dict[int, Dict[str, PeerBuffer]]] = None


#: the collectives whose every rank plays the same part, so that a peer's buffer of a name
#: can be taken to sit where this rank's does (``Preparer._fast_peers``); a rooted
#: collective's buffers differ by role (an in-place root's buffer is not where the
#: others' are), and send/recv name different buffers on the two sides
SYMMETRIC = frozenset({"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "barrier"})


def digest(signature: tuple) -> int:
    """A nonzero 64-bit digest of a call's signature, the same in every process (Python's
    ``hash`` of a string is not)."""
    value = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    return int.from_bytes(value, "little") or 1


def callers_of(calls: Sequence[Call]) -> List[Any]:
    """The distinct caller streams of ``calls``, in call order."""
    callers: Dict[Any, Any] = {}
    for call in calls:
        callers.setdefault(stream_key(call.caller), call.caller)
    return list(callers.values())


def stream_key(stream: Any) -> Any:
    """Streams compare by handle (CUDA handles are ints); host streams by identity."""
    try:
        return int(stream)
    except (TypeError, ValueError):
        return id(stream)
