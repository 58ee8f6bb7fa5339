"""The Communicator: hoccl's public API for one rank.

A collective checks its arguments (``hoccl._validate``), resolves the buffers, and
hands the call to the rank's engine and group::

    call = engine.prepare(...)   # plan, caller's stream, exports: may raise, enqueues nothing
    engine.enqueue(call)         # number it; in one process, fence the caller's stream now
    group.submit([call])         # match with the peers' calls, then engine.issue (which
                                 # maps the peers' buffers, then fences across processes)

Inside ``hoccl.group()`` the submission waits for the outermost ``group_end``, where
every held call is offered to its peers first and matched after, so cycles of calls
cannot block each other.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from . import _validate as check
from ._buffers import Buffer, as_buffer
from ._engine import Call, Engine
from ._errors import (AbortedError, DivergedError, HocclError, HocclTimeoutError,
                      InvalidArgumentError, MismatchError, PeerDeadError)
from ._health import Health
from ._windows import Window
from ._groups import _ABORTED, Group, _describe
from .bootstrap import end_of_job
from .config import Config
from .sched import Shape

__all__ = ["Communicator", "group", "group_start", "group_end"]

#: the collectives ``Communicator.explain`` tells about
_EXPLAINED = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
              "reduce", "gather", "scatter")

log = logging.getLogger("hoccl")

_OPEN: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
#: how long close waits, after an abort, for caller streams to reach their calls
_DRAIN_SECONDS = 10.0
_KEPT: List[Any] = []  # buffers of calls still queued behind a stuck stream at close


class Communicator:
    """One rank of a group.  Create with ``hoccl.init`` or ``hoccl.init_local``."""

    def __init__(self, *, engine: Engine, group: Group, health: Health,
                 splitter: Optional[Callable[..., Optional["Communicator"]]] = None):
        self._engine = engine
        self._group = group
        self._health = health
        #: what makes this communicator's children (``split``): the builder that made it,
        #: handed in, so that this module never imports the builder
        self._splitter = splitter
        self.rank = engine.rank
        self.world_size = engine.world_size
        self.backend: str = engine.device.backend
        #: CUDA ordinal of this rank's GPU (None on the host backend)
        self.device: Optional[int] = engine.device.ordinal
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

    def explain(self, collective: str, nbytes: int, dtype: Any = "float32", *,
                in_place: bool = False, op: Any = "sum", root: int = 0) -> Dict[str, Any]:
        """The path and settings a call would get, and where each came from: ``path``
        (push, pull, one_shot, direct), ``settings`` (the planning options), ``sources``
        (each setting the user or a table row decided: "user" or "table row N (...)"),
        ``row`` and ``table`` (where the table came from, or "defaults").  ``nbytes`` is
        nccl-tests' size: the whole output of all_gather, the whole input of
        reduce_scatter and all_to_all, the buffer of the others.  Nothing is enqueued."""
        name = "explain"
        if collective not in _EXPLAINED:
            raise InvalidArgumentError(f"{name}: collective must be one of {_EXPLAINED}; got "
                                       f"{collective!r}")
        itemsize = check.dtype_itemsize(name, dtype)
        blocks = self.world_size if collective in ("all_gather", "reduce_scatter",
                                                   "all_to_all") else 1
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0 \
                or nbytes % (itemsize * blocks):
            raise InvalidArgumentError(f"{name}: nbytes must be an int >= 0, a multiple of "
                                       f"{itemsize * blocks} ({blocks} blocks of {dtype}); got "
                                       f"{nbytes!r}")
        shape = Shape(collective, self.world_size, nbytes // itemsize // blocks,
                      check.dtype_name(name, dtype), itemsize, op=check.reduce_op(name, op),
                      root=check.rank(name, "root", root, self.world_size), in_place=in_place)
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

    # -- public collectives ----------------------------------------------------------------
    def all_gather(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:
        """``recvbuf[r*count:(r+1)*count] = sendbuf of rank r`` for every rank r.

        Naive equivalent: ``recv = concatenate([send_of(r) for r in range(world_size)])``.
        In place when ``sendbuf`` is this rank's own block of ``recvbuf`` (no copy of
        the own block at all).  Ordered after the work already on ``stream`` and before
        the work enqueued on it later; returns without waiting.
        """
        name = "all_gather"
        send, recv = self._buffers(name, sendbuf=sendbuf, recvbuf=recvbuf)
        check.blocks(name, send, recv, self.world_size, recv_is_large=True)
        in_place = check.in_place(name, self.rank, send, recv,
                                  recv.block(self.rank, send.count), send)
        self._submit(name, self._shape(name, send, in_place=in_place), send, recv, stream)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = "sum", *,
                       scale: Optional[float] = None, stream: Any = None) -> None:
        """``recvbuf = op over ranks r of sendbuf_r[rank*count:(rank+1)*count]``.

        In place when ``recvbuf`` is this rank's own block of ``sendbuf``.  Reductions
        run on at most ``max_sms`` SMs, overlapped with the copies.  ``scale`` (a sum of
        floats only; every rank passes the same): the sum times ``scale``, multiplied by
        the reduction kernel before it rounds (torch's PREMUL_SUM, with no pass of its own).
        """
        name = "reduce_scatter"
        send, recv = self._buffers(name, sendbuf=sendbuf, recvbuf=recvbuf)
        op = check.reduce_op(name, op)
        factor = check.scale(name, scale, op, recv.dtype)
        check.blocks(name, send, recv, self.world_size, recv_is_large=False)
        in_place = check.in_place(name, self.rank, send, recv,
                                  send.block(self.rank, recv.count), recv)
        self._submit(name, self._shape(name, recv, op=op, in_place=in_place, scale=factor),
                     send, recv, stream)

    def all_reduce(self, sendbuf: Any, recvbuf: Any, op: Any = "sum", *,
                   scale: Optional[float] = None, stream: Any = None) -> None:
        """``recvbuf = op over ranks of sendbuf`` on every rank.  In place when they are one
        buffer.  ``scale``: as for ``reduce_scatter``."""
        name = "all_reduce"
        send, recv = self._buffers(name, sendbuf=sendbuf, recvbuf=recvbuf)
        op = check.reduce_op(name, op)
        factor = check.scale(name, scale, op, send.dtype)
        check.same_shape(name, send, recv)
        in_place = check.in_place(name, self.rank, send, recv, recv, send)
        self._submit(name, self._shape(name, send, op=op, in_place=in_place, scale=factor),
                     send, recv, stream)

    def all_to_all(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:
        """Block j of rank i's ``sendbuf`` goes to block i of rank j's ``recvbuf``."""
        name = "all_to_all"
        send, recv = self._buffers(name, sendbuf=sendbuf, recvbuf=recvbuf)
        check.same_shape(name, send, recv)
        if send.count % self.world_size:
            raise InvalidArgumentError(f"{name}: sendbuf.size must be a multiple of world_size "
                                       f"{self.world_size}; got {send.count}")
        check.disjoint(name, send, recv)
        self._submit(name, self._shape(name, send, count=send.count // self.world_size),
                     send, recv, stream)

    def broadcast(self, sendbuf: Any, recvbuf: Any, root: int, *, stream: Any = None) -> None:
        """Every rank's ``recvbuf`` = root's ``sendbuf`` (``sendbuf`` is ignored off the root
        and may be None).  In place when ``sendbuf is recvbuf`` on the root."""
        name = "broadcast"
        root = check.rank(name, "root", root, self.world_size)
        is_root = self.rank == root
        send, recv = self._buffers(name, sendbuf=sendbuf if is_root else None, recvbuf=recvbuf,
                                   optional=() if is_root else ("sendbuf",))
        in_place = False  # only the root knows; the plans of other ranks do not depend on it
        if is_root:
            check.same_shape(name, send, recv)
            in_place = check.in_place(name, self.rank, send, recv, recv, send)
        self._submit(name, self._shape(name, recv, root=root, in_place=in_place), send, recv,
                     stream)

    def reduce(self, sendbuf: Any, recvbuf: Any, root: int, op: Any = "sum", *,
               scale: Optional[float] = None, stream: Any = None) -> None:
        """Root's ``recvbuf`` = op over ranks of ``sendbuf`` (``recvbuf`` may be None
        elsewhere).  ``scale``: as for ``reduce_scatter``."""
        name = "reduce"
        root = check.rank(name, "root", root, self.world_size)
        op = check.reduce_op(name, op)
        is_root = self.rank == root
        send, recv = self._buffers(name, sendbuf=sendbuf, recvbuf=recvbuf if is_root else None,
                                   optional=() if is_root else ("recvbuf",))
        in_place = False
        if is_root:
            check.same_shape(name, send, recv)
            in_place = check.in_place(name, self.rank, send, recv, recv, send)
        factor = check.scale(name, scale, op, send.dtype)
        self._submit(name, self._shape(name, send, op=op, root=root, in_place=in_place,
                                       scale=factor), send, recv, stream)

    def gather(self, sendbuf: Any, recvbuf: Any, root: int, *, stream: Any = None) -> None:
        """Root's ``recvbuf[r*count:(r+1)*count]`` = rank r's ``sendbuf`` (``recvbuf`` may be
        None off the root).  In place when the root's ``sendbuf`` is its own block of
        ``recvbuf``."""
        self._rooted_blocks("gather", sendbuf, recvbuf, root, stream)

    def scatter(self, sendbuf: Any, recvbuf: Any, root: int, *, stream: Any = None) -> None:
        """Rank r's ``recvbuf`` = root's ``sendbuf[r*count:(r+1)*count]`` (``sendbuf`` may be
        None off the root).  In place when the root's ``recvbuf`` is its own block of
        ``sendbuf``."""
        self._rooted_blocks("scatter", sendbuf, recvbuf, root, stream)

    def _rooted_blocks(self, name: str, sendbuf: Any, recvbuf: Any, root: int,
                       stream: Any) -> None:
        """gather and scatter: the root's large buffer holds world_size blocks of the size
        of every rank's small one (send for gather, receive for scatter)."""
        root = check.rank(name, "root", root, self.world_size)
        is_root = self.rank == root
        gathers = name == "gather"
        large_name = "recvbuf" if gathers else "sendbuf"  # None is allowed for it off the root
        send, recv = self._buffers(name, sendbuf=sendbuf if is_root or gathers else None,
                                   recvbuf=recvbuf if is_root or not gathers else None,
                                   optional=() if is_root else (large_name,))
        small, large = (send, recv) if gathers else (recv, send)
        in_place = False
        if is_root:
            check.blocks(name, send, recv, self.world_size, recv_is_large=gathers,
                         whose="the root's ")
            in_place = check.in_place(name, self.rank, send, recv,
                                      large.block(root, small.count), small)
        self._submit(name, self._shape(name, small, root=root, in_place=in_place), send, recv,
                     stream)

    def send(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        """Send ``buf`` to ``peer``, which must call ``recv`` with a buffer of the same size.

        Without ``hoccl.group()`` the call may wait on the host until ``peer`` makes its
        ``recv`` (the ranks swap buffer descriptors); a cycle of sends must be grouped."""
        self._pair("send", buf, peer, stream)

    def recv(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        """Receive into ``buf`` what ``peer`` sends with ``send``."""
        self._pair("recv", buf, peer, stream)

    def barrier(self, *, stream: Any = None) -> None:
        """Work enqueued on ``stream`` after the barrier starts only after every rank's
        stream reached its barrier.  Zero SMs, no data."""
        self._usable("barrier")
        self._enter("barrier", Shape("barrier", self.world_size, 0), {}, stream)

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
        if _held_calls() is not None:
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
        if _held_calls() is not None:
            raise InvalidArgumentError("deregister: not inside hoccl.group()")
        engine = self._engine
        found, verdict = self._window_of(window), None
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

    def _window_of(self, window: Any) -> Any:
        windows = self._engine.windows
        if isinstance(window, Window):
            return window if windows.get(window.index) is window else None
        try:
            buffer = as_buffer("deregister", "window", window, writable=False, reduction=False)
        except InvalidArgumentError:
            return None
        found = windows.find(buffer.address, max(buffer.nbytes, 1))
        if found is None or found[1] or found[0].nbytes != buffer.nbytes:
            return None
        return found[0]

    # -- host side ---------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block until all work this communicator enqueued has finished.

        After ``timeout`` seconds it aborts the communicator (so no stream stays blocked)
        and raises HocclTimeoutError naming the call, its number and the peers whose
        signals never came.  With ``init_local`` it raises at once if a call is held
        because other ranks have not made it yet.
        """
        self._usable("synchronize")
        held = self._engine.held()
        if held:
            call = held[0]
            closed = self._group.closed_peer([call])
            raise HocclTimeoutError(
                f"synchronize: rank {self.rank}'s {call.name} (call {call.key}) cannot run: "
                f"ranks {self._group.waiting_for(call)} have not made the matching call yet"
                + (f" ({closed}: it never will)" if closed else
                   "; with init_local make every rank's call before synchronizing"))
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
        """How many calls (collectives, send, recv, barrier) this rank has made so far: a
        mark for ``finished``."""
        return self._engine.calls

    def finished(self, mark: int) -> bool:
        """Whether every call this rank made up to ``mark`` (a value of ``calls``) has
        finished on the device.  Never blocks; raises AbortedError after an abort."""
        engine = self._engine
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
        if mark > engine.calls:
            raise InvalidArgumentError(f"order_after: mark {mark} is past this rank's "
                                       f"{engine.calls} calls so far")
        if mark <= 0:
            return
        engine.device.activate()
        caller = engine.device.resolve_stream(stream, ())
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
        if _held_calls() is not None:
            raise InvalidArgumentError("split: not inside hoccl.group(); split before or after")
        if self._splitter is None:
            raise InvalidArgumentError("split: this communicator was not made by hoccl.init "
                                       "and cannot split")
        given = {name: value for name, value in dict(
            options, timeout=timeout, verify_plans=verify_plans, max_sms=max_sms,
            copy_sms=copy_sms).items() if value is not None}
        return self._splitter(self, color, key, given)

    def set_options(self, **changes: Any) -> None:
        """Change settings (fields of ``hoccl.Config``) for later calls; the rest stay.
        Every change is checked before any takes effect."""
        self._usable("set_options")
        engine = self._engine
        old = self.config
        config = old.replace("set_options", **changes)
        with engine.lock:
            engine.sms.max_sms = config.max_sms
            engine.sms.copy_sms = config.copy_sms or engine.sms.copy_sms
            if config.fuse_sums != old.fuse_sums:
                engine.sms.fuse_sums = bool(config.fuse_sums)
                engine.forget_programs()  # bound programs hold the fused launches, or not
            engine.verify_plans = config.verify_plans
            if config.plan_options != engine.options or config.given != engine.given:
                engine.options = config.plan_options  # a new object: templates are remade
                engine.given = config.given
            self._health.timeout = config.timeout

    def close(self) -> None:
        """Wait for outstanding work (aborting it after ``timeout``), then release streams,
        events, pads, mappings, peer access and the device.  Idempotent."""
        engine = self._engine
        if engine.closed:
            return
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
        with engine.lock:
            engine.closed = True
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

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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

    def _buffers(self, name: str, optional: Tuple[str, ...] = (),
                 **arrays: Any) -> List[Buffer]:
        """Resolve each array (None only where ``optional``; then None is returned)."""
        self._usable(name)
        resolved: List[Any] = []
        for argument, array in arrays.items():
            if array is None:
                if argument in optional:
                    resolved.append(None)
                    continue
                raise InvalidArgumentError(f"{name}: {argument} is required on rank "
                                           f"{self.rank}; got None")
            buffer = as_buffer(name, argument, array,
                               writable=argument == "recvbuf" or name == "recv",
                               reduction=name in ("all_reduce", "reduce_scatter", "reduce"))
            check.on_device(name, argument, buffer, self.backend, self.device)
            resolved.append(buffer)
        return resolved

    def _shape(self, name: str, buffer: Buffer, count: Optional[int] = None, **fields: Any
               ) -> Shape:
        return Shape(name, self.world_size, buffer.count if count is None else count,
                     buffer.dtype, buffer.itemsize, **fields)

    def _pair(self, name: str, buf: Any, peer: int, stream: Any) -> None:
        (buffer,) = self._buffers(name, buf=buf)
        peer = check.rank(name, "peer", peer, self.world_size, other_than=self.rank)
        sender, receiver = (self.rank, peer) if name == "send" else (peer, self.rank)
        shape = Shape("sendrecv", self.world_size, buffer.count, buffer.dtype, buffer.itemsize,
                      root=sender, peer=receiver)
        self._enter(name, shape, {name: buffer}, stream)

    def _submit(self, name: str, shape: Shape, send: Optional[Buffer], recv: Optional[Buffer],
                stream: Any) -> None:
        self._enter(name, shape, {"send": send, "recv": recv}, stream)

    def _enter(self, name: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
               stream: Any) -> None:
        """Prepare (may fail: nothing enqueued), enqueue (the caller's stream is fenced),
        then hand to the group — now, or at the end of the enclosing ``hoccl.group()``."""
        engine = self._engine
        if self._group.exported and _held_calls() is None:
            repeated = engine.repeat(name, shape, buffers, stream)
            if repeated is not None:  # issued at once, as the first one was
                try:
                    self._group.repeat(repeated)
                except HocclError as error:  # an earlier call's check: nothing to match up
                    self._fail([repeated], error)
                    raise
                self._health.start_watchdog()
                return
        call = engine.prepare(name, shape, buffers, stream, exported=self._group.exported)
        self._usable(name)  # the watchdog may have aborted meanwhile
        held = _held_calls()
        if call.captured and held is not None:
            raise InvalidArgumentError(f"{name}: a call captured into a CUDA graph cannot be "
                                       f"inside hoccl.group() yet")
        # across processes the call returns only once issued: its caller is fenced then,
        # after the peers' buffers are mapped (``Engine.issue``), or, a direct kernel's
        # call or an eager one-lane plan's, its steps are enqueued on the caller's stream
        # itself (a captured direct kernel: one node of the graph); in one process the
        # call is held until every rank made it, so its caller is fenced now
        if held is None and self._group.exported and (
                call.plan.kernel_blocks or (call.plan.lanes == 1 and not call.captured)):
            call.on_caller = True
        engine.enqueue(call, fence=held is None and not self._group.exported)
        self._health.start_watchdog()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d %s %s key=%s", self.rank, name, shape, call.key)
        if held is not None:
            held.append((self, call))
            return
        self._hand_over_phased([(self, [call])])

    @staticmethod
    def _hand_over_phased(batches: Sequence[Tuple["Communicator", List[Call]]]) -> None:
        """Offer every batch to its group, then complete each: no batch's completion can
        wait for a peer's offer that is queued behind it.  A mismatch has already
        released the calls (the callers' streams go on, the outputs are not written) and
        the communicator stays usable; any other failure aborts it."""
        failures: List[BaseException] = []

        def attempt(comm: "Communicator", step: Callable[[List[Call]], None],
                    calls: List[Call]) -> bool:
            try:
                step(calls)
                return True
            except BaseException as error:
                # a plain mismatch released the calls; a divergence (an earlier registered
                # call ran differently) or anything else leaves nothing to match up
                if isinstance(error, DivergedError) or not isinstance(error, MismatchError):
                    comm._fail(calls, error)
                failures.append(error)
                return False
        posted = [(comm, calls) for comm, calls in batches
                  if attempt(comm, comm._group.post, calls)]
        for comm, calls in posted:
            attempt(comm, comm._group.complete, calls)
        if failures:
            raise failures[0]

    def _fail(self, calls: List[Call], error: BaseException) -> None:
        """The peers never answered: nothing can be matched up any more."""
        reason = str(error)
        if not reason.startswith(calls[0].name + ":"):
            reason = f"{calls[0].name}: rank {self.rank}: {reason}"
        if isinstance(error, PeerDeadError):  # later calls say the peer is gone, too
            self._health.abort_for_lost_peer(reason, type(error))
        else:
            self._health.abort(reason)


# -- hoccl.group() ------------------------------------------------------------------------
_GROUPS = threading.local()


def _held_calls() -> Optional[List[Tuple[Communicator, Call]]]:
    return getattr(_GROUPS, "calls", None) if getattr(_GROUPS, "depth", 0) else None


def group_start() -> None:
    """Begin a group (nestable): calls made on this thread until the matching
    ``group_end`` are held, then matched with their peers together."""
    depth = getattr(_GROUPS, "depth", 0)
    if depth == 0:
        _GROUPS.calls = []
    _GROUPS.depth = depth + 1


def group_end() -> None:
    """End a group; the outermost end hands every held call over.

    Each communicator's held calls go to the device side by side (they do not wait for
    each other), so a ring of send/recv, or one thread driving several ranks'
    calls (``init_local``), cannot deadlock.  Errors (a mismatch, a timeout) are raised
    here."""
    depth = getattr(_GROUPS, "depth", 0)
    if depth == 0:
        raise InvalidArgumentError("group_end: no group_start on this thread")
    _GROUPS.depth = depth - 1
    if depth > 1:
        return
    held, _GROUPS.calls = _GROUPS.calls, []
    batches: Dict[int, Tuple[Communicator, List[Call]]] = {}
    for comm, call in held:
        batches.setdefault(id(comm), (comm, []))[1].append(call)
    for comm, calls in batches.values():
        if not comm._group.exported:  # a process group fences them as it issues them
            comm._engine.fence_callers(calls)
    if batches:
        Communicator._hand_over_phased(list(batches.values()))


@contextlib.contextmanager
def group() -> Iterator[None]:
    """``with hoccl.group(): ...`` — ``group_start()`` ... ``group_end()``.

    If the body raises, the calls it made are offered to their peers as abandoned: every
    participant's matching call is completed unrun (outputs not written, callers'
    streams released; the peers get MismatchError naming the abandoned call), so the
    ranks' sequences of calls stay aligned; then the body's error propagates.
    """
    group_start()
    try:
        yield
    except BaseException:
        _GROUPS.depth -= 1
        if _GROUPS.depth == 0:
            held, _GROUPS.calls = _GROUPS.calls, []
            for _, call in held:
                call.signature = _ABANDONED
            _GROUPS.depth, _GROUPS.calls = 1, held
            try:
                group_end()
            except MismatchError:
                pass  # expected: the peers disagree with an abandoned call
            except HocclError as error:
                log.warning("group: handing over the abandoned calls failed: %s", error)
        raise
    group_end()


_ABANDONED = (("abandoned", "the body of its hoccl.group() raised"),)


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
