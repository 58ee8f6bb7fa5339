"""Prepared calls: what a call is, worked out once and kept for its repeats.

A call is turned once into a ``PreparedCall``: its plan (the selector's choice for its
shape), its signature, this rank's buffer addresses and what the peers are told of
them, the peers' buffers where this rank can tell them without asking (registered
windows, the direct kernels' rings), the compiled program and, once its peers' buffers
are known, the bound program (every address resolved) with the peers it was bound for.
A repeated call (the same shape on the same buffers) finds its prepared call in the
engine's one cache (``CallCache``) and only numbers itself, matches and issues.

The cache's policy, stated once: it holds at most ``PREPARED_CALLS`` entries, the
least recently used going first: the per-shape parts (``ShapePlan``: plan, signature,
compiled program; shared by a shape's calls on any buffers) and the prepared calls.  A
prepared call made before a change of this rank's memory layout (a larger scratch or
ring, a window registered or dropped, a peer's scratch or ring learned:
``Engine.layout_epoch``) is made afresh; a change of options empties the cache.  What is
not this cache's: the device's imports of peers' buffers (kept per allocation by the
importer, as the IPC rules need) and the scheduler's own plan cache (``build_plan``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any, Dict, FrozenSet, Optional, Protocol, Set, Tuple

from .._buffers import Buffer
from .._errors import InvalidArgumentError, MismatchError
from .._windows import WINDOW, window_ref
from ..p2p import marks_of
from ..sched import Options, Shape, build_plan, verify
from ..sched.plan import RING, Plan
from ..sched.replay import replay_problem
from ..sched.select import Choice, choose, size_of
from ..backends._base import SmCaps
from ..p2p import Executor
from ..sched.select import Table
from .._windows import Windows
from .calls import (SYMMETRIC, Call, CallEngine, PeerBuffer, Peers, PreparedCall, ShapePlan,
                    digest)
from .memory import Memory
from .sequences import Sequences

__all__ = ["PREPARED_CALLS", "CallCache", "Preparer", "Prepares"]

log = logging.getLogger("hoccl")

#: the most entries an engine's ``CallCache`` holds (shapes and prepared calls)
PREPARED_CALLS = 1024


class CallCache:
    """The engine's one cache: at most ``size`` entries, least recently used out first."""

    def __init__(self, size: int = PREPARED_CALLS):
        self.size = size
        self._entries: "OrderedDict[Any, Any]" = OrderedDict()
        #: counts the times it was emptied: a replay of a call prepared before is not
        #: replayed (``hoccl._engine.replay``)
        self.generation = 0

    def get(self, key: Any) -> Any:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: Any, entry: Any) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
        self.generation += 1

    def values(self) -> list:
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


def _changed_options(options: Options) -> tuple:
    """The planning options that differ from the defaults, as (name, value) pairs."""
    default = Options()
    return tuple((spec.name, getattr(options, spec.name)) for spec in dataclasses.fields(Options)
                 if getattr(options, spec.name) != getattr(default, spec.name))


class Prepares(CallEngine, Protocol):
    """What the preparer reads of its engine (``Engine``; the engine of the calls it
    makes), and how it tells it that the layout changed."""

    rank: int
    world_size: int
    device: Any
    executor: Executor
    memory: Memory
    windows: Windows
    sequences: Sequences
    sms: SmCaps
    options: Options
    given: FrozenSet[str]
    verify_plans: bool
    tuning: Optional[Table]
    layout_epoch: int

    def new_layout(self) -> None:
        """What prepared calls depend on changed: those made before are made afresh."""


class Preparer:
    """Makes an engine's prepared calls and keeps them in its cache."""

    def __init__(self, engine: Prepares):
        self.engine = engine
        self.cache = CallCache()
        self.reused = 0  # calls that found their prepared call in the cache
        self._logged_rows: Set[Tuple[str, Optional[int]]] = set()
        #: each peer's reduction scratch and ring as last described by the peer (``learn``)
        self.peer_scratch: Dict[int, PeerBuffer] = {}
        self.peer_ring: Dict[int, PeerBuffer] = {}

    def choice(self, shape: Shape, registered: Optional[bool] = None,
               captured: Optional[bool] = None) -> Choice:
        """The path and options ``shape``'s calls take: the tuning table's row for it and
        for the call's traits (its buffers all in registered windows, its stream being
        captured; None: not known, any row), under the settings the user gave."""
        engine = self.engine
        return choose(engine.tuning, shape, engine.options, engine.given,
                      registered=registered, captured=captured)

    def plan(self, shape: Shape, options: Optional[Options] = None) -> Plan:
        engine = self.engine
        plan = build_plan(shape, engine.options if options is None else options)
        if engine.verify_plans:
            verify(plan)
        return plan

    def call(self, name: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
             stream: Any, exported: bool) -> Call:
        """Everything that can fail before the caller's stream is fenced: the prepared call
        (plan, addresses, scratch, what the peers are told: ``Preparer``), the caller's
        stream, and (``exported``: peers live in other processes) the export descriptors
        of the unregistered buffers peers touch."""
        engine = self.engine
        arrays = tuple(buffer.owner for buffer in buffers.values() if buffer is not None)
        device = engine.device
        device.activate()
        caller = device.resolve_stream(stream, arrays)
        captured = device.capturing(caller)
        if captured:
            self.capturable(name, shape)
            with device.relaxed_capture():  # scratch may be allocated, exported
                prepared = self.prepare(shape, buffers, True, exported)
                shared = self.shared_of(prepared)
        else:
            prepared = self.prepare(shape, buffers, False, exported)
            shared = self.shared_of(prepared) if prepared.exports else prepared.shared
        plan = prepared.plan
        key = engine.sequences.key(plan)
        call = Call(name, plan, key, prepared.signature, prepared.local, shared, arrays, caller,
                    engine, prepared)
        call.fast = prepared.fast
        call.captured = captured
        return call

    def prepare(self, shape: Shape, buffers: Dict[str, Optional[Buffer]], captured: bool,
                exported: bool) -> PreparedCall:
        """The prepared call of ``shape`` on ``buffers``: from the cache, or made now."""
        engine = self.engine
        key: Any = [shape, captured]  # the buffers by address and size (its dtype is the shape's)
        for buffer in buffers.values():
            key.append(None if buffer is None else (buffer.address, buffer.count))
        key = tuple(key)
        prepared = self.cache.get(key)
        if prepared is not None and prepared.epoch == engine.layout_epoch:
            self.reused += 1
            return prepared
        # a table's rows may differ by capture, which every rank's call shares (it is part
        # of the signature); not by registration, which one rank's call may have and a
        # peer's not, so that ranks would choose different paths (rows of either apply)
        traits = ("shape", shape, captured)  # never a prepared call's key (shape, captured, ...)
        part = self.cache.get(traits)
        if part is None:
            part = self._shape_plan(shape, captured)
            self.cache.put(traits, part)
        prepared = self._prepared(part, buffers, captured, exported)
        self.cache.put(key, prepared)
        return prepared

    def _shape_plan(self, shape: Shape, captured: bool) -> ShapePlan:
        """What every call of ``shape``, captured or not, shares, the choice of its path
        included."""
        engine = self.engine
        rank = engine.rank
        choice = self.choice(shape, captured=captured)
        plan = self.plan(shape, choice.options)
        if engine.tuning is not None and log.isEnabledFor(logging.INFO) \
                and (shape.collective, choice.row) not in self._logged_rows:
            self._logged_rows.add((shape.collective, choice.row))
            log.info("rank %d %s of %d bytes: path %s, %s", rank, shape.collective,
                     size_of(shape), choice.path,
                     ", ".join(f"{name} from {source}" for name, source in choice.sources)
                     or "the defaults")
        # a plan never addresses an empty buffer (and it may have no address); but every
        # direct kernel's call describes this rank's ring, whatever it needs of it (a
        # broadcast's root, a call of zero elements: none), so that after the first direct
        # call every rank knows every peer's ring and all go without a message alike
        # (``_fast_peers``, ``_groups.base._silent``)
        used = tuple((spec.name, spec.nbytes) for spec in plan.buffers[rank]
                     if spec.nbytes or (spec.name == RING and plan.kernel_blocks))
        names = {buffer_name for buffer_name, _ in used}
        shared = tuple(name for name in plan.shared(rank) if name in names)
        if plan.kernel_blocks and RING in names and RING not in shared:
            shared = tuple(sorted(shared + (RING,)))
        signature: tuple = (("collective", shape.collective), ("count", shape.count),
                            ("dtype", shape.dtype), ("op", shape.op), ("root", shape.root),
                            ("peer", shape.peer), ("scale", shape.scale))
        changed = _changed_options(choice.options)
        if changed:  # ranks planning with other options would run other plans
            signature += (("options", changed),)
        reach = {(peer, spec.name): spec.nbytes for peer in plan.participants
                 for spec in plan.buffers[peer]}
        compiled = engine.executor.compile(plan, sms=choice.max_sms)
        return ShapePlan(shape, plan, signature, used, shared, reach, marks_of(compiled),
                         compiled, choice.max_sms,
                         one_lane=len({lane for _, lane, _ in compiled}) <= 1)

    def _prepared(self, part: ShapePlan, buffers: Dict[str, Optional[Buffer]],
                  captured: bool, exported: bool) -> PreparedCall:
        engine = self.engine
        memory = engine.memory
        plan = part.plan
        local: Dict[str, Any] = {}
        sizes: Dict[str, int] = {}
        for buffer_name, nbytes in part.buffers:
            if buffer_name == "scratch":
                local[buffer_name], changed = memory.scratch_of(nbytes)
                sizes[buffer_name] = nbytes
            elif buffer_name == RING:  # both halves: peers learn the half from the size
                (local[buffer_name], half), changed = memory.ring_of(
                    max(nbytes, 1), self._largest_direct())
                sizes[buffer_name] = 2 * half
            else:
                buffer = buffers[buffer_name]
                assert buffer is not None
                local[buffer_name] = buffer.address
                sizes[buffer_name] = buffer.nbytes
                changed = False
            if changed:
                engine.new_layout()  # calls prepared on the old allocation are made anew
        fast: Optional[Peers] = None
        exports: Tuple[str, ...] = ()
        if exported:
            shared, exports = self._describe(part, local, sizes)
            if engine.windows or plan.kernel_blocks:  # a direct kernel's peers touch only
                fast = self._fast_peers(plan, local, sizes)  # the rings
        else:
            shared = {name: PeerBuffer(local[name], sizes[name]) for name in part.shared}
        signature = part.signature + (("captured", True),) if captured else part.signature
        if captured:
            if "scratch" in local:  # a graph may use it for ever: never freed before close
                memory.pinned.add(local["scratch"])
            compiled = engine.executor.compile(plan, captured=True, sms=part.max_sms)
        else:
            compiled = part.compiled
        used = None if fast is None else {
            peer: tuple((name, buffer.where) for name, buffer in theirs.items())
            for peer, theirs in fast.items()}
        direct = plan.kernel_blocks
        return PreparedCall(part, plan, direct, signature, captured, local, sizes, shared,
                            exports, fast, used, compiled,
                            marks_of(compiled) if captured else part.marks,
                            digest(signature) if direct else 0, engine.layout_epoch)

    def capturable(self, name: str, shape: Shape) -> None:
        """Refuse a call captured into a CUDA graph that could not replay."""
        problem = replay_problem(self.plan(shape, self.choice(shape, captured=True).options))
        if problem is not None:
            raise InvalidArgumentError(
                f"{name}: the caller's stream is being captured into a CUDA graph, but this "
                f"call cannot be replayed from one: {problem} (capturable: all_gather, "
                f"all_to_all, reduce_scatter, all_reduce, broadcast, reduce, gather, scatter)")

    def binding(self, call: Call, imported: bool
                 ) -> Tuple[Optional[tuple], Optional[Dict[Tuple[int, str], Any]]]:
        """(the bound program, None) when ``call``'s prepared call was bound for these
        peers' buffers already; else (None, every address ``bind`` needs), once every peer
        buffer is known to hold what the plan touches in it."""
        prepared = call.prepared
        peers = call.peers
        bound_to = prepared.bound_to
        if prepared.program is not None and (bound_to is peers or bound_to == peers):
            return prepared.program, None
        self._check_bounds(call)
        return None, self._addresses(call, imported)

    def _check_bounds(self, call: Call) -> None:
        """Every byte the plan touches in a peer's buffer lies in what the peer passed (and,
        for a registered one, in the peer's window); else MismatchError."""
        reach = call.prepared.part.reach
        engine = self.engine
        for peer, shared in call.peers.items():
            for buffer_name, buffer in shared.items():
                needed = reach[(peer, buffer_name)]
                held = buffer.nbytes // 2 if buffer_name == RING else buffer.nbytes
                if held < needed or not self._in_window(call, peer, buffer, needed):
                    raise MismatchError(
                        f"{call.name}: rank {peer}'s {buffer_name} holds {buffer.nbytes} bytes "
                        f"but rank {engine.rank}'s plan for this call reaches {needed} bytes into "
                        f"it; the ranks disagree on the call's size")

    def _addresses(self, call: Call, imported: bool) -> Dict[Tuple[int, str], Any]:
        """Every buffer of ``call``, this rank's and its peers' (imported when
        ``imported``), by (rank, name)."""
        engine = self.engine
        addresses: Dict[Tuple[int, str], Any] = {(engine.rank, name): address
                                                 for name, address in call.local.items()}
        for peer, shared in call.peers.items():
            for buffer_name, buffer in shared.items():
                ref = window_ref(buffer.where)
                if ref is not None:
                    window = engine.windows.get(ref[0])
                    assert window is not None and window.bases is not None  # _in_window
                    address = window.bases[peer] + ref[1]
                else:
                    address = engine.device.import_(buffer.where) if imported else buffer.where
                # a ring: its address and the size of a half
                addresses[(peer, buffer_name)] = ((address, buffer.nbytes // 2)
                                                  if buffer_name == RING else address)
        if RING in call.local:
            half = (call.shared[RING].nbytes // 2 if RING in call.shared
                    else engine.memory.ring[1])
            addresses[(engine.rank, RING)] = (call.local[RING], half)
        return addresses

    def _in_window(self, call: Call, peer: int, buffer: PeerBuffer, needed: int) -> bool:
        """Whether ``needed`` bytes from a window reference lie in the peer's window (true
        for any other buffer); a reference to a window this rank does not have raises."""
        ref = window_ref(buffer.where)
        if ref is None:
            return True
        index, offset = ref
        engine = self.engine
        window = engine.windows.get(index)
        if window is None or window.sizes is None:
            raise MismatchError(
                f"{call.name}: rank {peer} passed a buffer in its registered window #{index} "
                f"but rank {engine.rank} has no window #{index}: the ranks' registrations "
                f"differ")
        return offset + needed <= window.sizes[peer]

    def shared_of(self, prepared: PreparedCall) -> Dict[str, PeerBuffer]:
        """What the peers are told of this rank's buffers for one call of ``prepared``."""
        if not prepared.exports:
            return prepared.shared
        shared = dict(prepared.shared)
        export = self.engine.device.export
        for name in prepared.exports:
            shared[name] = PeerBuffer(export(prepared.local[name], prepared.sizes[name]),
                                      prepared.sizes[name])
        return shared

    def _largest_direct(self) -> int:
        """The ring a direct kernel of the options may need at most (an all_reduce of
        ``kernel_bytes``: a block from each peer)."""
        engine = self.engine
        tuning = engine.tuning
        return (engine.world_size - 1) * max(
            engine.options.kernel_bytes, 0 if tuning is None or "kernel_bytes" in engine.given
            else tuning.largest("direct"))

    def _describe(self, part: ShapePlan, local: Dict[str, Any], sizes: Dict[str, int]
                  ) -> Tuple[Dict[str, PeerBuffer], Tuple[str, ...]]:
        """What the peers need of this rank's buffers (a window reference for a registered
        one; the export descriptor of its own scratch and ring), and the names of the
        unregistered buffers, exported afresh on every call (``shared_of``).  A window's
        array is held until deregistered."""
        engine = self.engine
        windows = engine.windows
        shared: Dict[str, PeerBuffer] = {}
        exports = []
        for buffer_name in part.shared:
            if buffer_name in ("scratch", RING):  # this rank's own: exported once
                shared[buffer_name] = PeerBuffer(engine.memory.export(local[buffer_name],
                                                                     sizes[buffer_name]),
                                                 sizes[buffer_name])
                continue
            found = windows.find(local[buffer_name], sizes[buffer_name]) if windows else None
            if found is None:
                exports.append(buffer_name)
            else:
                shared[buffer_name] = PeerBuffer((WINDOW, found[0].index, found[1]),
                                                 sizes[buffer_name])
        return shared, tuple(exports)

    def _fast_peers(self, plan: Plan, local: Dict[str, Any], sizes: Dict[str, int]
                    ) -> Optional[Peers]:
        """Every peer buffer the plan touches, told without asking the peers, or None.

        A peer's buffer of a name that this rank holds in a window is taken to be at the
        same offset of the peer's window of the same index (the registered call is
        symmetric), bounded by what the peer registered; a peer's scratch (or a direct
        kernel's ring, ``plan.RING``: the only buffer of a peer a direct kernel touches,
        so its calls need no window) is the one it last described, if that is large
        enough for this plan.  The peers' descriptions, which still come, are checked
        against this later (``ProcessGroup``)."""
        if plan.collective not in SYMMETRIC and not plan.kernel_blocks:
            return None  # a direct kernel's peers touch only the rings, whatever its kind
        engine = self.engine
        peers: Peers = {}
        for peer in plan.participants:
            if peer == engine.rank:
                continue
            theirs: Dict[str, PeerBuffer] = {}
            if plan.kernel_blocks:  # every peer's ring, known whatever this call needs
                known = self.peer_ring.get(peer)
                if known is None or known.nbytes // 2 < plan.buffer(peer, RING).nbytes:
                    return None
                theirs[RING] = known
            for buffer_name in plan.shared(peer):
                needed = plan.buffer(peer, buffer_name).nbytes
                if not needed or buffer_name == RING:
                    continue
                if buffer_name == "scratch":
                    known = self.peer_scratch.get(peer)
                    if known is None or known.nbytes < needed:
                        return None
                    theirs[buffer_name] = known
                    continue
                if buffer_name not in local:
                    return None
                found = engine.windows.find(local[buffer_name], sizes[buffer_name])
                if found is None:
                    return None
                window, offset = found
                if window.sizes is None:  # init_local: peers pass buffers by address
                    return None
                theirs[buffer_name] = PeerBuffer((WINDOW, window.index, offset),
                                                 max(0, window.sizes[peer] - offset))
            peers[peer] = theirs
        return peers

    def learn(self, peers_of_calls: Any) -> None:
        """After a description exchange (each call's ``peers``): remember each peer's
        reduction scratch and ring, for later calls that may be issued without asking
        (``_fast_peers``)."""
        for peers in peers_of_calls:
            for peer, shared in peers.items():
                for name, table in (("scratch", self.peer_scratch), (RING, self.peer_ring)):
                    buffer = shared.get(name)
                    if buffer is None:
                        continue
                    known = table.get(peer)
                    if (known is not None and known.where == buffer.where
                            and buffer.nbytes <= known.nbytes):
                        continue  # the same allocation, known to be at least this large
                    table[peer] = buffer
                    self.engine.new_layout()
