"""The engine: one per rank, it owns everything a call needs below the public API and
the matching (``hoccl._engine`` says how a call flows through it)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

from .._buffers import Buffer
from .._errors import AbortedError, HocclError, InvalidArgumentError, fatal
from .._windows import Windows
from ..backends._base import SmCaps
from ..p2p import Executor
from ..sched import Options, Shape
from ..sched.select import Choice, Table
from ..streams import StreamManager
from .calls import Call, Matcher, stream_key
from .inflight import InFlight
from .issue import Issuing
from .memory import DeviceShare, Memory
from .order import Order
from .prepared import Preparer
from .replay import Replay, replay_of
from .sequences import Sequences
from .signals import SignalPad

__all__ = ["Engine"]


class Engine(Issuing):
    """One rank's machinery.  Built by ``hoccl.init`` / ``init_local``; used by the
    Communicator (calls), the group (matched calls) and the health monitor (state,
    abort)."""

    def __init__(self, *, rank: int, world_size: int, share: DeviceShare, options: Options,
                 verify_plans: bool, sms: SmCaps, owns_device: bool,
                 given: FrozenSet[str] = frozenset()):
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
        #: it (``hoccl.sched.select.choose``): the table is set by the builder before the
        #: first call (``use_table``)
        self.tuning: Optional[Table] = None
        self.machine: Dict[str, Any] = {}  # what the table is keyed by (hoccl.tuning)
        self.tuning_origin = "defaults"
        self.given: FrozenSet[str] = given
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
        #: what the caller streams and lanes are ordered after, and the latest direct calls
        self.order = Order()
        #: the matching keys and signal bases of this rank's calls
        self.sequences = Sequences()
        #: calls issued without asking the peers (``ProcessGroup.complete``)
        self.issued_fast = 0
        self.direct_calls = 0  # eager calls issued as direct kernels on their callers' streams
        self.replayed = 0  # repeats replayed (``replay``): neither prepared nor matched again
        self.lock = threading.RLock()
        self.inflight = InFlight(self.streams, self.lock)  # enqueued, in call order
        self.closed = False
        self.aborted = False
        self.abort_reason = ""
        #: the error later calls raise: AbortedError, or PeerDeadError when a peer's
        #: process exited
        self.abort_error: type = AbortedError
        #: an error found for this rank's call while another rank was calling (init_local):
        #: raised by the next synchronize
        self.pending_error: Optional[HocclError] = None
        #: what matches this rank's calls with its peers' (``attach``: the Communicator's
        #: group), and what aborts the communicator when that fails for good
        self.group: Optional[Matcher] = None
        self._failed: Callable[[List[Call], BaseException], None] = lambda calls, error: None

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
        known = self.order.direct_call(value)
        return known or (0 if value >= 1 << 61 else value, "", ())

    def made(self) -> Tuple[int, Dict[Tuple[int, ...], int]]:
        """How many calls this rank has made: collectives, and calls per (sender, receiver)
        pair (what a call's key counts, ``prepare``)."""
        with self.lock:
            return self.sequences.made()

    def mark_aborted(self, reason: str) -> bool:
        """Make later calls raise; False if this rank was already aborted or closed."""
        with self.lock:
            if self.aborted or self.closed:
                return False
            self.aborted = True
            self.abort_reason = reason
            return True

    def mark_closed(self) -> None:
        """Make later calls refuse: the communicator is closing."""
        with self.lock:
            self.closed = True

    def raise_later(self, error: type) -> None:
        """Later calls raise ``error`` (PeerDeadError: a peer's process exited) rather
        than AbortedError."""
        with self.lock:
            self.abort_error = error

    def still_captured(self, call: Call) -> bool:
        """Whether captured ``call``'s caller stream is still in an open capture (one
        invalidated by an earlier error is not), so its steps can still go into it."""
        try:
            return self.device.capturing(call.caller)
        except InvalidArgumentError:  # invalidated
            return False

    def fail_later(self, error: HocclError) -> None:
        """An error found for this rank's call while another rank was calling
        (init_local): the next synchronize raises it (``take_pending_error``)."""
        self.pending_error = error

    def take_pending_error(self) -> Optional[HocclError]:
        """The error ``fail_later`` left, if any, now forgotten."""
        error, self.pending_error = self.pending_error, None
        return error

    def count_issued_fast(self, calls: int) -> None:
        """``calls`` were issued without asking the peers (``ProcessGroup.complete``)."""
        self.issued_fast += calls

    def use_table(self, machine: Dict[str, Any], table: Optional[Table], origin: str) -> None:
        """Take ``table`` (found for ``machine``, from ``origin``) as the tuning table."""
        self.machine = machine
        self.tuning, self.tuning_origin = table, origin

    def configure(self, config: Any) -> None:
        """Take ``config``'s settings (a ``hoccl.Config``) for later calls: a change of
        options empties the cache, one of fused sums too (bound programs hold them)."""
        with self.lock:
            self.sms.max_sms = config.max_sms
            self.sms.copy_sms = config.copy_sms or self.sms.copy_sms
            self.set_fuse_sums(bool(config.fuse_sums))
            self.verify_plans = config.verify_plans
            if config.plan_options != self.options or config.given != self.given:
                self.options = config.plan_options
                self.given = config.given
                self.preparer.cache.clear()  # every shape is planned afresh

    def set_fuse_sums(self, fuse: bool) -> None:
        """Run a pushed reduction's chunk sums as one launch (``fuse``) or one per chunk,
        for later calls: the bound programs, which hold the launches, are made anew."""
        with self.lock:
            if fuse != self.sms.fuse_sums:
                self.sms.fuse_sums = fuse
                self.forget_programs()

    def new_layout(self) -> None:
        """What prepared calls depend on changed (``layout_epoch``): those made before are
        made afresh."""
        self.layout_epoch += 1

    def learn(self, peers_of_calls: Any) -> None:
        """The peers' buffers of matched calls (each call's ``peers``): their scratch and
        rings, for later calls issued without asking (``Preparer.learn``)."""
        self.preparer.learn(peers_of_calls)

    def forget_programs(self) -> None:
        """Prepare and bind every call afresh from now on: what a bound program holds
        changed (``fuse_sums``)."""
        self.layout_epoch += 1
        self.preparer.cache.clear()

    def add_window(self, address: int, nbytes: int, owner: Any, bases: Optional[List[Any]],
                   sizes: Optional[List[int]], imports: Sequence[Any] = ()) -> Any:
        """Register the next window (``Windows.add``).  With the peers' ``bases`` known
        (across processes: ``imports`` are the peers' mappings it holds) calls prepared
        before may now be bound without asking: they are made afresh."""
        if bases is not None:
            self.layout_epoch += 1
        window = self.windows.add(address, nbytes, owner, bases, sizes)
        if bases is not None:
            window.imports = list(imports)
        return window

    def remove_window(self, window: Any) -> None:
        """Drop ``window`` of a rank whose peers live in this process: nothing was mapped
        for it."""
        self.windows.remove(window)

    def forget_window(self, window: Any) -> None:
        """Drop ``window`` (deregistered by every rank, its calls finished): the calls
        prepared on it go, then the mappings no call made."""
        self.windows.remove(window)
        self.layout_epoch += 1
        self.device.activate()
        for descriptor in window.imports:
            self.device.drop_import(descriptor)

    # -- a call: prepare, submit, enqueue -----------------------------------------------
    def attach(self, group: Matcher, failed: Callable[[List[Call], BaseException], None]
               ) -> None:
        """Match this rank's calls through ``group``; ``failed`` aborts the communicator
        when matching a call failed for good (``hoccl._errors.fatal``)."""
        self.group, self._failed = group, failed

    def choice(self, shape: Shape) -> Choice:
        """The path and options ``shape``'s calls take (``Preparer.choice``)."""
        return self.preparer.choice(shape)

    def prepare(self, name: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
                stream: Any, exported: bool) -> Call:
        """The call, with its prepared part (``Preparer.call``): everything that can fail
        before the caller's stream is fenced."""
        return self.preparer.call(name, shape, buffers, stream, exported)

    def submit(self, call: Call, grouped: bool = False) -> None:
        """Drive ``call`` (prepared, its arguments checked) to the device: enqueue it, then
        have the group match it with the peers' calls, which issues it (``issue``) or
        releases it.  ``grouped`` (inside ``hoccl.group()``): only enqueued, unfenced;
        the group's end offers and matches it (``hoccl._group_calls.hand_over``)."""
        group = self.group
        assert group is not None, "attach a group before the first call"
        # across processes a call returns once issued: its caller is fenced then, after the
        # peers' buffers are mapped (``issue``), or a direct kernel's or one-lane plan's
        # steps go on the caller's stream itself (captured: one graph node); a call held
        # until every rank made it (one process), or a repeat bound for peers told without
        # asking (it maps nothing), has its caller fenced now
        exported = group.exported
        if not grouped and exported and (
                call.prepared.direct or (call.prepared.part.one_lane and not call.captured)):
            call.on_caller = True
        self.enqueue(call, fence=not grouped and (
            not exported or call.prepared.bound_without_asking))
        if grouped:
            return
        calls = [call]  # offered and completed at once, as ``hand_over`` does for a group
        try:
            group.post(calls)
            group.complete(calls)
        except BaseException as error:
            if isinstance(error, InvalidArgumentError):
                error.made = True  # type: ignore[attr-defined]  # the peers know of it
            if fatal(error):
                self._failed(calls, error)
            raise

    # -- a repeated call: replayed -------------------------------------------------------
    def replayable(self, call: Call) -> Optional[Replay]:
        """A ``Replay`` of ``call`` (just submitted alone, and issued) if its repeats can be
        replayed (``replay_of``); else None."""
        return replay_of(call, self.rank, self.group, self.preparer.cache.generation)

    def replay(self, replay: Replay, stream: Any, keepalive: Tuple[Any, ...]) -> bool:
        """Submit a repeat of ``replay``'s call on ``stream`` (the caller's, as the public
        call takes it; ``keepalive``: its arguments, held until it has run), as ``submit``
        would, less what the repeat needs no more: preparing, binding, matching.  False
        (nothing done) where the replay no longer holds, or the communicator cannot take
        calls (closed, aborted, a direct kernel's divergence found), or the stream is
        being captured: the call must then go the whole way, which raises what it must."""
        if self.closed or self.aborted or self.error_word.value:
            return False
        device = self.device
        empty = replay.empty  # nothing to move, no peer: nothing enqueued, eager or captured
        if not empty:
            device.activate()
        caller = device.resolve_stream(stream, keepalive)
        if (stream_key(caller) != replay.caller_key or (not empty and device.capturing(caller))
                or not replay.valid(self.layout_epoch, self.preparer.cache.generation)):
            return False
        if empty:
            self.replayed += 1
            return True
        prepared = replay.prepared
        plan = prepared.plan
        program = prepared.program
        assert program is not None  # ``valid``
        sequences = self.sequences
        call = Call(replay.name, plan, sequences.key(plan), prepared.signature, prepared.local,
                    prepared.shared, keepalive, caller, self, prepared,
                    on_caller=replay.on_caller, fast=prepared.fast)
        # on the lanes: bound for peers told without asking, so fenced now, as ``submit`` does
        self.enqueue(call)
        self.replayed += 1
        group = self.group
        assert group is not None
        calls = [call]
        try:
            if replay.offers:
                group.post(calls)
                call.peers = prepared.fast  # type: ignore[assignment]
            if replay.on_caller:
                self.issue_on_caller(call, program, time.monotonic())
            else:
                self.issue(calls, imported=True)
            if replay.offers:
                group.issued_without_asking(calls)
        except BaseException as error:
            if fatal(error):
                self._failed(calls, error)
            raise
        return True

    def enqueue(self, call: Call, fence: bool = True) -> None:
        """Number ``call`` and fence the caller's stream on it.  From here the call must
        end in ``issue`` or ``release``: the caller's stream waits for it.  Without
        ``fence`` only its entry is marked; ``fence_callers`` (or ``issue``) fences it."""
        prepared = call.prepared
        if not prepared.loaded:  # its direct kernel, if any: loading may synchronize the
            # context, so never while a caller waits (lanes issue it too, one process)
            with self.device.relaxed_capture() if call.captured else contextlib.nullcontext():
                self.executor.load(call.plan)
            prepared.loaded = True
        if call.captured:
            with self.device.relaxed_capture():
                self.executor.reserve([(call.plan, prepared.marks)], captured=True)
            self.sequences.count(call.plan, call.key)
            if not call.on_caller:  # else the kernel is captured on the caller's stream itself
                call.entry = self.streams.fence_in(call.caller, 0, wait=False)
            call.fenced = True  # a captured call is never numbered nor in flight
            return
        # Every lane and event the calls not yet issued will take, made before the fence:
        # no driver call that may synchronize the context runs while a caller waits.  A
        # call on its caller's stream takes none.
        if not call.on_caller:
            self.executor.reserve(self.inflight.needs() + [(call.plan, prepared.marks)])
        self.sequences.count(call.plan, call.key)
        self.calls += 1
        call.value = self.calls
        if call.on_caller:  # its steps themselves keep the caller's place (``issue``)
            call.fenced = True
        else:
            call.entry = self.streams.fence_in(call.caller, call.value, wait=fence)
            call.fenced = fence
            if fence:
                self.order.note(call.value, (call.caller,))
        self.inflight.add(call, self.completed)

    def skip(self, pair: Optional[Tuple[int, int]]) -> tuple:
        """The key of a call this rank refused (its arguments were wrong) and that its peers
        are told of in its place (``Group.refuse``): the next collective's, or the next of
        ``pair`` (sender, receiver); its sequence advances as if the call had been made."""
        with self.lock:
            return self.sequences.skip(pair)

    # -- after a call ---------------------------------------------------------------------
    def finish(self) -> None:
        """After every enqueued call has completed: retire them, free retired scratch."""
        with self.lock:
            self.inflight.finish()
            self.device.activate()
            self.memory.free_retired()

    def unfinished(self) -> List[Call]:
        """Issued calls whose completion value has not been reached, oldest first."""
        return self.inflight.unfinished(self.completed)

    def held(self) -> List[Call]:
        """Enqueued calls not yet issued (init_local: waiting for other ranks' calls)."""
        return self.inflight.held()

    # -- teardown -------------------------------------------------------------------------
    def drained(self, timeout: float) -> bool:
        """Whether every unfinished call's caller stream reached it and the lanes are idle
        within ``timeout`` s (then nothing queued will touch this rank's memory again)."""
        entries, last = self.inflight.waiting()
        if not entries and not last and not self.aborted:
            return True
        self.device.activate()
        return self.streams.drained(entries, timeout, until=lambda: self.completed >= last)

    def close_streams(self) -> None:
        self.device.activate()
        self.streams.close()
        self.inflight.clear()
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
