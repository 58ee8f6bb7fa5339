"""The Communicator: hoccl's communicator of ranks on one host.

``CommunicatorApi`` (``hoccl._api``) checks a collective's arguments and hands it to
``_run``, which here hands it to the rank's engine, the one place that drives a call::

    call = engine.prepare(...)   # plan, caller's stream, exports: may raise, enqueues nothing
    engine.submit(call)          # enqueue it (in one process, fence the caller's stream
                                 # now), have the group match it with the peers' calls,
                                 # then issue it (``Engine.issue``: maps the peers' buffers,
                                 # then fences across processes) → Executor → Device

Inside ``hoccl.group()`` (``hoccl._group_calls``) ``submit`` only enqueues: the matching
waits for the outermost ``group_end``, where every held call is offered to its peers
first and matched after, so cycles of calls cannot block each other.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import weakref
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from . import _validate as check
from ._api import CommunicatorApi
from ._buffers import Buffer, as_buffer
from ._engine import Call, Engine
from ._errors import (AbortedError, DivergedError, HocclError, HocclTimeoutError,
                      InvalidArgumentError, PeerDeadError)
from ._group_calls import group, group_end, group_start, held_calls
from ._groups import _ABORTED, Group, _describe
from ._health import Health
from .bootstrap import end_of_job
from .config import Config
from .sched import Shape

__all__ = ["Communicator", "group", "group_start", "group_end"]

log = logging.getLogger("hoccl")

_OPEN: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
#: how long close waits, after an abort, for caller streams to reach their calls
_DRAIN_SECONDS = 10.0
_KEPT: List[Any] = []  # buffers of calls still queued behind a stuck stream at close


class _Builders(NamedTuple):
    """What makes a communicator's children (``split``) and its survivors' communicator
    (``shrink``): the builder's functions, handed in by the builder that made it, so
    that this module never imports the builder."""
    split: Callable[..., Optional["Communicator"]]
    shrink: Callable[..., "Communicator"]


class Communicator(CommunicatorApi):
    """One rank of a group.  Create with ``hoccl.init`` or ``hoccl.init_local``."""

    def __init__(self, *, engine: Engine, group: Group, health: Health, builders: "_Builders"):
        self._engine = engine
        self._group = group
        self._health = health
        self._builders = builders
        self.rank = engine.rank
        self.world_size = engine.world_size
        self.backend: str = engine.device.backend
        #: CUDA ordinal of this rank's GPU (None on the host backend)
        self.device: Optional[int] = engine.device.ordinal
        engine.attach(group, self._fail)  # the engine drives its calls through the group
        _OPEN.add(self)

    # -- state ------------------------------------------------------------------------------
    @property
    def device_handle(self) -> Any:
        """This rank's ``hoccl.backends`` Device (host backend: ``create_stream()`` makes
        streams for ``stream=``)."""
        return self._engine.device

    @property
    def config(self) -> Config:
        """Every setting later calls use (``hoccl.Config``), each resolved (``copy_sms``,
        ``fuse_sums``): what ``set_options`` changes and ``split`` inherits."""
        engine = self._engine
        return Config(timeout=self._health.timeout, verify_plans=engine.verify_plans,
                      max_sms=engine.sms.max_sms, copy_sms=engine.sms.copy_sms,
                      fuse_sums=engine.sms.fuse_sums, given=engine.given,
                      **dataclasses.asdict(engine.options))

    @property
    def tuning(self) -> Any:
        """The tuning table this communicator chooses its calls' paths from (rank 0's,
        ``hoccl.tuning``), or None: the defaults."""
        return self._engine.tuning

    def _explain(self, shape: Shape) -> Dict[str, Any]:
        choice = self._engine.choice(shape)
        return {**choice.describe(), "table": self._engine.tuning_origin}

    @property
    def options(self) -> Any:
        """The planning options (``hoccl.sched.Options``) later calls use."""
        return self._engine.options

    @property
    def timeout(self) -> float:
        return self._health.timeout

    @property
    def max_sms(self) -> int:
        """The most SMs this communicator's reduction kernels take."""
        return self._engine.sms.max_sms

    @property
    def fuse_sums(self) -> bool:
        """Whether a pushed reduction's chunk sums run as one launch per call
        (``set_options``)."""
        return self._engine.sms.fuse_sums

    @property
    def copy_sms(self) -> int:
        """The most SMs the same-GPU copy of out-of-place own blocks takes."""
        return self._engine.sms.copy_sms

    @property
    def aborted(self) -> bool:
        return self._engine.aborted

    @property
    def abort_reason(self) -> str:
        return self._engine.abort_reason

    @property
    def closed(self) -> bool:
        return self._engine.closed

    # -- registered buffers ------------------------------------------------------------
    def register(self, array: Any) -> Any:
        """Register ``array`` (any array hoccl accepts, on this rank's device) with every
        rank: a collective call, made by every rank in the same order, that exchanges
        the buffer with the peers once (NCCL's window registration).  Returns a
        ``hoccl.Window``; the array is held until ``deregister``.

        A later all_gather, reduce_scatter, all_reduce, all_to_all (or barrier) whose
        buffers lie inside registered arrays, at the same offsets of the same windows on
        every rank (symmetric buffers, as NCCL's symmetric memory wants), needs no
        descriptor exchange and no waiting for the peers on the host:
        it is issued at once, and the peers' descriptions of it are checked after the
        fact.  If a rank's call differed, every rank raises ``DivergedError`` (at its next
        call, ``synchronize``, ``deregister`` or ``close``) and the communicator is
        aborted; no call writes outside the windows the peers registered.  Rooted
        collectives and send/recv, whose buffers differ by role, and calls on
        unregistered buffers exchange descriptors as before.  Ranks of ``init_local`` (one process) always
        pass buffers by address: for them this only records the window.

        The memory must not overlap a window already registered; with the cuda backend
        it must be IPC-capable (``cudaMalloc``: cupy's default pool, torch's caching
        allocator without expandable segments, ``hoccl.empty``).  Not inside
        ``hoccl.group()``."""
        name = "register"
        self._usable(name)
        if held_calls() is not None:
            raise InvalidArgumentError("register: not inside hoccl.group()")
        buffer = as_buffer(name, "array", array, writable=False, reduction=False)
        check.on_device(name, "array", buffer, self.backend, self.device)
        verdict = None
        if not buffer.nbytes:
            verdict = "the array is empty; register at least one byte"
        else:
            clash = self._engine.windows.overlapping(buffer.address, buffer.nbytes)
            if clash is not None:
                verdict = (f"the array at {buffer.address:#x} ({buffer.nbytes} bytes) overlaps "
                           f"registered window #{clash.index} ({clash.address:#x}, "
                           f"{clash.nbytes} bytes)")
        with self._aborting_on_divergence():
            return self._group.register(self._engine, buffer, verdict)

    def deregister(self, window: Any) -> None:
        """Drop a registration (``window``: what ``register`` returned, or the registered
        array itself).  Collective, in the same order on every rank: it waits for this
        rank's calls to finish and for every rank to reach it, so no call of any rank
        touches the memory afterwards; then the array is released."""
        name = "deregister"
        self._usable(name)
        if held_calls() is not None:
            raise InvalidArgumentError("deregister: not inside hoccl.group()")
        engine = self._engine
        found, verdict = engine.windows.of("deregister", window), None
        if found is None:
            verdict = (f"expected a Window from register or a registered array itself, got a "
                       f"{type(window).__name__} that is not a window registered with this "
                       f"communicator")
        self.synchronize()
        with self._aborting_on_divergence():
            self._group.deregister(engine, found, verdict)

    @property
    def windows(self) -> List[Any]:
        """This rank's registered windows, by address."""
        return list(self._engine.windows)

    # -- host side ---------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block until all work this communicator enqueued has finished.

        After ``timeout`` seconds it aborts the communicator (so no stream stays blocked)
        and raises HocclTimeoutError naming the call, its number and the peers whose
        signals never came.  With ``init_local`` it raises at once if a call is held
        because other ranks have not made it yet.
        """
        self._usable("synchronize")
        _refuse_held_calls(self)
        with self._aborting_on_divergence():
            try:
                self._health.synchronize(poll=self._group.check)
            except AbortedError:
                self._group.check()  # a peer that aborted on a divergence: say so
                raise
            self._group.settle("synchronize")
        if self._engine.error_word.value:
            self._diverged("synchronize")

    @property
    def calls(self) -> int:
        """A mark of this rank's calls (collectives, send, recv, barrier) so far, for
        ``finished`` and ``order_after``: it grows with every call that enqueues work,
        which is every call but a world of one's repeat with nothing to move (in place,
        unscaled)."""
        return self._engine.calls

    def finished(self, mark: int) -> bool:
        """Whether every call this rank made up to ``mark`` (a value of ``calls``) has
        finished on the device.  Never blocks; raises AbortedError after an abort."""
        engine = self._engine
        mark = check.mark("finished", mark)
        if engine.aborted:
            raise AbortedError(f"finished: the communicator was aborted: {engine.abort_reason}")
        return engine.closed or engine.completed >= mark

    def order_after(self, mark: int, *, stream: Any = None) -> None:
        """Make ``stream`` (None: the default stream) wait, on the device, until every
        call this rank made up to ``mark`` (a value of ``calls``) has finished: one stream
        memory operation, no SM, no host wait; what an event recorded after the call
        would give, without the event.  Raises AbortedError after an abort."""
        self._usable("order_after")
        engine = self._engine
        mark = check.mark("order_after", mark)
        if mark > engine.calls:
            raise InvalidArgumentError(f"order_after: mark {mark} is past this rank's "
                                       f"{engine.calls} calls so far")
        if mark <= 0:
            return
        engine.device.activate()
        caller = check.caller_stream("order_after", engine.device, stream)
        engine.device.wait_value(caller, engine.streams.completion, mark)

    def abort(self, reason: str = "") -> None:
        """Release every stream-side wait of this communicator and make later calls raise.

        Abort values go into this rank's signal pad, entry and completion words (so its
        lanes and the callers' streams run on) and into the slots this rank signals in
        every peer's pad (so the peers' waits on it are released and they learn of the
        abort).  Outputs of unfinished calls are undefined.  The GPU stays usable and a
        new communicator can be created.  Idempotent.  The other ranks of this process
        (``init_local``) share the abort.
        """
        self._health.abort(reason or f"rank {self.rank}: abort() was called")

    def split(self, color: Optional[int], key: Optional[int] = None, *,
              timeout: Optional[float] = None, verify_plans: Optional[bool] = None,
              max_sms: Optional[int] = None, copy_sms: Optional[int] = None,
              **options: Any) -> Optional["Communicator"]:
        """A new communicator of the ranks that pass the same ``color`` (ncclCommSplit,
        MPI_Comm_split).  Every rank of this communicator must call it.

        Ranks are ordered by (``key``, rank here); ``key=None`` is this rank.  A ``color``
        of None (NCCL_SPLIT_NOCOLOR) makes no communicator: this rank gets None.  The new
        communicator is on the same device (this one's device object, shared: its
        context, peer access and cache of imported buffers), with this one's backend,
        timeout, SM caps (``max_sms``, ``copy_sms``), ``verify_plans`` and plan options
        unless given here.  It has a signal pad, counters and lanes of its own, so calls
        on the two never share a slot or a lane, and its own mailboxes.

        The ranks find each other through this communicator's bootstrap, which must
        offer ``split``: under MPI that is MPI_Comm_split of its communicator (simpler
        than a sub-bootstrap over this one's, which every rank of this one, colored or
        not, would have to serve in lockstep for the new one's whole life).  Arguments
        are checked on every rank before that, and a bad one on any rank raises
        ``InvalidArgumentError`` on all.  ``init_local`` ranks split together with
        ``hoccl.split_local``; a ``HierarchicalCommunicator`` cannot split yet.

        Close the new communicator and this one in any order: the device is closed when
        the last communicator using it is.  Aborting this communicator aborts the ones
        split from it (they share its device); aborting one of those leaves this one
        usable.  Not inside ``hoccl.group()``.
        """
        self._usable("split")
        if held_calls() is not None:
            raise InvalidArgumentError("split: not inside hoccl.group(); split before or after")
        given = {name: value for name, value in dict(
            options, timeout=timeout, verify_plans=verify_plans, max_sms=max_sms,
            copy_sms=copy_sms).items() if value is not None}
        return self._builders.split(self, color, key, given)

    def _shrink(self, exclude: Any, wait: bool, settings: Dict[str, Any]) -> "Communicator":
        return self._builders.shrink(self, exclude, wait, settings)

    def set_options(self, **changes: Any) -> None:
        """Change settings (fields of ``hoccl.Config``) for later calls; the rest stay.
        Every change is checked before any takes effect."""
        self._usable("set_options")
        config = self.config.replace("set_options", **changes)
        self._engine.configure(config)
        self._health.timeout = config.timeout

    def close(self) -> None:
        """Wait for outstanding work (aborting it after ``timeout``), then release streams,
        events, pads, mappings, peer access and the device.  Idempotent.  Not while the
        enclosing ``hoccl.group()`` holds calls of this communicator."""
        engine = self._engine
        if engine.closed:
            return
        _refuse_in_group(self, "close")
        held = engine.held()
        if held and not engine.aborted:
            # init_local: calls the other ranks never made can never run; complete them
            # unrun, so that the callers' streams do not wait for them for ever
            log.warning("rank %d close: %d call(s) never ran because other ranks did not make "
                        "them (%s); their outputs are not written", self.rank, len(held),
                        ", ".join(call.name for call in held))
            for call in held:
                self._group.withdraw(call)
                engine.release(call)
        if not engine.aborted and engine.unfinished():
            self._closing(lambda: self._health.synchronize("close", poll=self._group.check))
        if not engine.aborted:  # the peers' descriptions of calls run on registered buffers
            self._closing(lambda: self._group.settle("close"))
        engine.mark_closed()
        self._health.stop()
        # after an abort, a caller stream held by the user's work may still reach this
        # rank's fences (and its lanes then run on): never free memory it will touch.
        # Nor memory the peers may write: their waits were released by the abort's poison,
        # and their lanes may still copy into this rank's scratch, its buffers of the calls
        # in flight and its registered windows
        bound = min(self._health.timeout, _DRAIN_SECONDS)
        leak = not engine.drained(bound)
        if leak:
            log.warning("rank %d close: the caller's stream of an unfinished call has not "
                        "reached it within %g s; keeping this communicator's device memory "
                        "and the call's buffers for the life of the process", self.rank, bound)
        leak = leak or engine.aborted
        if leak:
            _KEPT.extend(call.keepalive for call in engine.inflight)
            _KEPT.extend(window.owner for window in engine.windows)
        engine.close_streams()
        self._group.leave(engine, leak)  # frees the device once no local peer can write to it
        _OPEN.discard(self)

    def __repr__(self) -> str:
        return (f"<hoccl.Communicator rank {self.rank}/{self.world_size} backend={self.backend} "
                f"device={self.device}>")

    # -- internals ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _aborting_on_divergence(self) -> Iterator[None]:
        """A DivergedError (a call on registered buffers ran, and a peer's differed)
        aborts the communicator before it propagates: the ranks' signal sequences may
        no longer agree."""
        try:
            yield
        except DivergedError as error:
            self._health.abort(str(error), kind="diverged")
            raise

    def _closing(self, wait: Any) -> None:
        """One of ``close``'s waits: its errors are logged, not raised."""
        try:
            with self._aborting_on_divergence():
                wait()
        except HocclError as error:
            log.warning("rank %d close: %s", self.rank, error)

    def _usable(self, name: str) -> None:
        if self._engine.closed:
            raise InvalidArgumentError(f"{name}: the communicator is closed")
        if self._engine.aborted:
            raise self._health.aborted_error(name)
        if self._engine.error_word.value:  # a host read: no driver call
            self._diverged(name)

    def _diverged(self, name: str) -> None:
        """A direct kernel found a peer's kernel signalling from another call: abort and
        raise DivergedError naming the call."""
        found = self._engine.diverged_call()
        assert found is not None
        value, call, signature = found
        what = (f"its {call} {_describe(signature)} (call {value})" if call
                else f"its call {value}" if value
                else "a direct kernel replayed from a CUDA graph")
        reason = (f"{name}: rank {self.rank} ran {what} as a direct kernel while a peer's kernel "
                  f"signalled from a call with other arguments: the ranks' sequences of calls "
                  f"differ, and that call's output was not written; {_ABORTED}")
        self._health.abort(reason, kind="diverged")
        raise DivergedError(reason)

    def _run(self, name: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
               stream: Any) -> None:
        """Prepare (may fail: nothing enqueued; a repeat finds its prepared call), then
        submit to the engine, which enqueues it and has the group match it — now, or at
        the end of the enclosing ``hoccl.group()``."""
        self._repeats.remember(shape, buffers)
        engine = self._engine
        call = engine.prepare(name, shape, buffers, stream, exported=self._group.exported)
        self._usable(name)  # the watchdog may have aborted meanwhile
        held = held_calls()
        if held and held[-1][1].captured != call.captured:
            raise InvalidArgumentError(
                f"{name}: calls of one hoccl.group() are all captured into CUDA graphs or "
                f"all eager; this one is {'captured' if call.captured else 'eager'}, the "
                f"group's first is {'captured' if held[0][1].captured else 'eager'}")
        self._health.start_watchdog()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d %s %s key=%s", self.rank, name, shape, call.key)
        engine.submit(call, grouped=held is not None)
        if held is not None:
            held.append((self, call))
        elif (replay := engine.replayable(call)) is not None:
            self._repeats.keep_replay(replay)

    def _replay(self, name: str, replay: Any, args: tuple, kwargs: Dict[str, Any]) -> bool:
        """A repeat replayed by the engine (``Engine.replay``); False: nothing done, the
        call goes the whole way (which raises what it must)."""
        keepalive = args + tuple(kwargs.values()) if kwargs else args
        return held_calls() is None and self._engine.replay(replay, kwargs.get("stream"),
                                                            keepalive)

    def _refused_call(self, name: str, peer: Any, error: InvalidArgumentError) -> None:
        _refuse(self, name, peer, error)

    def _fail(self, calls: List[Call], error: BaseException) -> None:
        """The peers never answered: nothing can be matched up any more."""
        reason = str(error)
        if not reason.startswith(calls[0].name + ":"):
            reason = f"{calls[0].name}: rank {self.rank}: {reason}"
        if isinstance(error, PeerDeadError):  # later calls say the peer is gone, too
            self._health.abort_for_lost_peer(reason, type(error))
        else:
            self._health.abort(reason, kind="diverged" if isinstance(error, DivergedError)
                               else "aborted")


def _refuse(comm: Communicator, name: str, peer: Any, error: InvalidArgumentError
            ) -> None:
    """``name`` raised ``error`` before it was made: take its place in this rank's
    sequence of calls and tell its participants (``Group.refuse``), whose matching
    calls then end with MismatchError, the communicator usable.  A send or recv to no
    valid peer has no participants to tell."""
    engine = comm._engine
    if engine.closed or engine.aborted:
        return
    pair: Optional[Tuple[int, int]] = None
    participants: Sequence[int] = range(comm.world_size)
    if name in ("send", "recv"):
        try:
            other = check.rank(name, "peer", peer, comm.world_size, other_than=comm.rank)
        except InvalidArgumentError:
            return
        pair = (comm.rank, other) if name == "send" else (other, comm.rank)
        participants = pair
    key = engine.skip(pair)
    try:
        comm._group.refuse(name, key, participants, str(error), comm.rank)
    except HocclError as failure:  # the peers then time out on the call, naming it
        log.warning("rank %d %s: could not tell the peers of the refused call: %s",
                    comm.rank, name, failure)


def _refuse_in_group(comm: Communicator, name: str) -> None:
    """``name`` (synchronize, close) cannot be made while the enclosing ``hoccl.group()``
    holds calls of ``comm``: they are handed to the peers only at the group's end."""
    grouped = [call for owner, call in held_calls() or () if owner is comm]
    if grouped:
        raise InvalidArgumentError(
            f"{name}: rank {comm.rank} has {len(grouped)} call(s) held in the enclosing "
            f"hoccl.group() ({', '.join(call.name for call in grouped)}), handed to the peers "
            f"at the group's end; {name} after the group")


def _refuse_held_calls(comm: Communicator) -> None:
    """``synchronize`` cannot wait for calls that are not issued yet: calls held in the
    enclosing ``hoccl.group()`` (``_refuse_in_group``), or, with init_local, calls
    waiting for other ranks to make theirs."""
    _refuse_in_group(comm, "synchronize")
    held = comm._engine.held()
    if held:
        call = held[0]
        closed = comm._group.closed_peer([call])
        raise HocclTimeoutError(
            f"synchronize: rank {comm.rank}'s {call.name} (call {call.key}) cannot run: "
            f"ranks {comm._group.waiting_for(call)} have not made the matching call yet"
            + (f" ({closed}: it never will)" if closed else
               "; with init_local make every rank's call before synchronizing"))


@atexit.register
def _close_at_exit() -> None:
    """Interpreter exit: release whatever is still blocked, then close (never hang); then,
    if a peer's process was lost, abort the MPI job (``end_of_job``: mpi4py's MPI_Finalize,
    which runs after every Python exit handler, would wait for that process)."""
    for comm in list(_OPEN):
        try:
            if comm._engine.unfinished() or comm._engine.held():
                comm.abort("interpreter exit with unfinished work")
            elif comm._group.dead_peer() is not None:  # a peer lost since the last call
                comm.abort("interpreter exit with a peer's process gone")
            comm.close()
        except Exception as error:  # exit must go on
            log.warning("rank %d exit: %r", comm.rank, error)
    end_of_job()
