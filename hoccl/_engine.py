"""The engine: one per rank, it owns everything a call needs below the public API.

    Communicator (API) ──prepare/enqueue──► Engine ──issue──► Executor ──► StreamManager ──► Device
           │                                  ▲
           └──submit──► Group ── matched calls┘  (the API hands them to their engines)

The engine holds the rank's ``SignalPad`` (the only object that knows where a slot
lives), its call counters, the calls in flight, the reduction scratch, the stream
manager and the executor.  A call goes through three stages:

* ``prepare``: plan it, resolve the caller's stream and the buffers' addresses, export
  what peers must map.  Everything that can fail happens here; nothing is enqueued.
* ``enqueue``: number it and mark the caller's position (``StreamManager.fence_in``); in
  one process (the call is held until every rank made it) also fence the caller's
  stream: from then on, its later work waits for the call's completion value.  Across
  processes the fence comes in ``issue``, once the peers' buffers are mapped (mapping may
  synchronize the context, which must not happen while a caller waits for the call).
* ``issue``: with the peers' buffers known (from the group), check every byte the plan
  touches in a peer's buffer lies inside what that peer registered, then hand the plan
  to the executor.  ``release`` completes a call unrun instead (a mismatch, a close).

The engine never calls the group or the API; the health monitor (``hoccl._health``)
reads its state and aborts it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Set, Tuple

from ._buffers import Buffer
from ._errors import AbortedError, HocclError, InvalidArgumentError, MismatchError
from ._windows import WINDOW, Windows, window_ref
from .backends._base import Device, SmCaps
from .backends._kernels import DIRECT_WORDS
from .p2p import Executor
from .sched import Options, Shape, build_plan, verify
from .sched.algorithms import KERNEL_MAX_BLOCKS
from .sched.plan import CHANNEL_NAMES, CHANNELS, RING, Plan
from .sched.replay import replay_problem
from .sched.select import Choice, Table, choose, size_of
from .streams import StreamManager

__all__ = ["ABORT_VALUE", "SignalPad", "Call", "CallTemplate", "Engine", "PeerBuffer",
           "DeviceShare"]

log = logging.getLogger("hoccl")

#: written into signal pads by an abort: larger than any value a collective waits for,
#: so every stream-side wait is released; seeing it in a pad means "aborted".
ABORT_VALUE = 1 << 62


class SignalPad:
    """This rank's signal pad and the peers' pads it signals into.

    Layout: ``world_size * CHANNELS`` 64-bit slots, slot ``sender * CHANNELS + channel``
    written only by ``sender`` (so values only grow), then as many *graph* slots (the
    same slots for calls captured into CUDA graphs: each is put back to 0 after its last
    wait, ``hoccl.sched.replay``), then one *completion* word that this rank's lane 0
    writes when a call ends and its callers' streams wait on; then the direct kernels'
    part (``Plan.kernel_blocks``): their epoch and finished-block count, per slot
    ``KERNEL_MAX_BLOCKS`` words, one for each block of the sender's kernel, and two
    copies (even and odd epochs) of those words for the signatures of the calls the
    senders' kernels signalled from (``signature_shift``, ``signature_half``).
    """

    def __init__(self, device: Device, rank: int, world_size: int):
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.slots = world_size * CHANNELS
        #: where a slot's graph twin is: ``slot + graph_offset``
        self.graph_offset = self.slots
        kernel_words = self.slots * KERNEL_MAX_BLOCKS
        self.words_total = 2 * self.slots + 1 + 2 + 3 * kernel_words
        self.address = device.alloc_pad(self.words_total)
        #: bytes from a direct kernel's signal word to its signature twin of even epochs,
        #: and from that to the odd epochs' twin
        self.signature_shift = self.signature_half = 8 * kernel_words
        self.completion = self.address + 8 * 2 * self.slots
        #: the direct kernels' epoch and finished-block count (``DirectProgram.counter``)
        self.kernel_counter = self.completion + 8
        self._kernel_offset = 8 * (2 * self.slots + 3)
        self._pads: List[Any] = [self.address] * world_size

    def connect(self, pads: List[Any]) -> None:
        """``pads[peer]``: the peer's pad as this process addresses it (mapped or direct)."""
        self._pads = list(pads)

    def local(self, slot: int) -> Any:
        """The address of ``slot`` in this rank's own pad (what its lanes wait on)."""
        return self.address + 8 * slot

    def remote(self, peer: int, slot: int) -> Any:
        """The address of ``slot`` in ``peer``'s pad (what this rank's lanes write)."""
        return self._pads[peer] + 8 * slot

    def kernel_local(self, slot: int) -> Any:
        """Block 0's word of ``slot`` in this rank's direct-kernel slots (what its kernels
        wait on; block ``b``'s is ``8 * b`` further)."""
        return self.address + self._kernel_offset + 8 * KERNEL_MAX_BLOCKS * slot

    def kernel_remote(self, peer: int, slot: int) -> Any:
        """Block 0's word of ``slot`` in ``peer``'s direct-kernel slots (what this rank's
        kernels write)."""
        return self._pads[peer] + self._kernel_offset + 8 * KERNEL_MAX_BLOCKS * slot

    @staticmethod
    def describe(slot: int) -> Tuple[int, str]:
        """(sender, channel name) of a slot."""
        sender, channel = divmod(slot, CHANNELS)
        return sender, CHANNEL_NAMES[channel]

    def words(self) -> List[int]:
        """The slots' values (eager, then graph slots), read from the host past every
        stream."""
        return self.device.peek(self.address, 2 * self.slots)

    def aborted_by(self) -> Optional[int]:
        """The peer whose abort value is in this pad (its slots, or its direct kernels'),
        if one is."""
        try:
            words = self.words()
            kernel = self.device.peek(self.kernel_local(0), self.slots * KERNEL_MAX_BLOCKS)
        except HocclError:
            return None
        for slot, word in enumerate(words):
            if word >= ABORT_VALUE:
                return (slot % self.slots) // CHANNELS
        for index, word in enumerate(kernel):
            if word >= ABORT_VALUE:
                return (index // KERNEL_MAX_BLOCKS) // CHANNELS
        return None

    def poison(self, host_word: Any, warn: bool) -> None:
        """The abort value into every own slot, the completion and host words, and the
        slots this rank writes in every peer's pad (best effort: a dead peer's memory
        may be gone)."""
        own = [(self.local(slot), ABORT_VALUE) for slot in range(self.words_total)]
        own.append((host_word.address, ABORT_VALUE))
        try:
            self.device.poke(own)
        except HocclError as error:
            if warn:
                log.warning("rank %d abort: could not poison its own pad: %s", self.rank, error)
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            try:
                mine = [self.rank * CHANNELS + channel for channel in range(CHANNELS)]
                self.device.poke([(self.remote(peer, offset + slot), ABORT_VALUE)
                                  for offset in (0, self.graph_offset) for slot in mine]
                                 + [(self.kernel_remote(peer, slot) + 8 * block, ABORT_VALUE)
                                    for slot in mine for block in range(KERNEL_MAX_BLOCKS)])
            except HocclError as error:
                if warn:
                    log.warning("rank %d abort: could not release peer %d: %s", self.rank,
                                peer, error)


class DeviceShare:
    """The communicators of this process that use one device: the one that opened it
    (``init``, ``init_local``) and those split from it, which borrow it (and with it the
    CUDA context, peer access and the cache of imported IPC mappings, which must be one
    per process and context).  The device is closed when the last of them leaves, kept
    (``leak``) if any of them left work stuck behind a caller's stream."""

    def __init__(self, device: Device):
        self.device = device
        self._users = 1
        self._leak = False
        self._lock = threading.Lock()

    def borrow(self, call: str) -> "DeviceShare":
        """One more communicator uses the device."""
        with self._lock:
            if not self._users:
                raise InvalidArgumentError(f"{call}: the device is closed")
            self._users += 1
        return self

    def leave(self, leak: bool) -> bool:
        """One communicator is done with the device; True if it was the last, and the
        device is now closed."""
        with self._lock:
            self._users -= 1
            self._leak = self._leak or leak
            last = self._users == 0
        if last:
            self.device.close(leak=self._leak)
        return last


class PeerBuffer(NamedTuple):
    """What a rank tells its peers about one of its buffers for one call: ``where`` (an
    address in one process, an exported descriptor across processes) and ``nbytes``, the
    size it registered, which bounds every byte a peer's plan may touch in it.  A named
    tuple: it crosses processes in every call's message, and pickles as cheaply as one."""
    where: Any
    nbytes: int


class CallTemplate(NamedTuple):
    """What every call of one shape has in common on this rank, worked out once per shape
    and options: a repeated call only fills in its addresses."""
    shape: Shape
    plan: Plan
    options: Options           # the options the plan was built with
    signature: tuple           # what every participant must agree on
    buffers: Tuple[Tuple[str, int], ...]  # (name, bytes the plan uses) of each non-empty buffer
    shared: Tuple[str, ...]    # the names of those that peers' steps touch


@dataclass(eq=False, slots=True)  # slots: built on every call, and half the cost to build
class Call:
    """One call of one rank, from ``prepare`` to the end of its work."""
    name: str                  # the public call: "all_gather", "send", ...
    plan: Plan
    key: tuple                 # matches it across ranks: ("coll", n) or ("pair", s, r, n)
    signature: tuple           # what every participant must agree on
    local: Dict[str, Any]      # buffer name -> address on this rank
    shared: Dict[str, PeerBuffer]  # what the peers need of this rank's buffers
    keepalive: Tuple[Any, ...]
    caller: Any                # the caller's stream
    engine: "Engine"
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
    shape: Any = None          # the Shape it was prepared for (``Engine.repeat``)
    program: Any = None        # a repeat's bound program (``Engine.repeat``)
    memo: Any = None           # its shape and buffer addresses (``Engine.repeat``)


#: the collectives whose every rank plays the same part, so that a peer's buffer of a name
#: can be taken to sit where this rank's does (``Engine._fast_peers``); a rooted
#: collective's buffers differ by role (an in-place root's buffer is not where the
#: others' are), and send/recv name different buffers on the two sides
SYMMETRIC = frozenset({"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "barrier"})

# a direct kernel writes and waits for every one of a slot's words (``_kernels``)
assert DIRECT_WORDS == KERNEL_MAX_BLOCKS, "the pad's kernel words are the kernel's signal words"

_VERIFIED: Dict[int, Plan] = {}
_CACHED = 1024  # call templates and bound programs an engine keeps (then it starts afresh)


def _changed_options(options: Options) -> tuple:
    """The planning options that differ from the defaults, as (name, value) pairs."""
    default = Options()
    return tuple((spec.name, getattr(options, spec.name)) for spec in dataclasses.fields(Options)
                 if getattr(options, spec.name) != getattr(default, spec.name))


def _verified(plan: Plan) -> Plan:
    if _VERIFIED.get(id(plan)) is not plan:
        verify(plan)
        _VERIFIED[id(plan)] = plan
    return plan


class Engine:
    """One rank's machinery.  Built by ``hoccl.init`` / ``init_local``; used by the
    Communicator (calls), the group (matched calls come back through the API) and the
    health monitor (state, abort)."""

    def __init__(self, *, rank: int, world_size: int, share: DeviceShare, options: Options,
                 verify_plans: bool, sms: SmCaps, owns_device: bool):
        self.rank = rank
        self.world_size = world_size
        self.share = share
        self.device = device = share.device
        #: whether this rank opened its device (``init``) rather than borrowing its parent's
        #: (``split``): an abort of the owner drops every stream's work on the device, a
        #: borrower's only its own lanes'
        self.owns_device = owns_device
        self.options = options
        self.verify_plans = verify_plans
        self.sms = sms
        #: the tuning table rank 0 found for the machine (``hoccl.tuning``; None: the
        #: defaults), where it came from, and the settings the user gave, which win over
        #: it (``hoccl.sched.select.choose``): set by the builder before the first call
        self.tuning: Optional[Table] = None
        self.machine: Dict[str, Any] = {}  # what the table is keyed by (hoccl.tuning)
        self.tuning_origin = "defaults"
        self.given: FrozenSet[str] = frozenset()
        self._logged_rows: Set[Tuple[str, Optional[int]]] = set()
        self.pad = SignalPad(device, rank, world_size)
        self.host_word = device.alloc_host_word()
        #: written by a direct kernel that found a peer making another call (the call's
        #: value; ``1 << 61`` from a graph's replay): ``diverged``
        self.error_word = device.alloc_host_word()
        self.streams = StreamManager(device, self.pad.completion, self.host_word.address,
                                     self.error_word.address)
        self.executor = Executor(rank, device, self.streams, self.pad, sms)
        self.calls = 0                  # completion value of the latest enqueued call
        #: the latest completion value some caller streams are known to wait for, and
        #: those streams (by ``_stream_key``): a direct kernel on one of them needs no wait
        #: for the previous call (``_issue_on_caller``)
        self._ordered: Tuple[int, set] = (0, set())
        #: the value of the latest call run on its caller's stream that lane 0 has not been
        #: ordered after yet: its next completion write waits for it first
        self._lanes_after = 0
        #: (value, name, signature) of the latest direct calls on callers' streams, to
        #: name the one a kernel found a peer's other call beside (``diverged_call``)
        self._direct_calls: Deque[Tuple[int, str, tuple]] = collections.deque(maxlen=256)
        self._collectives = 0           # collectives enqueued (the matching key)
        self._pair_calls: Dict[Tuple[int, ...], int] = {}
        self._signal_base = 0
        self._pair_base: Dict[Tuple[int, ...], int] = {}
        self._scratch: Tuple[Any, int] = (None, 0)
        self._retired: List[Any] = []
        #: scratch captured into a CUDA graph: kept until the device is left
        self._pinned: set = set()
        self._kept: List[Any] = []
        self._templates: Dict[Shape, CallTemplate] = {}
        self._programs: Dict[tuple, Tuple[Plan, tuple, Any]] = {}  # see _program
        #: registered buffers (``Communicator.register``)
        self.windows = Windows()
        #: each peer's reduction scratch as last described by the peer (``learn``), and a
        #: count of changes to what ``_fast_peers`` depends on (windows, that knowledge)
        self._peer_scratch: Dict[int, PeerBuffer] = {}
        self._peer_ring: Dict[int, PeerBuffer] = {}
        #: the direct kernels' double-buffered staging (``plan.RING``): (address, half);
        #: a ring is never freed before close (a peer one call ahead may store into it,
        #: a graph may replay it: the device frees it), a larger one replaces it for
        #: later calls
        self._ring: Tuple[Any, int] = (None, 0)
        #: the export descriptors of the scratch and the ring (``_own_export``)
        self._exports: Dict[int, Any] = {}
        self.layout_epoch = 0
        #: calls issued without asking the peers (``ProcessGroup.complete``)
        self.issued_fast = 0
        self.direct_calls = 0  # eager calls issued as direct kernels (``_issue_on_caller``)
        self._fast: Dict[tuple, Tuple[Plan, Optional[Dict[int, Dict[str, PeerBuffer]]]]] = {}
        #: eager collectives issued without asking, by shape and buffer addresses
        #: (``_memo_key``), for their repeats (``repeat``)
        self._repeats: Dict[tuple, Tuple[Optional[CallTemplate], Dict[str, Any],
                                         Dict[str, PeerBuffer], Any, tuple, bool, int]] = {}
        self.inflight: Deque[Call] = collections.deque()  # enqueued, in call order
        #: the calls of ``inflight`` not issued yet, by number (``held``: scanning the
        #: deque, which holds every call the device has not finished, cost each call a
        #: pass over hundreds of calls when the host runs far ahead of the device)
        self._unissued: Dict[int, Call] = {}
        self.lock = threading.RLock()
        self.closed = False
        self.aborted = False
        self.abort_reason = ""
        #: the error later calls raise: AbortedError, or PeerDeadError when a peer's
        #: process exited
        self.abort_error: type = AbortedError
        #: an error found for this rank's call while another rank was calling (init_local):
        #: raised by the next synchronize
        self.pending_error: Optional[HocclError] = None

    # -- state ------------------------------------------------------------------------------
    @property
    def completed(self) -> int:
        """The completion value of the latest finished call (read from host memory)."""
        return self.host_word.value

    def diverged_call(self) -> Optional[Tuple[int, str, tuple]]:
        """(value, name, signature) of a direct call whose kernel found a peer's kernel
        signalling from another call (the error word: ``DirectProgram``), value 0 and
        unknown name for a graph's replay; None if none did."""
        value = self.error_word.value
        if not value:
            return None
        for known in self._direct_calls:
            if known[0] == value:
                return known
        return (0 if value >= 1 << 61 else value, "", ())

    def made(self) -> Tuple[int, Dict[Tuple[int, ...], int]]:
        """How many calls this rank has made: collectives, and calls per (sender, receiver)
        pair (what a call's key counts, ``prepare``)."""
        with self.lock:
            return self._collectives, dict(self._pair_calls)

    def mark_aborted(self, reason: str) -> bool:
        """Make later calls raise; False if this rank was already aborted or closed."""
        with self.lock:
            if self.aborted or self.closed:
                return False
            self.aborted = True
            self.abort_reason = reason
            return True

    def configure(self, config: Any) -> None:
        """Take ``config``'s settings (a ``hoccl.Config``) for later calls."""
        with self.lock:
            self.sms.max_sms = config.max_sms
            self.sms.copy_sms = config.copy_sms or self.sms.copy_sms
            if config.fuse_sums != self.sms.fuse_sums:
                self.sms.fuse_sums = bool(config.fuse_sums)
                self.forget_programs()  # bound programs hold the fused launches, or not
            self.verify_plans = config.verify_plans
            if config.plan_options != self.options or config.given != self.given:
                self.options = config.plan_options  # a new object: templates are remade
                self.given = config.given

    # -- a call -----------------------------------------------------------------------------
    def choice(self, shape: Shape) -> Choice:
        """The path and options ``shape``'s calls take: the tuning table's row for it,
        under the settings the user gave."""
        return choose(self.tuning, shape, self.options, self.given)

    def plan(self, shape: Shape, options: Optional[Options] = None) -> Plan:
        plan = build_plan(shape, self.options if options is None else options)
        return _verified(plan) if self.verify_plans else plan

    def prepare(self, name: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
                stream: Any, exported: bool) -> Call:
        """Everything that can fail before the caller's stream is fenced: the plan, the
        caller's stream, scratch, and (``exported``: peers live in other processes) the
        export descriptors of the buffers peers touch."""
        template = self._templates.get(shape)
        if template is None or template.options is not self.options:
            template = self._template(shape)
        plan = template.plan
        arrays = tuple(buffer.owner for buffer in buffers.values() if buffer is not None)
        self.device.activate()
        caller = self.device.resolve_stream(stream, arrays)
        captured = self.device.capturing(caller)
        if captured:
            self._capturable(name, plan, exported)
            with self.device.relaxed_capture():  # scratch may be allocated, exported
                return self._prepared(name, template, buffers, arrays, caller, exported, True)
        return self._prepared(name, template, buffers, arrays, caller, exported, False)

    def _capturable(self, name: str, plan: Plan, exported: bool) -> None:
        """Refuse a call captured into a CUDA graph that could not replay."""
        if not exported:
            raise InvalidArgumentError(
                f"{name}: the caller's stream is being captured into a CUDA graph; capture "
                f"is supported with one rank per process (hoccl.init), not init_local")
        problem = replay_problem(plan)
        if problem is not None:
            raise InvalidArgumentError(
                f"{name}: the caller's stream is being captured into a CUDA graph, but this "
                f"call cannot be replayed from one: {problem} (capturable: all_gather, "
                f"all_to_all, reduce_scatter, all_reduce, broadcast, reduce, gather, scatter)")

    def _prepared(self, name: str, template: CallTemplate, buffers: Dict[str, Optional[Buffer]],
                  arrays: Tuple[Any, ...], caller: Any, exported: bool, captured: bool) -> Call:
        plan = template.plan
        local: Dict[str, Any] = {}
        sizes: Dict[str, int] = {}
        for buffer_name, nbytes in template.buffers:
            if buffer_name == "scratch":
                local[buffer_name] = self._scratch_of(nbytes)
                sizes[buffer_name] = nbytes
            elif buffer_name == RING:  # both halves: peers learn the half from the size
                local[buffer_name], half = self._ring_of(max(nbytes, 1))
                sizes[buffer_name] = 2 * half
            else:
                buffer = buffers[buffer_name]
                assert buffer is not None
                local[buffer_name] = buffer.address
                sizes[buffer_name] = buffer.nbytes
        if exported:
            shared, fast = self._describe(template, local, sizes)
        else:
            shared, fast = {name: PeerBuffer(local[name], sizes[name])
                            for name in template.shared}, None
        if plan.pair:
            key: tuple = ("pair",) + plan.pair + (self._pair_calls.get(plan.pair, 0),)
        else:
            key = ("coll", self._collectives)
        signature = template.signature + (("captured", True),) if captured else template.signature
        call = Call(name, plan, key, signature, local, shared, arrays, caller, self)
        call.fast = fast
        call.shape = template.shape
        call.memo = _memo_key(template.shape, buffers)
        if captured:
            call.captured = True
            if "scratch" in local:  # a graph may use it for ever: never freed before close
                self._pinned.add(local["scratch"])
        return call

    def _describe(self, template: CallTemplate, local: Dict[str, Any], sizes: Dict[str, int]
                  ) -> Tuple[Dict[str, PeerBuffer], Optional[Dict[int, Dict[str, PeerBuffer]]]]:
        """What the peers need of this rank's buffers (a window reference for a registered
        one, else an export descriptor), and the peers' buffers if this rank can tell them
        without asking (``_fast_peers``).

        Unregistered buffers are exported on every call: only the device can tell a
        reallocation at the same address.  A window's array is held until deregistered."""
        windows = self.windows
        shared: Dict[str, PeerBuffer] = {}
        for buffer_name in template.shared:
            if buffer_name in ("scratch", RING):  # this rank's own: exported once
                where = self._own_export(local[buffer_name])
                shared[buffer_name] = PeerBuffer(where, sizes[buffer_name])
                continue
            found = windows.find(local[buffer_name], sizes[buffer_name]) if windows else None
            where = ((WINDOW, found[0].index, found[1]) if found is not None
                     else self.device.export(local[buffer_name]))
            shared[buffer_name] = PeerBuffer(where, sizes[buffer_name])
        if not windows and not template.plan.kernel_blocks:  # a direct kernel's peers touch
            return shared, None                                # only the rings
        layout = (id(template.plan), tuple(local.values()), self.layout_epoch)
        entry = self._fast.get(layout)
        if entry is None or entry[0] is not template.plan:
            entry = (template.plan, self._fast_peers(template.plan, local, sizes))
            if len(self._fast) >= _CACHED:
                self._fast.clear()
            self._fast[layout] = entry
        return shared, entry[1]

    def _own_export(self, address: Any) -> Any:
        """The export descriptor of this rank's scratch or ring at ``address``: made once
        per allocation (forgotten when either is replaced, so that a later allocation at
        the same address is exported afresh)."""
        key = int(address)
        where = self._exports.get(key)
        if where is None:
            where = self._exports[key] = self.device.export(address)
        return where

    def _fast_peers(self, plan: Plan, local: Dict[str, Any], sizes: Dict[str, int]
                    ) -> Optional[Dict[int, Dict[str, PeerBuffer]]]:
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
        peers: Dict[int, Dict[str, PeerBuffer]] = {}
        for peer in plan.participants:
            if peer == self.rank:
                continue
            theirs: Dict[str, PeerBuffer] = {}
            if plan.kernel_blocks:  # every peer's ring, known whatever this call needs
                known = self._peer_ring.get(peer)
                if known is None or known.nbytes // 2 < plan.buffer(peer, RING).nbytes:
                    return None
                theirs[RING] = known
            for buffer_name in plan.shared(peer):
                needed = plan.buffer(peer, buffer_name).nbytes
                if not needed or buffer_name == RING:
                    continue
                if buffer_name == "scratch":
                    known = self._peer_scratch.get(peer)
                    if known is None or known.nbytes < needed:
                        return None
                    theirs[buffer_name] = known
                    continue
                if buffer_name not in local:
                    return None
                found = self.windows.find(local[buffer_name], sizes[buffer_name])
                if found is None:
                    return None
                window, offset = found
                if window.sizes is None:  # init_local: peers pass buffers by address
                    return None
                theirs[buffer_name] = PeerBuffer((WINDOW, window.index, offset),
                                                 max(0, window.sizes[peer] - offset))
            peers[peer] = theirs
        return peers

    def forget_programs(self) -> None:
        """Bind every call afresh from now on, and repeat none made before: what a bound
        program holds changed (``fuse_sums``)."""
        self.layout_epoch += 1
        self._programs.clear()

    def forget_window(self, window: Any) -> None:
        """Drop ``window`` (deregistered by every rank, its calls finished): the programs
        bound to its peers' mappings go, then the mappings no call made."""
        self.windows.remove(window)
        self.layout_epoch += 1
        self._programs.clear()
        self._fast.clear()
        self.device.activate()
        for descriptor in window.imports:
            self.device.drop_import(descriptor)

    def learn(self, calls: Sequence[Call]) -> None:
        """After a description exchange: remember each peer's reduction scratch, for later
        calls that may be issued without asking (``_fast_peers``)."""
        for call in calls:
            for peer, shared in call.peers.items():
                for name, table in (("scratch", self._peer_scratch), (RING, self._peer_ring)):
                    buffer = shared.get(name)
                    if buffer is None:
                        continue
                    known = table.get(peer)
                    if (known is not None and known.where == buffer.where
                            and buffer.nbytes <= known.nbytes):
                        continue  # the same allocation, known to be at least this large
                    table[peer] = buffer
                    self.layout_epoch += 1

    def _template(self, shape: Shape) -> CallTemplate:
        """What every call of ``shape`` shares, the choice of its path included: made on
        the first call of a shape, so a repeated call's choice costs nothing."""
        choice = self.choice(shape)
        plan = self.plan(shape, choice.options)
        if self.tuning is not None and log.isEnabledFor(logging.INFO) \
                and (shape.collective, choice.row) not in self._logged_rows:
            self._logged_rows.add((shape.collective, choice.row))
            log.info("rank %d %s of %d bytes: path %s, %s", self.rank, shape.collective,
                     size_of(shape), choice.path,
                     ", ".join(f"{name} from {source}" for name, source in choice.sources)
                     or "the defaults")
        # a plan never addresses an empty buffer (and it may have no address); but every
        # direct kernel's call describes this rank's ring, whatever it needs of it (a
        # broadcast's root, a call of zero elements: none), so that after the first direct
        # call every rank knows every peer's ring and all go without a message alike
        # (``_fast_peers``, ``_groups.base._silent``)
        used = tuple((spec.name, spec.nbytes) for spec in plan.buffers[self.rank]
                     if spec.nbytes or (spec.name == RING and plan.kernel_blocks))
        names = {buffer_name for buffer_name, _ in used}
        shared = tuple(name for name in plan.shared(self.rank) if name in names)
        if plan.kernel_blocks and RING in names and RING not in shared:
            shared = tuple(sorted(shared + (RING,)))
        signature: tuple = (("collective", shape.collective), ("count", shape.count),
                            ("dtype", shape.dtype), ("op", shape.op), ("root", shape.root),
                            ("peer", shape.peer), ("scale", shape.scale))
        changed = _changed_options(choice.options)
        if changed:  # ranks planning with other options would run other plans
            signature += (("options", changed),)
        template = CallTemplate(shape, plan, self.options, signature, used, shared)
        if len(self._templates) >= _CACHED:
            self._templates.clear()
        self._templates[shape] = template
        return template

    def enqueue(self, call: Call, fence: bool = True) -> None:
        """Number ``call`` and fence the caller's stream on it.  From here the call must
        end in ``issue`` or ``release``: the caller's stream waits for it.  Without
        ``fence`` only its entry is marked; ``fence_callers`` then fences a group."""
        if call.captured:
            self._enqueue_captured(call)
            return
        # Every lane and event the calls not yet issued will take, made before the fence:
        # no driver call that may synchronize the context runs while a caller waits.  A
        # call on its caller's stream takes none (a direct one: its kernel, loaded once).
        if call.on_caller:
            self.executor.load(call.plan)
        else:
            self.executor.reserve([held.plan for held in self.held()] + [call.plan])
        self._number(call)
        if call.on_caller:  # its steps themselves keep the caller's place (``issue``)
            call.fenced = True
        else:
            call.entry = self.streams.fence_in(call.caller, call.value, wait=fence)
            call.fenced = fence
            if fence:
                self._note_ordered(call.value, (call.caller,))
        self._in_flight(call)

    def _number(self, call: Call) -> None:
        """Advance ``call``'s key sequence and give it the next completion value."""
        self._count(call)
        self.calls += 1
        call.value = self.calls

    def _in_flight(self, call: Call) -> None:
        """Put ``call`` in flight (not issued yet), retiring the calls the device has
        finished."""
        done = self.completed
        with self.lock:  # the watchdog reads the deque
            inflight = self.inflight
            while inflight and inflight[0].issued and inflight[0].value <= done:
                self._retire(inflight.popleft())  # finished: its buffers may go
            inflight.append(call)
            self._unissued[call.value] = call

    def _issued(self, calls: Sequence[Call], now: float) -> None:
        """``calls`` are on the device since ``now`` (the watchdog's clock)."""
        with self.lock:
            for call in calls:
                call.issued_at = now
                call.issued = True
                self._unissued.pop(call.value, None)

    def _enqueue_captured(self, call: Call) -> None:
        """A call captured into a graph: matched like any other (its key counts), but not
        numbered, never in flight (a replay is not a call the host waits for) and never
        fencing the caller on the completion word; its entry is an event the capture
        records, its exit one the caller's stream waits for (``issue``)."""
        with self.device.relaxed_capture():
            self.executor.reserve([call.plan], captured=True)
        self._count(call)
        if not call.on_caller:  # else the kernel is captured on the caller's stream itself
            call.entry = self.streams.fence_in(call.caller, 0, wait=False)
        call.fenced = True

    def _count(self, call: Call) -> None:
        """Advance the sequence ``call``'s key was taken from (``prepare``)."""
        if call.plan.pair:
            self._pair_calls[call.plan.pair] = call.key[-1] + 1
        else:
            self._collectives += 1

    def fence_callers(self, calls: Sequence[Call]) -> None:
        """Make every caller stream of ``calls`` (a group's, enqueued without a fence) wait
        for the last of them."""
        last = max(call.value for call in calls)
        self.device.activate()
        self.executor.reserve([held.plan for held in self.held()])  # see ``enqueue``
        for call in calls:
            call.fenced = True
        callers = _callers(calls)
        for caller in callers:
            self.streams.fence_out(caller, last)
        self._note_ordered(last, callers)

    def _note_ordered(self, value: int, callers: Sequence[Any]) -> None:
        """``callers`` now wait for completion ``value`` before their later work."""
        keys = {_stream_key(caller) for caller in callers}
        if value > self._ordered[0]:
            self._ordered = (value, keys)
        elif value == self._ordered[0]:
            self._ordered[1].update(keys)

    def issue(self, calls: Sequence[Call], imported: bool) -> None:
        """Enqueue the steps of ``calls`` (one, or one rank's calls of a ``hoccl.group()``,
        which then run side by side), their peers' buffers now in ``call.peers``.
        ``imported``: the peers' ``where`` are export descriptors to map (cached by the
        device).  A peer buffer smaller than the plan reaches into raises MismatchError
        before anything is enqueued.

        Calls enqueued without a fence (a process group's: the call returns only once it
        is issued) are fenced here, after their peers' buffers are mapped: mapping (and
        unmapping a stale mapping) may synchronize the context, which must never happen
        while a caller's stream waits for a call not yet issued."""
        if calls[0].captured:
            self._issue_captured(calls, imported)
            return
        try:
            programs = [self._program(call, imported) for call in calls]
        except MismatchError:
            for call in calls:
                self.release(call)
            raise
        if calls[0].on_caller:
            assert len(calls) == 1, "a call on its caller's stream is never in a group"
            self._issue_on_caller(calls[0], programs[0])
        else:
            self._issue_lanes(calls, programs)
        if len(calls) == 1 and calls[0].fast is not None and calls[0].peers is calls[0].fast:
            self._remember(calls[0], programs[0])

    def _issue_lanes(self, calls: Sequence[Call], programs: Sequence[tuple]) -> None:
        """``issue`` on the lanes: fence the callers not fenced yet, then the steps."""
        unfenced = [call for call in calls if not call.fenced]
        if unfenced:
            self.fence_callers(unfenced)
        items = []
        for call, program in zip(calls, programs):
            plan = call.plan
            base = self._base(call)
            items.append((plan, program, base, call.entry))
            if log.isEnabledFor(logging.DEBUG):
                log.debug("rank %d issue %s call %d base %d lanes %d steps %d sms=%s",
                          self.rank, plan.collective, call.value, base, plan.lanes,
                          len(plan.programs[self.rank]), plan.uses_sms(self.rank))
        now = time.monotonic()  # the device methods make their context current themselves
        self.executor.issue(items, max(call.value for call in calls), after=self._lanes_after)
        self._lanes_after = 0
        self._issued(calls, now)

    def _base(self, call: Call) -> int:
        """``call``'s signal base: its sequence's values so far (the collectives', or its
        pair's in one direction); the next call of the sequence starts past its values."""
        plan = call.plan
        if plan.pair:
            base = self._pair_base.get(plan.pair, 0)
            self._pair_base[plan.pair] = base + plan.max_value
        else:
            base = self._signal_base
            self._signal_base += plan.max_value
        call.base = base
        return base

    def _remember(self, call: Call, program: tuple) -> None:
        """Keep what an eager collective issued without asking its peers was made of, so
        that a repeat of it (``repeat``) skips the path."""
        if call.plan.pair or call.memo is None:
            return  # a repeat is keyed in the collectives' sequence
        if len(self._repeats) >= _CACHED:
            self._repeats.clear()
        self._repeats[call.memo] = (self._templates.get(call.shape), call.local, call.shared,
                                    call.fast, program, call.on_caller, self.layout_epoch)

    def repeat(self, name: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
               stream: Any) -> Optional[Call]:
        """A repeat of an eager collective issued without asking its peers (``_remember``):
        the same shape on buffers at the same addresses, with the same options, scratch,
        rings and windows (``layout_epoch`` counts their changes).  Made with what the
        first call worked out (the template, what the peers are told, their buffers, the
        bound program), for ``issue_repeat`` once its message (a copy-engine call's; a
        direct kernel's goes without) is posted.  None when it is not one (then
        ``prepare``): another buffer, a stream being captured, anything changed."""
        memo = self._repeats.get(_memo_key(shape, buffers))
        if memo is None:
            return None
        template, local, shared, fast, program, on_caller, epoch = memo
        if (epoch != self.layout_epoch or template is None
                or template.options is not self.options
                or self._templates.get(shape) is not template):
            return None
        assert template is not None
        arrays = tuple(buffer.owner for buffer in buffers.values() if buffer is not None)
        self.device.activate()
        caller = self.device.resolve_stream(stream, arrays)
        if self.device.capturing(caller):
            return None
        call = Call(name, template.plan, ("coll", self._collectives), template.signature, local,
                    shared, arrays, caller, self)
        call.fast = call.peers = fast
        call.shape = shape
        call.on_caller = call.fenced = on_caller
        call.program = program
        return call

    def issue_repeat(self, call: Call) -> None:
        """Number a call made by ``repeat`` and issue it: on its caller's stream, or on
        the lanes (fenced at once: there is nothing of the peers' to map)."""
        if call.on_caller:
            self._number(call)
            self._in_flight(call)
            self._issue_on_caller(call, call.program)
        else:
            self.enqueue(call, fence=True)
            self._issue_lanes([call], [call.program])
        self.issued_fast += 1

    def _issue_on_caller(self, call: Call, program: tuple) -> None:
        """An eager call on the caller's stream itself: a direct kernel's launch, or a
        one-lane plan's memory operations and copies, is the whole call on the device.
        Calls must still run in call order (their signals share the peers' slots, and
        completion values only grow), so a caller's stream not yet known to wait for the
        previous call's value waits for it first, and the lanes' next call waits for this
        call's before its first step."""
        value, key = call.value, _stream_key(call.caller)
        ordered, streams = self._ordered
        after = value - 1 if value > 1 and not (ordered == value - 1 and key in streams) else 0
        direct = call.plan.kernel_blocks
        base = 0 if direct else self._base(call)
        now = time.monotonic()
        self.executor.issue_on_caller(program, call.caller, value, after, base)
        self._ordered = (value, {key})
        self._lanes_after = value
        if direct:
            self._direct_calls.append((value, call.name, call.signature))
            self.direct_calls += 1
        self._issued((call,), now)

    def _issue_captured(self, calls: Sequence[Call], imported: bool) -> None:
        """``issue`` for calls captured into a graph: graph slots that reset, no signal
        base, no completion value; the callers' streams wait for the lanes' end
        (``Executor.issue`` with ``callers``)."""
        if not all(call.captured for call in calls):
            raise InvalidArgumentError(f"{calls[0].name}: calls captured into a CUDA graph "
                                       f"and calls made eagerly cannot be issued together")
        try:
            with self.device.relaxed_capture():  # peers' buffers may be mapped now
                programs = [self._program(call, imported) for call in calls]
        except MismatchError:
            for call in calls:
                self.release(call)
            raise
        if calls[0].on_caller:  # one kernel node in the graph, writing no completion
            assert len(calls) == 1, "a call on its caller's stream is never in a group"
            self.executor.issue_on_caller(programs[0], calls[0].caller, 0, 0)
            calls[0].issued = True
            return
        self.executor.issue([(call.plan, program, 0, call.entry)
                             for call, program in zip(calls, programs)], 0,
                            callers=_callers(calls))
        for call in calls:
            self.streams.release(call.entry)
            call.entry = None
            call.issued = True

    def _program(self, call: Call, imported: bool) -> tuple:
        """This rank's steps of ``call`` with every address resolved (``Executor.bind``),
        once every peer buffer is known to hold what the plan touches in it.

        The same plan with the same buffers here and the same buffer descriptors from
        every peer binds to the same program, so it is looked up by them: a repeated
        call skips the imports and the address arithmetic.  Descriptors that differ
        (another buffer, a reallocation, another size) are another key."""
        plan = call.plan
        # a plan hashes all its steps: it is known by its id, and kept in the entry so
        # that the id cannot pass to another plan while the entry lives.  The bounds below
        # depend on nothing but the key (the peers' sizes are in it; a window's size
        # cannot change while its index is known), so a found entry has passed them.
        # peers told without asking (``call.fast``) are one dict per layout, from the
        # engine's cache: known by its id, and kept in the entry like the plan
        fast = call.peers if call.peers is call.fast else None
        layout = (id(plan), call.captured, tuple(call.local.values()),
                  id(fast) if fast is not None else
                  tuple((peer, tuple(shared.items())) for peer, shared in call.peers.items()))
        entry = self._programs.get(layout)
        if entry is None or entry[0] is not plan or entry[2] is not fast:
            self._check_bounds(call)
            entry = (plan, self.executor.bind(plan, self._addresses(call, imported),
                                              captured=call.captured,
                                              signature=_digest(call.signature)
                                              if plan.kernel_blocks else 0), fast)
            if len(self._programs) >= _CACHED:
                self._programs.clear()
            self._programs[layout] = entry
        return entry[1]

    def _check_bounds(self, call: Call) -> None:
        """Every byte the plan touches in a peer's buffer lies in what the peer passed (and,
        for a registered one, in the peer's window); else MismatchError."""
        plan = call.plan
        for peer, shared in call.peers.items():
            for buffer_name, buffer in shared.items():
                needed = plan.buffer(peer, buffer_name).nbytes
                held = buffer.nbytes // 2 if buffer_name == RING else buffer.nbytes
                if held < needed or not self._in_window(call, peer, buffer, needed):
                    raise MismatchError(
                        f"{call.name}: rank {peer}'s {buffer_name} holds {buffer.nbytes} bytes "
                        f"but rank {self.rank}'s plan for this call reaches {needed} bytes into "
                        f"it; the ranks disagree on the call's size")

    def _addresses(self, call: Call, imported: bool) -> Dict[Tuple[int, str], Any]:
        """Every buffer of ``call``, this rank's and its peers' (imported when
        ``imported``), by (rank, name)."""
        addresses: Dict[Tuple[int, str], Any] = {(self.rank, name): address
                                                 for name, address in call.local.items()}
        for peer, shared in call.peers.items():
            for buffer_name, buffer in shared.items():
                ref = window_ref(buffer.where)
                if ref is not None:
                    window = self.windows.get(ref[0])
                    assert window is not None and window.bases is not None  # _in_window
                    addresses[(peer, buffer_name)] = window.bases[peer] + ref[1]
                else:
                    addresses[(peer, buffer_name)] = (self.device.import_(buffer.where)
                                                      if imported else buffer.where)
                if buffer_name == RING:  # a ring: its address and the size of a half
                    addresses[(peer, buffer_name)] = (addresses[(peer, buffer_name)],
                                                      buffer.nbytes // 2)
        if RING in call.local:
            addresses[(self.rank, RING)] = (call.local[RING], self._ring_halves(call))
        return addresses

    def _ring_halves(self, call: Call) -> int:
        return call.shared[RING].nbytes // 2 if RING in call.shared else self._ring[1]

    def _in_window(self, call: Call, peer: int, buffer: PeerBuffer, needed: int) -> bool:
        """Whether ``needed`` bytes from a window reference lie in the peer's window (true
        for any other buffer); a reference to a window this rank does not have raises."""
        ref = window_ref(buffer.where)
        if ref is None:
            return True
        index, offset = ref
        window = self.windows.get(index)
        if window is None or window.sizes is None:
            raise MismatchError(
                f"{call.name}: rank {peer} passed a buffer in its registered window #{index} "
                f"but rank {self.rank} has no window #{index}: the ranks' registrations "
                f"differ")
        return offset + needed <= window.sizes[peer]

    def release(self, call: Call) -> None:
        """Complete ``call`` without running it: the caller's stream goes on; its output is
        not written."""
        if call.captured:  # nothing waits for it: the capture simply lacks the call
            if call.entry is not None:
                self.streams.release(call.entry)
                call.entry = None
            call.issued = True
            return
        self.device.activate()
        self.streams.ensure_lanes(1)
        self.device.memops(self.streams.lanes[0],
                           self.streams.completion_writes(call.value, self._lanes_after))
        self._lanes_after = 0
        self._issued((call,), time.monotonic())

    def finish(self) -> None:
        """After every enqueued call has completed: retire them, free retired scratch."""
        with self.lock:
            for call in self.inflight:
                self._retire(call)
            self.inflight.clear()
            self._unissued.clear()
            self.device.activate()
            for address in self._retired:
                self.device.free(address)
            self._retired.clear()

    def unfinished(self) -> List[Call]:
        """Issued calls whose completion value has not been reached, oldest first."""
        done = self.completed
        with self.lock:
            return [call for call in self.inflight if call.issued and call.value > done]

    def held(self) -> List[Call]:
        """Enqueued calls not yet issued (init_local: waiting for other ranks' calls)."""
        with self.lock:
            return list(self._unissued.values())

    # -- internals ----------------------------------------------------------------------
    def _retire(self, call: Call) -> None:
        """``call`` finished: its entry event goes back to the pool."""
        if call.entry is not None:
            self.streams.release(call.entry)
            call.entry = None

    def _ring_of(self, nbytes: int) -> Tuple[Any, int]:
        """A ring of two halves of at least ``nbytes`` each: (address, half).

        The first is as large as any direct kernel of the options may need (an
        all_reduce of ``kernel_bytes``: a block from each peer), so that once the peers
        have learned it (the first direct call's exchange) every later direct call goes
        without a message on every rank alike, even when the ranks' calls differ (which
        their kernels then see, ``DirectProgram.signature``)."""
        address, half = self._ring
        if half < nbytes:
            largest = (self.world_size - 1) * max(
                self.options.kernel_bytes, 0 if self.tuning is None or "kernel_bytes" in self.given
                else self.tuning.largest("direct"))
            half = max(nbytes, 2 * half, largest, 64 << 10)
            address = self.device.alloc(2 * half)
            self._ring = (address, half)
            self._exports.clear()
            self.layout_epoch += 1  # programs bound to the old ring must not repeat
        return address, half

    def _scratch_of(self, nbytes: int) -> Any:
        address, size = self._scratch
        if size < nbytes:
            if address in self._pinned:
                self._kept.append(address)  # a captured graph may use it: freed at close
            elif address is not None:
                self._retired.append(address)  # earlier calls may still use it; freed on sync
            address = self.device.alloc(nbytes)
            self._scratch = (address, nbytes)
            self._exports.clear()
            self.layout_epoch += 1  # programs bound to the old scratch must not repeat
        return address

    # -- teardown -------------------------------------------------------------------------
    def drained(self, timeout: float) -> bool:
        """Whether every unfinished call's caller stream reached it and the lanes are idle
        within ``timeout`` s (then nothing queued will touch this rank's memory again)."""
        with self.lock:
            entries = [call.entry for call in self.inflight if call.entry is not None]
            # a kernel on its caller's stream has run once its completion value is written
            last = max((call.value for call in self.inflight if call.on_caller), default=0)
        if not entries and not last and not self.aborted:
            return True
        self.device.activate()
        return self.streams.drained(entries, timeout, until=lambda: self.completed >= last)

    def close_streams(self) -> None:
        self.device.activate()
        self.streams.close()
        with self.lock:
            self.inflight.clear()
            self._unissued.clear()
        self._templates.clear()
        self._programs.clear()  # their peer addresses die with the device's mappings
        self._fast.clear()
        self.windows.clear()

    def leave_device(self, leak: bool, peers_done: bool = False) -> None:
        """Once no peer's lane can write into this rank's memory any more: free this rank's
        pad and scratch, and close the device if no other communicator uses it (with
        ``leak``, keep everything; the 8-byte host word stays until the device closes).
        ``peers_done``: every peer has closed too (or its process is gone), so nobody can
        write into the pad, not even an abort's poison: it may be reused (``free_pad``)."""
        if not leak:
            self.device.activate()
            self.device.free_pad(self.pad.address, peers_done)
            for address in self._retired + self._kept + [self._scratch[0]]:
                if address is not None:
                    self.device.free(address)
            self._retired, self._kept, self._scratch = [], [], (None, 0)
            self._pinned.clear()
        self.share.leave(leak)


def _memo_key(shape: Shape, buffers: Dict[str, Optional[Buffer]]) -> tuple:
    """What a repeat (``Engine.repeat``) is known by: the shape and the buffers'
    addresses."""
    return (shape,) + tuple(None if buffer is None else buffer.address
                            for buffer in buffers.values())


def _digest(signature: tuple) -> int:
    """A nonzero 64-bit digest of a call's signature, the same in every process (Python's
    ``hash`` of a string is not)."""
    digest = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _callers(calls: Sequence[Call]) -> List[Any]:
    """The distinct caller streams of ``calls``, in call order."""
    callers: Dict[Any, Any] = {}
    for call in calls:
        callers.setdefault(_stream_key(call.caller), call.caller)
    return list(callers.values())


def _stream_key(stream: Any) -> Any:
    """Streams compare by handle (CUDA handles are ints); host streams by identity."""
    try:
        return int(stream)
    except (TypeError, ValueError):
        return id(stream)
