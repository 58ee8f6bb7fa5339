"""The engine: one per rank, it owns everything a call needs below the public API and
the matching (``hoccl._engine`` says how a call flows through it)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Deque, Dict, FrozenSet, List, Optional, Sequence, Tuple

from .._buffers import Buffer
from .._errors import AbortedError, HocclError, InvalidArgumentError, MismatchError
from .._windows import Windows
from ..backends._base import SmCaps
from ..p2p import Executor
from ..sched import Options, Shape
from ..sched.plan import Plan
from ..sched.select import Choice, Table
from ..streams import StreamManager
from .calls import Call, callers_of, stream_key
from .memory import DeviceShare, Memory
from .prepared import Preparer
from .signals import SignalPad

__all__ = ["Engine"]

log = logging.getLogger("hoccl")


class Engine:
    """One rank's machinery.  Built by ``hoccl.init`` / ``init_local``; used by the
    Communicator (calls), the group (matched calls) and the health monitor (state,
    abort)."""

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
        self.pad = SignalPad(device, rank, world_size)
        self.host_word = device.alloc_host_word()
        #: written by a direct kernel that found a peer making another call (the call's
        #: value; ``1 << 61`` from a graph's replay): ``diverged``
        self.error_word = device.alloc_host_word()
        self.streams = StreamManager(device, self.pad.completion, self.host_word.address,
                                     self.error_word.address)
        self.executor = Executor(rank, device, self.streams, self.pad, sms)
        self.memory = Memory(device)
        #: registered buffers (``Communicator.register``)
        self.windows = Windows()
        #: counts changes of what prepared calls depend on (scratch, ring, windows, the
        #: peers' scratch and rings, fused sums): a prepared call of an older layout is
        #: made afresh
        self.layout_epoch = 0
        self.preparer = Preparer(self)
        self.calls = 0                  # completion value of the latest enqueued call
        #: the latest completion value some caller streams are known to wait for, and
        #: those streams (by ``stream_key``): a direct kernel on one of them needs no wait
        #: for the previous call (``issue``)
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
        #: calls issued without asking the peers (``ProcessGroup.complete``)
        self.issued_fast = 0
        self.direct_calls = 0  # eager calls issued as direct kernels on their callers' streams
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
            self.preparer.configure(config)

    def forget_programs(self) -> None:
        """Prepare and bind every call afresh from now on: what a bound program holds
        changed (``fuse_sums``)."""
        self.layout_epoch += 1
        self.preparer.cache.clear()

    def forget_window(self, window: Any) -> None:
        """Drop ``window`` (deregistered by every rank, its calls finished): the calls
        prepared on it go, then the mappings no call made."""
        self.windows.remove(window)
        self.layout_epoch += 1
        self.device.activate()
        for descriptor in window.imports:
            self.device.drop_import(descriptor)

    # -- a call: prepare, enqueue --------------------------------------------------------
    def choice(self, shape: Shape) -> Choice:
        """The path and options ``shape``'s calls take (``Preparer.choice``)."""
        return self.preparer.choice(shape)

    def prepare(self, name: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
                stream: Any, exported: bool) -> Call:
        """The call, with its prepared part (``Preparer.call``): everything that can fail
        before the caller's stream is fenced."""
        return self.preparer.call(name, shape, buffers, stream, exported)

    def enqueue(self, call: Call, fence: bool = True) -> None:
        """Number ``call`` and fence the caller's stream on it.  From here the call must
        end in ``issue`` or ``release``: the caller's stream waits for it.  Without
        ``fence`` only its entry is marked; ``fence_callers`` (or ``issue``) fences it."""
        prepared = call.prepared
        if call.captured:
            with self.device.relaxed_capture():
                self.executor.reserve([(call.plan, prepared.marks)], captured=True)
            self._count(call)
            if not call.on_caller:  # else the kernel is captured on the caller's stream itself
                call.entry = self.streams.fence_in(call.caller, 0, wait=False)
            call.fenced = True  # a captured call is never numbered nor in flight
            return
        # Every lane and event the calls not yet issued will take, made before the fence:
        # no driver call that may synchronize the context runs while a caller waits.  A
        # call on its caller's stream takes none (a direct one: its kernel, loaded once).
        if call.on_caller:
            if not prepared.loaded:
                self.executor.load(call.plan)
                prepared.loaded = True
        else:
            self.executor.reserve(self._unissued_needs() + [(call.plan, prepared.marks)])
        self._count(call)
        self.calls += 1
        call.value = self.calls
        if call.on_caller:  # its steps themselves keep the caller's place (``issue``)
            call.fenced = True
        else:
            call.entry = self.streams.fence_in(call.caller, call.value, wait=fence)
            call.fenced = fence
            if fence:
                self._note_ordered(call.value, (call.caller,))
        done = self.completed
        with self.lock:  # the watchdog reads the deque
            inflight = self.inflight
            while inflight and inflight[0].issued and inflight[0].value <= done:
                self._retire(inflight.popleft())  # finished: its buffers may go
            inflight.append(call)
            self._unissued[call.value] = call

    def _unissued_needs(self) -> List[Tuple[Plan, int]]:
        with self.lock:
            return [(held.plan, held.prepared.marks) for held in self._unissued.values()]

    def skip(self, pair: Optional[Tuple[int, int]]) -> tuple:
        """The key of a call this rank refused (its arguments were wrong) and that its peers
        are told of in its place (``Group.refuse``): the next collective's, or the next of
        ``pair`` (sender, receiver); its sequence advances as if the call had been made."""
        with self.lock:
            if pair:
                key: tuple = ("pair",) + tuple(pair) + (self._pair_calls.get(pair, 0),)
                self._pair_calls[pair] = key[-1] + 1
            else:
                key = ("coll", self._collectives)
                self._collectives += 1
            return key

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
        self.executor.reserve(self._unissued_needs())  # see ``enqueue``
        for call in calls:
            call.fenced = True
        callers = callers_of(calls)
        for caller in callers:
            self.streams.fence_out(caller, last)
        self._note_ordered(last, callers)

    def _note_ordered(self, value: int, callers: Sequence[Any]) -> None:
        """``callers`` now wait for completion ``value`` before their later work."""
        keys = {stream_key(caller) for caller in callers}
        if value > self._ordered[0]:
            self._ordered = (value, keys)
        elif value == self._ordered[0]:
            self._ordered[1].update(keys)

    # -- a call: issue -----------------------------------------------------------------
    def issue(self, calls: Sequence[Call], imported: bool) -> None:
        """Enqueue the steps of ``calls`` (one, or one rank's calls of a ``hoccl.group()``,
        which then run side by side), their peers' buffers now in ``call.peers``.
        ``imported``: the peers' ``where`` are export descriptors to map (kept by the
        device).  A peer buffer smaller than the plan reaches into raises MismatchError
        before anything is enqueued.

        One pass down: first the engine's own work (the bounds, the addresses of a call
        not bound yet, the call's signal base, its order, its state), then the executor
        (binding what is not bound yet, then the device commands), which calls only the
        stream manager and the device.  Calls enqueued without a fence (a process
        group's: the call returns only once it is issued) are fenced by the executor,
        after their peers' buffers are mapped: mapping (and unmapping a stale mapping) may
        synchronize the context, which must never happen while a caller's stream waits
        for a call not yet issued."""
        first = calls[0]
        if first.captured and not all(call.captured for call in calls):
            raise InvalidArgumentError(f"{first.name}: calls captured into a CUDA graph "
                                       f"and calls made eagerly cannot be issued together")
        try:
            if first.captured:
                with self.device.relaxed_capture():  # peers' buffers may be mapped now
                    bindings = [self.preparer.binding(call, imported) for call in calls]
            else:
                bindings = [self.preparer.binding(call, imported) for call in calls]
        except MismatchError:
            for call in calls:
                self.release(call)
            raise
        now = time.monotonic()  # the device methods make their context current themselves
        value = (0 if first.captured else first.value if len(calls) == 1
                 else max(call.value for call in calls))
        after = base = 0
        bases: List[int] = []
        reserve: Optional[List[Tuple[Plan, int]]] = None
        callers: List[Any] = []
        if first.on_caller:
            assert len(calls) == 1, "a call on its caller's stream is never in a group"
            key = stream_key(first.caller)
            ordered, streams = self._ordered
            after = value - 1 if value > 1 and not (ordered == value - 1 and key in streams) \
                else 0
            direct = first.prepared.direct
            base = 0 if direct or first.captured else self._base(first)
            if not first.captured:
                self._ordered = (value, {key})
                self._lanes_after = value
                if direct:
                    self._direct_calls.append((value, first.name, first.signature))
                    self.direct_calls += 1
        elif first.captured:
            callers = callers_of(calls)
        else:
            unfenced = [call for call in calls if not call.fenced]
            if unfenced:
                reserve = self._unissued_needs()
                callers = callers_of(unfenced)
                for call in unfenced:
                    call.fenced = True
                self._note_ordered(value, callers)
            bases = [self._base(call) for call in calls]
            after, self._lanes_after = self._lanes_after, 0
            if log.isEnabledFor(logging.DEBUG):
                for call in calls:
                    log.debug("rank %d issue %s call %d base %d lanes %d steps %d", self.rank,
                              call.plan.collective, call.value, call.base, call.plan.lanes,
                              len(call.prepared.compiled))
        with self.lock:
            for call in calls:
                call.issued_at = now
                call.issued = True
                self._unissued.pop(call.value, None)
        executor = self.executor
        items = []  # (plan, program, base, entry) of each call
        for index, (call, (program, addresses)) in enumerate(zip(calls, bindings)):
            if program is None:
                assert addresses is not None
                prepared = call.prepared
                program = executor.bind(call.plan, addresses, captured=call.captured,
                                        signature=prepared.digest, program=prepared.compiled)
                prepared.program, prepared.bound_to = program, call.peers
            items.append((call.plan, program, bases[index] if bases else 0, call.entry))
        if first.on_caller:
            executor.issue_on_caller(items[0][1], first.caller, value, after, base)
        elif first.captured:
            executor.issue(items, 0, callers=callers)
            for call in calls:
                self.streams.release(call.entry)
                call.entry = None
        else:
            executor.issue(items, value, after=after, fence=callers, reserve=reserve or ())

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
        with self.lock:
            call.issued_at = time.monotonic()
            call.issued = True
            self._unissued.pop(call.value, None)

    # -- after a call ---------------------------------------------------------------------
    def finish(self) -> None:
        """After every enqueued call has completed: retire them, free retired scratch."""
        with self.lock:
            for call in self.inflight:
                self._retire(call)
            self.inflight.clear()
            self._unissued.clear()
            self.device.activate()
            self.memory.free_retired()

    def unfinished(self) -> List[Call]:
        """Issued calls whose completion value has not been reached, oldest first."""
        done = self.completed
        with self.lock:
            return [call for call in self.inflight if call.issued and call.value > done]

    def held(self) -> List[Call]:
        """Enqueued calls not yet issued (init_local: waiting for other ranks' calls)."""
        with self.lock:
            return list(self._unissued.values())

    def _retire(self, call: Call) -> None:
        """``call`` finished: its entry event goes back to the pool."""
        if call.entry is not None:
            self.streams.release(call.entry)
            call.entry = None

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
        self.preparer.cache.clear()  # bound programs' peer addresses die with the mappings
        self.windows.clear()

    def leave_device(self, leak: bool) -> None:
        """Once no lane, kernel or abort pump of this rank runs any more, and no peer of
        this process can write into this rank's memory: give back its pad, let go of the
        peers' pads, free its scratch, ring and host words, and close the device if no
        other communicator uses it.  With ``leak`` keep everything (stuck work may still
        write into it)."""
        if not leak:
            self.device.activate()
            self.pad.release()
            self.memory.free()
            for word in (self.host_word, self.error_word):
                self.device.free_host_word(word)
        self.share.leave(leak)
