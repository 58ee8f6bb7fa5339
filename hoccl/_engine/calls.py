"""A call of one rank (``Call``), its prepared part (``PreparedCall``, and the part
every call of its shape shares, ``ShapePlan``: ``prepared`` makes and caches them), what
it tells its peers of a buffer (``PeerBuffer``), what the engine asks of the group that
matches its calls (``Matcher``) and the group of a call's engine (``CallEngine``), and
the small helpers the engine's stages share."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Protocol, Sequence, Set, Tuple

from .._errors import HocclError
from ..sched import Shape
from ..sched.plan import Plan

__all__ = ["PeerBuffer", "Peers", "ShapePlan", "PreparedCall", "Call", "CallEngine", "Matcher",
           "SYMMETRIC", "ABANDONED", "digest", "callers_of", "stream_key"]

#: the signature of a call whose ``hoccl.group()`` body raised (``hoccl._group_calls``):
#: it matches no call a rank made, so a peer that made the call raises MismatchError; where
#: every participant abandoned it, it matches, and no rank runs it (``Engine.issue``)
ABANDONED = (("abandoned", "the body of its hoccl.group() raised"),)


class PeerBuffer(NamedTuple):
    """What a rank tells its peers about one of its buffers for one call: ``where`` (an
    address in one process, an exported descriptor across processes) and ``nbytes``, the
    size it registered, which bounds every byte a peer's plan may touch in it.  A named
    tuple: it crosses processes in every call's message, and pickles as cheaply as one."""
    where: Any
    nbytes: int


#: the peers' buffers of a call: peer -> buffer name -> what the peer told
Peers = Dict[int, Dict[str, PeerBuffer]]


@dataclass(eq=False, slots=True)
class ShapePlan:
    """What every call of one shape has in common on this rank, whatever its buffers."""
    shape: Shape
    plan: Plan
    signature: tuple           # what every participant must agree on
    buffers: Tuple[Tuple[str, int], ...]  # (name, bytes the plan uses) of each non-empty buffer
    shared: Tuple[str, ...]    # the names of those that peers' steps touch
    #: bytes the plan reaches into each peer's buffer, by (peer, name): the bounds check
    reach: Dict[Tuple[int, str], int]
    marks: int                 # events its program records (``Executor.reserve``)
    compiled: Tuple[tuple, ...]  # this rank's eager program (``Executor.compile``)
    #: its reductions' SM cap from the tuning table's row (None: the communicator's)
    max_sms: Optional[int] = None
    #: this rank's eager program uses one lane at most (a plan of several lanes may use
    #: one on this rank: world 1's own-block copy): it may run on the caller's stream
    one_lane: bool = False


@dataclass(eq=False, slots=True)
class PreparedCall:
    """One call shape on one set of this rank's buffers, ready to be issued."""
    part: ShapePlan
    plan: Plan
    direct: int                # the plan's direct-kernel blocks (``Plan.kernel_blocks``), or 0
    signature: tuple
    captured: bool
    local: Dict[str, Any]      # buffer name -> address on this rank
    sizes: Dict[str, int]      # buffer name -> bytes it holds
    #: what the peers are told of this rank's buffers; the names in ``exports`` are
    #: exported afresh on every call (unregistered buffers across processes: only the
    #: device can tell a reallocation at the same address)
    shared: Dict[str, PeerBuffer]
    exports: Tuple[str, ...]
    fast: Optional[Peers]      # the peers' buffers told without asking, or None
    #: ``(name, where)`` of every peer buffer in ``fast``, by peer: what the group tells
    #: each peer this rank took its buffers to be
    used: Optional[Dict[int, tuple]]
    compiled: Tuple[tuple, ...]
    marks: int                 # events its program records (``Executor.reserve``)
    digest: int                # a direct kernel's signature digest (0: none)
    epoch: int                 # ``Engine.layout_epoch`` when it was made
    #: the bound program, and the peers' buffers it was bound for
    program: Optional[Tuple[tuple, ...]] = None
    bound_to: Any = None
    #: the group's pickled description of the call, and the ``shared`` it describes
    description: Optional[Tuple[Dict[str, PeerBuffer], bytes]] = None
    #: each peer's last description of its matching call, and what it decoded to
    received: Dict[int, Tuple[bytes, Any]] = dataclasses.field(default_factory=dict)
    loaded: bool = False       # its direct kernel is loaded (``Executor.load``)
    #: the peers that have this call's description (issued without asking): its repeats
    #: with them are folded, not sent (``hoccl._groups.folds``)
    told: Set[int] = dataclasses.field(default_factory=set)
    #: by peer: what this rank and the peer must agree on in each of its calls
    #: (``hoccl._groups.folds.view``)
    views: Dict[int, bytes] = dataclasses.field(default_factory=dict)

    @property
    def bound_without_asking(self) -> bool:
        """Whether it is bound already for the peers' buffers told without asking: issuing
        it again maps nothing, so its caller may be fenced before it is issued."""
        return self.fast is not None and self.bound_to is self.fast and self.program is not None


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
    engine: "CallEngine"
    prepared: PreparedCall
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


class CallEngine(Protocol):
    """What a call's engine (``Engine``) offers the group that matches the call."""

    rank: int

    @property
    def completed(self) -> int:
        """The completion value of the latest finished call."""

    def issue(self, calls: Sequence[Call], imported: bool) -> None:
        """Enqueue the steps of ``calls``, their peers' buffers in ``call.peers``."""

    def release(self, call: Call) -> None:
        """Complete ``call`` without running it."""

    def fence_callers(self, calls: Sequence[Call]) -> None:
        """Make every caller stream of ``calls`` wait for the last of them."""

    def fail_later(self, error: HocclError) -> None:
        """The rank's next synchronize raises ``error``."""

    def still_captured(self, call: Call) -> bool:
        """Whether captured ``call``'s caller stream is still in an open capture."""

    def learn(self, peers_of_calls: Any) -> None:
        """Remember the peers' scratch and rings told in these calls' ``peers``."""

    def count_issued_fast(self, calls: int) -> None:
        """``calls`` were issued without asking the peers."""


class Matcher(Protocol):
    """What the engine hands its calls to for matching (``hoccl._groups.Group``): it
    matches them with the peers' calls and issues them (``Engine.issue``), or releases
    them and raises."""

    #: peers live in other processes: buffers travel as export descriptors
    exported: bool

    def post(self, calls: Sequence[Call]) -> None:
        """Offer ``calls`` (one rank's, in call order) to the other participants."""

    def complete(self, calls: Sequence[Call]) -> None:
        """Match the posted ``calls`` with the participants' and issue them."""

    def issued_without_asking(self, calls: Sequence[Call]) -> None:
        """The posted ``calls`` (each ``fast``) were issued at once: check the peers'
        descriptions of them when they come."""


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


#: per stream type: whether its streams convert to an int (their handle)
_BY_HANDLE: Dict[type, bool] = {}


def stream_key(stream: Any) -> Any:
    """Streams compare by handle (CUDA handles are ints); host streams by identity.  Asked
    once per type (a failed ``int()`` costs a raised exception on every call)."""
    kind = type(stream)
    by_handle = _BY_HANDLE.get(kind)
    if by_handle is None:
        try:
            int(stream)
            by_handle = True
        except (TypeError, ValueError):
            by_handle = False
        _BY_HANDLE[kind] = by_handle
    return int(stream) if by_handle else id(stream)
