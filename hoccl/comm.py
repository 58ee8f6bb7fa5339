"""The Communicator: validate, resolve buffers and stream, plan, hand over to the executor."""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Tuple

from ._buffers import Buffer, as_buffer
from ._dtypes import ITEMSIZE
from ._errors import (AbortedError, HocclError, HocclTimeoutError, InvalidArgumentError,
                      MismatchError)
from .backends._base import OPS
from .p2p import Executor
from .sched import Options, Shape, build_plan, verify
from .sched.plan import CHANNELS, Plan, Wait
from .streams import StreamManager

__all__ = ["Communicator", "ReduceOp", "POISON"]

log = logging.getLogger("hoccl")

#: written into signal pads by ``abort``: larger than any value a collective waits for,
#: so every stream-side wait is released; seeing it in a pad means "aborted".
POISON = 1 << 62
_CHANNEL_NAMES = ("READY", "DONE", "GATHERED", "P2P_READY", "P2P_DONE")
_OPEN: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
#: how long close waits, after an abort, for caller streams to reach their calls
_DRAIN_SECONDS = 10.0
_KEPT: List[Any] = []  # buffers of calls still queued behind a stuck stream at close


class ReduceOp:
    """Reduction operators (strings are accepted too)."""
    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    AVG = "avg"


@dataclass
class _Op:
    """One call of one rank, from submission to issue."""
    call: str
    plan: Plan
    key: tuple
    local: Dict[str, Any]      # buffer name -> address on this rank
    value: int                 # this rank's call number: its entry and completion value
    signature: tuple
    keepalive: Tuple[Any, ...] = ()
    issued: bool = False
    base: int = 0              # the signal base it was issued with
    entry: Any = None          # event marking the caller's position at call time
    issued_at: float = 0.0     # when its steps were enqueued (the watchdog's clock)


class Communicator:
    """One rank of a group.  Create with ``hoccl.init`` or ``hoccl.init_local``."""

    def __init__(self, *, rank: int, world_size: int, device: Any, group: Any,
                 options: Options, timeout: float, check: bool, verify_plans: bool):
        self.rank = rank
        self.world_size = world_size
        self.device_handle = device
        self.backend = device.backend
        self.device = device.ordinal
        self.options = options
        self.timeout = timeout
        self.check = check
        self.verify_plans = verify_plans
        self._group = group
        self._pad = device.alloc_pad(world_size * CHANNELS + 1)
        self._host_word = device.alloc_host_word()
        self._completion = self._pad + 8 * world_size * CHANNELS
        self._streams = StreamManager(device, self._completion, self._host_word.address)
        self._executor: Optional[Executor] = None
        self._ops = 0               # completion value of the latest submitted op
        self._collectives = 0       # collectives submitted (matching key across ranks)
        self._pair_calls: Dict[Tuple[int, int], int] = {}
        self._signal_base = 0
        self._pair_base: Dict[Tuple[int, int], int] = {}
        self._scratch: Tuple[Any, int] = (None, 0)
        self._retired: List[Any] = []
        self._inflight: Deque[_Op] = collections.deque()  # submitted, in call order
        self._closed = False
        self._aborted = False
        self._abort_reason = ""
        self._lock = threading.RLock()
        self._watchdog: Optional[threading.Thread] = None
        self._pump: Optional[threading.Thread] = None  # re-poisons after an abort
        self._stop = threading.Event()
        self._pads: List[Any] = []
        _OPEN.add(self)

    # -- wiring (called by init) -----------------------------------------------------------
    def _connect(self, pads: List[Any]) -> None:
        self._pads = list(pads)
        self._executor = Executor(self.rank, self.device_handle, self._streams, pads)

    @property
    def pad_address(self) -> Any:
        return self._pad

    # -- public collectives ----------------------------------------------------------------
    def all_gather(self, sendbuf, recvbuf, *, stream=None) -> None:
        """``recvbuf[r*count:(r+1)*count] = sendbuf of rank r`` for every rank r.

        Naive equivalent: ``recv = concatenate([send_of(r) for r in range(world_size)])``.
        In place when ``sendbuf`` is this rank's own block of ``recvbuf`` (no copy of
        the own block at all).  Ordered after the work already on ``stream`` and before
        the work enqueued on it later; returns without waiting.
        """
        call = "all_gather"
        send, recv = self._buffers(call, sendbuf=sendbuf, recvbuf=recvbuf)
        self._blocks(call, send, recv, recv_is_large=True)
        in_place = self._in_place(call, send, recv, recv.block(self.rank, send.count), send)
        self._submit(call, Shape(call, self.world_size, send.count, send.dtype,
                                 ITEMSIZE[send.dtype], in_place=in_place),
                     {"send": send, "recv": recv}, stream)

    def reduce_scatter(self, sendbuf, recvbuf, op="sum", *, stream=None) -> None:
        """``recvbuf = op over ranks r of sendbuf_r[rank*count:(rank+1)*count]``.

        In place when ``recvbuf`` is this rank's own block of ``sendbuf``.  Reductions
        run on at most ``max_sms`` SMs, overlapped with the copies.
        """
        call = "reduce_scatter"
        send, recv = self._buffers(call, sendbuf=sendbuf, recvbuf=recvbuf)
        op = self._op(call, op)
        self._blocks(call, send, recv, recv_is_large=False)
        in_place = self._in_place(call, send, recv, send.block(self.rank, recv.count), recv)
        self._submit(call, Shape(call, self.world_size, recv.count, recv.dtype,
                                 ITEMSIZE[recv.dtype], op=op, in_place=in_place),
                     {"send": send, "recv": recv}, stream)

    def all_reduce(self, sendbuf, recvbuf, op="sum", *, stream=None) -> None:
        """``recvbuf = op over ranks of sendbuf`` on every rank.  In place when they are one buffer."""
        call = "all_reduce"
        send, recv = self._buffers(call, sendbuf=sendbuf, recvbuf=recvbuf)
        op = self._op(call, op)
        self._same_shape(call, send, recv)
        in_place = self._in_place(call, send, recv, recv, send)
        self._submit(call, Shape(call, self.world_size, send.count, send.dtype,
                                 ITEMSIZE[send.dtype], op=op, in_place=in_place),
                     {"send": send, "recv": recv}, stream)

    def all_to_all(self, sendbuf, recvbuf, *, stream=None) -> None:
        """Block j of rank i's ``sendbuf`` goes to block i of rank j's ``recvbuf``."""
        call = "all_to_all"
        send, recv = self._buffers(call, sendbuf=sendbuf, recvbuf=recvbuf)
        self._same_shape(call, send, recv)
        if send.count % self.world_size:
            raise InvalidArgumentError(f"{call}: sendbuf.size must be a multiple of world_size "
                                       f"{self.world_size}; got {send.count}")
        self._disjoint(call, send, recv)
        count = send.count // self.world_size
        self._submit(call, Shape(call, self.world_size, count, send.dtype, ITEMSIZE[send.dtype]),
                     {"send": send, "recv": recv}, stream)

    def broadcast(self, sendbuf, recvbuf, root, *, stream=None) -> None:
        """Every rank's ``recvbuf`` = root's ``sendbuf`` (``sendbuf`` is ignored off the root
        and may be None).  In place when ``sendbuf is recvbuf`` on the root."""
        call = "broadcast"
        root = self._root(call, root)
        is_root = self.rank == root
        send, recv = self._buffers(call, sendbuf=sendbuf if is_root else None, recvbuf=recvbuf,
                                   optional=() if is_root else ("sendbuf",))
        in_place = False  # only the root knows; the plans of other ranks do not depend on it
        if is_root:
            self._same_shape(call, send, recv)
            in_place = self._in_place(call, send, recv, recv, send)
        self._submit(call, Shape(call, self.world_size, recv.count, recv.dtype,
                                 ITEMSIZE[recv.dtype], root=root, in_place=in_place),
                     {"send": send, "recv": recv}, stream)

    def reduce(self, sendbuf, recvbuf, root, op="sum", *, stream=None) -> None:
        """Root's ``recvbuf`` = op over ranks of ``sendbuf`` (``recvbuf`` may be None elsewhere)."""
        call = "reduce"
        root = self._root(call, root)
        op = self._op(call, op)
        is_root = self.rank == root
        send, recv = self._buffers(call, sendbuf=sendbuf, recvbuf=recvbuf if is_root else None,
                                   optional=() if is_root else ("recvbuf",))
        in_place = False
        if is_root:
            self._same_shape(call, send, recv)
            in_place = self._in_place(call, send, recv, recv, send)
        self._submit(call, Shape(call, self.world_size, send.count, send.dtype,
                                 ITEMSIZE[send.dtype], op=op, root=root,
                                 in_place=in_place),
                     {"send": send, "recv": recv}, stream)

    def gather(self, sendbuf, recvbuf, root, *, stream=None) -> None:
        """Root's ``recvbuf[r*count:(r+1)*count]`` = rank r's ``sendbuf`` (``recvbuf`` may be
        None off the root).  In place when the root's ``sendbuf`` is its own block of
        ``recvbuf``."""
        self._rooted_blocks("gather", sendbuf, recvbuf, root, stream)

    def scatter(self, sendbuf, recvbuf, root, *, stream=None) -> None:
        """Rank r's ``recvbuf`` = root's ``sendbuf[r*count:(r+1)*count]`` (``sendbuf`` may be
        None off the root).  In place when the root's ``recvbuf`` is its own block of
        ``sendbuf``."""
        self._rooted_blocks("scatter", sendbuf, recvbuf, root, stream)

    def _rooted_blocks(self, call: str, sendbuf, recvbuf, root, stream) -> None:
        """gather and scatter: the root's large buffer holds world_size blocks of the size
        of every rank's small one (send for gather, receive for scatter)."""
        root = self._root(call, root)
        is_root = self.rank == root
        gather = call == "gather"
        large_name = "recvbuf" if gather else "sendbuf"  # None is allowed for it off the root
        send, recv = self._buffers(call, sendbuf=sendbuf if is_root or gather else None,
                                   recvbuf=recvbuf if is_root or not gather else None,
                                   optional=() if is_root else (large_name,))
        small, large = (send, recv) if gather else (recv, send)
        in_place = False
        if is_root:
            self._blocks(call, send, recv, recv_is_large=gather, whose="the root's ")
            in_place = self._in_place(call, send, recv, large.block(root, small.count), small)
        self._submit(call, Shape(call, self.world_size, small.count, small.dtype,
                                 ITEMSIZE[small.dtype], root=root, in_place=in_place),
                     {"send": send, "recv": recv}, stream)

    def send(self, buf, peer, *, stream=None) -> None:
        """Send ``buf`` to ``peer``, which must call ``recv`` with a buffer of the same size."""
        self._p2p("send", buf, peer, stream)

    def recv(self, buf, peer, *, stream=None) -> None:
        """Receive into ``buf`` what ``peer`` sends with ``send``."""
        self._p2p("recv", buf, peer, stream)

    def barrier(self, *, stream=None) -> None:
        """Work enqueued on ``stream`` after the barrier starts only after every rank's
        stream reached its barrier.  Zero SMs, no data."""
        self._submit("barrier", Shape("barrier", self.world_size, 0), {}, stream)

    # -- host side ---------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block until all work this communicator enqueued has finished.

        After ``timeout`` seconds it aborts the communicator (so no stream stays blocked)
        and raises HocclTimeoutError naming the call, its number and the peers whose
        signals never came.
        """
        self._usable("synchronize")
        with self._lock:
            target = self._ops
            not_issued = [op for op in self._inflight if not op.issued]
        if not_issued:
            op = not_issued[0]
            waiting = self._group.waiting_for(op)  # only init_local holds calls unissued
            raise HocclTimeoutError(
                f"synchronize: rank {self.rank}'s {op.call} (call {op.key}) cannot run: ranks "
                f"{waiting} have not made the matching call yet; with init_local make every "
                f"rank's call before synchronizing")
        deadline = time.monotonic() + self.timeout
        delay = 0.0
        while self._host_word.value < target:
            if self._aborted or self.device_handle.failure():
                break
            if time.monotonic() > deadline:
                reason = self._diagnose("synchronize")
                self.abort(reason)
                raise HocclTimeoutError(reason)
            time.sleep(delay)
            delay = min(delay * 2 + 2e-6, 1e-3)
        self._check_health("synchronize")
        with self._lock:
            for op in self._inflight:
                self._retire(op)
            self._inflight.clear()
            self.device_handle.activate()
            for address in self._retired:
                self.device_handle.free(address)
            self._retired.clear()

    @property
    def calls(self) -> int:
        """How many calls (collectives, send, recv, barrier) this rank has made so far: a
        mark for ``finished``."""
        return self._ops

    def finished(self, mark: int) -> bool:
        """Whether every call this rank made up to ``mark`` (a value of ``calls``) has
        finished on the device.  Never blocks; raises AbortedError after an abort."""
        if self._aborted:
            raise AbortedError(f"finished: the communicator was aborted: {self._abort_reason}")
        return self._closed or self._host_word.value >= mark

    def abort(self, reason: str = "") -> None:
        """Release every stream-side wait of this communicator and make later calls raise.

        Poison values go into this rank's signal pad, entry and completion words (so its
        lanes and the callers' streams run on) and into the slots this rank signals in
        every peer's pad (so the peers' waits on it are released and they learn of the
        abort).  Outputs of unfinished calls are undefined.  The GPU stays usable and a
        new communicator can be created.  Idempotent.  The other ranks of this process
        (``init_local``) share the abort; they are marked aborted before this one, so a
        thread that sees this rank aborted finds them aborted too.
        """
        reason = reason or f"rank {self.rank}: abort() was called"
        marked = [comm for comm in self._group.siblings(self) + [self]
                  if comm._mark_aborted(reason)]
        for comm in marked:
            comm._release_waits()
        if marked:
            self._group.forget_calls()

    def _mark_aborted(self, reason: str) -> bool:
        """Make later calls raise; False if this rank was already aborted or closed."""
        with self._lock:
            if self._aborted or self._closed:
                return False
            self._aborted = True
            self._abort_reason = reason
            return True

    def _release_waits(self) -> None:
        log.warning("rank %d aborting: %s", self.rank, self._abort_reason)
        try:
            self.device_handle.activate()
            self.device_handle.abort()
        except HocclError as error:
            log.warning("rank %d abort: %s", self.rank, error)
        self._poison(warn=True)
        # Lanes released by the poison run on, and their signal writes (this rank's, or a
        # peer's not yet aborted) can land after it and lower a slot again: keep poisoning
        # for a while, so that no wait released once can block again.
        pump = threading.Thread(target=self._keep_poisoning, daemon=True,
                                name=f"hoccl-abort-{self.rank}")
        pump.start()
        self._pump = pump

    def _poison(self, warn: bool) -> None:
        """POISON into this rank's pad, completion and host words, and into the slots it
        signals in every peer's pad (best effort: a dead peer's memory may be gone)."""
        device = self.device_handle
        own = [(self._pad + 8 * slot, POISON) for slot in range(self.world_size * CHANNELS + 1)]
        own.append((self._host_word.address, POISON))
        try:
            device.poke(own)
        except HocclError as error:
            if warn:
                log.warning("rank %d abort: could not poison its own pad: %s", self.rank, error)
        for peer, pad in enumerate(self._pads):
            if peer == self.rank:
                continue
            try:
                device.poke([(pad + 8 * (self.rank * CHANNELS + channel), POISON)
                             for channel in range(CHANNELS)])
            except HocclError as error:
                if warn:
                    log.warning("rank %d abort: could not release peer %d: %s", self.rank,
                                peer, error)

    def _keep_poisoning(self) -> None:
        """After an abort: poison again every 50 ms until close (at most ``timeout``)."""
        deadline = time.monotonic() + self.timeout
        try:
            self.device_handle.activate()
            while not self._stop.wait(0.05) and time.monotonic() < deadline:
                with self._lock:
                    if self._closed:
                        return
                    self._poison(warn=False)
        except Exception as error:  # a helper thread must not die loudly at exit
            log.debug("rank %d abort pump stopped: %r", self.rank, error)

    def _diagnose(self, call: str) -> str:
        """What the oldest unfinished call is waiting for, read from this rank's pad."""
        with self._lock:
            pending = [op for op in self._inflight if op.value > self._host_word.value]
        if not pending:
            return f"{call}: rank {self.rank} timed out after {self.timeout:g} s"
        op = pending[0]
        head = (f"{call}: rank {self.rank}'s {op.call} (call {op.value} on this rank, "
                f"{'collective' if op.key[0] == 'coll' else 'pair'} sequence {op.key[1:]}) "
                f"did not finish within {self.timeout:g} s")
        try:
            words = self.device_handle.peek(self._pad, self.world_size * CHANNELS)
        except HocclError as error:
            return f"{head}; the signal pad could not be read: {error}"
        aborted = sorted({slot // CHANNELS for slot, word in enumerate(words) if word >= POISON})
        if aborted:
            return f"{head}: {', '.join(f'rank {r}' for r in aborted)} aborted the communicator"
        missing = []
        for step in op.plan.programs[self.rank]:
            if isinstance(step, Wait) and words[step.slot] < op.base + step.value:
                peer, channel = divmod(step.slot, CHANNELS)
                missing.append(f"rank {peer} {_CHANNEL_NAMES[channel]} (have "
                               f"{words[step.slot]}, need {op.base + step.value})")
        if not missing:
            return (f"{head}: every signal from the peers arrived; the caller's stream never "
                    f"reached the call (work enqueued on it earlier is stuck), or the copies "
                    f"or reductions did not finish")
        peers = sorted({int(text.split()[1]) for text in missing})
        return f"{head}: signals missing from peers {peers}: " + "; ".join(missing)

    def _check_health(self, call: str) -> None:
        failure = self.device_handle.failure()
        if failure and not self._aborted:
            self.abort(f"{call}: rank {self.rank}: device work failed: {failure}")
        if self._aborted:
            raise AbortedError(f"{call}: the communicator was aborted: {self._abort_reason}")
        poisoned = self._peer_abort()
        if poisoned is not None:
            self.abort(f"{call}: rank {self.rank}: rank {poisoned} aborted the communicator")
            raise AbortedError(f"{call}: the communicator was aborted: {self._abort_reason}")

    def _peer_abort(self) -> Optional[int]:
        """The peer that poisoned this rank's pad, if one did."""
        try:
            words = self.device_handle.peek(self._pad, self.world_size * CHANNELS)
        except HocclError:
            return None
        for slot, word in enumerate(words):
            if word >= POISON:
                return slot // CHANNELS
        return None

    def _watch(self) -> None:
        """The watchdog: aborts when the oldest issued call outlives the timeout, or a
        peer aborted, without anyone calling synchronize."""
        period = max(0.05, min(1.0, self.timeout / 10))
        while not self._stop.wait(period):
            with self._lock:
                if self._closed or self._aborted:
                    return
                done = self._host_word.value
                pending = [op for op in self._inflight if op.issued and op.value > done]
            if not pending:
                continue
            try:
                self.device_handle.activate()
                failure = self.device_handle.failure()
                if failure:
                    self.abort(f"watchdog: rank {self.rank}: device work failed: {failure}")
                    return
                # a peer's abort first: its poison would read as signals that arrived
                peer = self._peer_abort()
                if peer is not None:
                    op = pending[0]
                    self.abort(f"watchdog: rank {self.rank}'s {op.call} (call {op.value}): rank "
                               f"{peer} aborted the communicator")
                    return
                # measured from issue, not from the call: with init_local a call may wait
                # for the other ranks' calls for as long as the user likes
                if time.monotonic() - pending[0].issued_at > self.timeout:
                    self.abort("watchdog: " + self._diagnose("watchdog"))
                    return
            except Exception as error:  # the watchdog must never die silently
                log.error("rank %d watchdog: %r", self.rank, error)
                return

    def set_options(self, **changes) -> None:
        """Change options for later calls: ``self_route``, ``chunk_bytes``, ``copy_lanes``
        (planning), ``max_sms`` (the SM cap of reductions) and ``copy_sms`` (the SM cap
        of the one same-GPU copy of out-of-place forms' own block)."""
        caps = {name: changes.pop(name) for name in ("max_sms", "copy_sms") if name in changes}
        options = _options(self.options, "set_options", **changes)
        for name, value in caps.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"set_options: {name} must be a positive int; "
                                           f"got {value!r}")
        for name, value in caps.items():
            setattr(self.device_handle, name, value)
        self.options = options

    def close(self) -> None:
        """Wait for outstanding work (aborting it after ``timeout``), then release streams,
        events, pads, mappings, peer access and the device.  Idempotent."""
        if self._closed:
            return
        with self._lock:
            held = [op for op in self._inflight if not op.issued]
        if held and not self._aborted:
            # init_local: calls the other ranks never made can never run; complete them
            # unrun, so that the callers' streams do not wait for them for ever
            log.warning("rank %d close: %d call(s) never ran because other ranks did not make "
                        "them (%s); their outputs are not written", self.rank, len(held),
                        ", ".join(op.call for op in held))
            for op in held:
                self._group.withdraw(self, op)
                self._release(op)
        with self._lock:
            outstanding = any(op.issued for op in self._inflight)
        if not self._aborted and outstanding:
            try:
                self.synchronize()
            except HocclError as error:
                log.warning("rank %d close: %s", self.rank, error)
        with self._lock:
            self._closed = True
            entries = [op.entry for op in self._inflight if op.entry is not None]
        self._stop.set()
        if self._pump is not None:
            self._pump.join(timeout=5)
        self.device_handle.activate()
        leak = False
        if entries or self._aborted:
            # after an abort, a caller stream held by the user's work may still reach this
            # rank's fences (and its lanes then run on): never free memory it will touch
            bound = min(self.timeout, _DRAIN_SECONDS)
            leak = not self._streams.drained(entries, bound)
            if leak:
                log.warning("rank %d close: the caller's stream of an unfinished call has not "
                            "reached it within %g s; keeping this communicator's device memory "
                            "and the call's buffers for the life of the process", self.rank,
                            bound)
                _KEPT.extend(op.keepalive for op in self._inflight)
        self._streams.close()
        self._inflight.clear()
        self._group.leave(self, leak)  # frees the device once no local peer can write to it
        _OPEN.discard(self)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<hoccl.Communicator rank {self.rank}/{self.world_size} backend={self.backend} "
                f"device={self.device}>")

    # -- internals ---------------------------------------------------------------------
    def _usable(self, call: str) -> None:
        if self._closed:
            raise InvalidArgumentError(f"{call}: the communicator is closed")
        if self._aborted:
            raise AbortedError(f"{call}: the communicator was aborted: {self._abort_reason}")

    def _buffers(self, call: str, optional: Tuple[str, ...] = (), **arrays) -> List[Optional[Buffer]]:
        self._usable(call)
        resolved = []
        for name, array in arrays.items():
            if array is None:
                if name in optional:
                    resolved.append(None)
                    continue
                raise InvalidArgumentError(f"{call}: {name} is required on rank {self.rank}; "
                                           f"got None")
            buffer = as_buffer(call, name, array)
            self._on_device(call, name, buffer)
            resolved.append(buffer)
        return resolved

    def _on_device(self, call: str, name: str, buffer: Buffer) -> None:
        if self.backend == "host":
            if buffer.device is not None:
                raise InvalidArgumentError(f"{call}: {name} is on GPU {buffer.device}, but this "
                                           f"communicator uses the host backend; pass host memory")
        elif buffer.device is None:
            raise InvalidArgumentError(f"{call}: {name} is host memory, but this communicator "
                                       f"runs on GPU {self.device}; pass a device array")
        elif buffer.device != self.device:
            raise InvalidArgumentError(f"{call}: {name} is on GPU {buffer.device}; this rank's "
                                       f"communicator runs on GPU {self.device}")

    def _same_dtype(self, call: str, send: Buffer, recv: Buffer) -> None:
        if send.dtype != recv.dtype:
            raise InvalidArgumentError(f"{call}: sendbuf and recvbuf must have one dtype; got "
                                       f"{send.dtype} and {recv.dtype}")

    def _same_shape(self, call: str, send: Buffer, recv: Buffer) -> None:
        self._same_dtype(call, send, recv)
        if send.count != recv.count:
            raise InvalidArgumentError(f"{call}: sendbuf and recvbuf must have the same number "
                                       f"of elements; got {send.count} and {recv.count}")

    def _blocks(self, call: str, send: Buffer, recv: Buffer, recv_is_large: bool,
                whose: str = "") -> None:
        """The large buffer must hold world_size blocks of the small one's size and dtype
        (all_gather and gather: recv is large; reduce_scatter and scatter: send is)."""
        self._same_dtype(call, send, recv)
        large, small = (recv, send) if recv_is_large else (send, recv)
        large_name, small_name = (("recvbuf", "sendbuf") if recv_is_large
                                  else ("sendbuf", "recvbuf"))
        if large.count != small.count * self.world_size:
            raise InvalidArgumentError(
                f"{call}: {whose}{large_name} must hold world_size * {small_name}.size = "
                f"{self.world_size} * {small.count} = {small.count * self.world_size} "
                f"elements; got {large.count}")

    @staticmethod
    def _overlaps(a: Buffer, b: Buffer) -> bool:
        return a.address < b.address + b.nbytes and b.address < a.address + a.nbytes

    def _disjoint(self, call: str, send: Buffer, recv: Buffer) -> None:
        if self._overlaps(send, recv) and send.nbytes and recv.nbytes:
            raise InvalidArgumentError(f"{call}: sendbuf and recvbuf overlap; this collective "
                                       f"has no in-place form, pass separate buffers")

    def _in_place(self, call: str, send: Buffer, recv: Buffer, own_block: Buffer,
                  inner: Buffer) -> bool:
        """True when ``inner`` (the smaller of send and recv) is exactly ``own_block`` of the
        larger one: the in-place form.  Any other overlap of send and recv is an error."""
        if inner.nbytes and inner.address == own_block.address:
            return True
        if send.nbytes and recv.nbytes and self._overlaps(send, recv):
            raise InvalidArgumentError(
                f"{call}: sendbuf and recvbuf overlap but not as the in-place form (the smaller "
                f"buffer must be exactly rank {self.rank}'s block of the larger one)")
        return False

    def _op(self, call: str, op: Any) -> str:
        name = getattr(op, "value", op)
        if isinstance(name, str) and name.lower() in OPS:
            return name.lower()
        raise InvalidArgumentError(f"{call}: op must be one of {', '.join(OPS)} or a "
                                   f"hoccl.ReduceOp member; got {op!r}")

    def _root(self, call: str, root: Any) -> int:
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.world_size:
            raise InvalidArgumentError(f"{call}: root must be a rank in [0, {self.world_size}); "
                                       f"got {root!r}")
        return root

    def _p2p(self, call: str, buf, peer, stream) -> None:
        (buffer,) = self._buffers(call, buf=buf)
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self.world_size \
                or peer == self.rank:
            raise InvalidArgumentError(f"{call}: peer must be another rank in "
                                       f"[0, {self.world_size}) other than {self.rank}; got {peer!r}")
        sender, receiver = (self.rank, peer) if call == "send" else (peer, self.rank)
        shape = Shape("sendrecv", self.world_size, buffer.count, buffer.dtype,
                      ITEMSIZE[buffer.dtype], root=sender, peer=receiver)
        name = "send" if call == "send" else "recv"
        self._submit(call, shape, {name: buffer}, stream)

    def _signature(self, shape: Shape) -> tuple:
        return (("collective", shape.collective), ("count", shape.count), ("dtype", shape.dtype),
                ("op", shape.op), ("root", shape.root), ("peer", shape.peer))

    def _plan(self, shape: Shape) -> Plan:
        plan = build_plan(shape, self.options)
        if self.verify_plans:
            _verified(plan)
        return plan

    def _submit(self, call: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
                stream: Any) -> None:
        """Everything that can fail (planning, stream resolution, scratch, exports) happens
        before the caller's stream is fenced; after that the call cannot leave it blocked."""
        plan = self._plan(shape)
        arrays = [b.owner for b in buffers.values() if b is not None]
        self.device_handle.activate()
        caller = self.device_handle.resolve_stream(stream, arrays)
        local = {}
        for spec in plan.buffers[self.rank]:
            if spec.nbytes == 0:
                continue  # a plan never addresses an empty buffer (and it may have no address)
            if spec.name == "scratch":
                local["scratch"] = self._scratch_of(spec.nbytes)
            else:
                local[spec.name] = buffers[spec.name].address
        payload = self._group.prepare(self, {name: local[name] for name in _shared(plan, self.rank)
                                             if name in local})
        if plan.pair:
            count = self._pair_calls.get(plan.pair, 0)
            key: tuple = ("p2p",) + plan.pair + (count,)
        else:
            key = ("coll", self._collectives)
        op = _Op(call, plan, key, local, self._ops + 1, self._signature(shape),
                 tuple(arrays))
        self._group.admit(self, op)  # check mode: a mismatch raises here, nothing enqueued
        self._usable(call)  # the watchdog may have aborted meanwhile
        if plan.pair:
            self._pair_calls[plan.pair] = count + 1
        else:
            self._collectives += 1
        self._ops += 1
        op.entry = self._streams.fence_in(caller, self._ops)
        done = self._host_word.value
        with self._lock:  # the watchdog reads the deque
            inflight = self._inflight
            while inflight and inflight[0].issued and inflight[0].value <= done:
                self._retire(inflight.popleft())  # finished: its buffers may go
            inflight.append(op)
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name=f"hoccl-watchdog-{self.rank}")
            self._watchdog.start()
        log.debug("rank %d %s %s key=%s", self.rank, call, shape, key)
        try:
            self._group.submit(self, op, payload)
        except MismatchError:
            # Every rank saw the same mismatch before any data moved: release our caller's
            # stream (the output was not written) and report; the communicator stays usable.
            self._release(op)
            raise
        except BaseException as error:
            # The peers never answered: nothing can be matched up any more.
            self.abort(f"{call}: rank {self.rank}: {error}")
            raise

    def _retire(self, op: _Op) -> None:
        """``op`` finished: its entry event goes back to the pool."""
        if op.entry is not None:
            self._streams.release(op.entry)
            op.entry = None

    def _release(self, op: _Op) -> None:
        """Complete ``op`` without running it: the caller's stream goes on."""
        self._streams.ensure_lanes(1)
        self.device_handle.memops(self._streams.lanes[0], self._streams.completion_writes(op.value))
        op.issued = True

    def _scratch_of(self, nbytes: int) -> Any:
        address, size = self._scratch
        if size < nbytes:
            if address is not None:
                self._retired.append(address)  # earlier ops may still use it; freed on sync
            address = self.device_handle.alloc(nbytes)
            self._scratch = (address, nbytes)
        return address

    def _issue(self, op: _Op, addresses: Dict[Tuple[int, str], Any]) -> None:
        plan = op.plan
        if plan.pair:
            base = self._pair_base.get(plan.pair, 0)
            self._pair_base[plan.pair] = base + plan.max_value
        else:
            base = self._signal_base
            self._signal_base += plan.max_value
        op.base = base
        op.issued_at = time.monotonic()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d issue %s call %d base %d lanes %d steps %d sms=%s", self.rank,
                      plan.collective, op.value, base, plan.lanes,
                      len(plan.programs[self.rank]), plan.uses_sms(self.rank))
        self._executor.issue(plan, addresses, base, op.value, op.entry)


@atexit.register
def _close_at_exit() -> None:
    """Interpreter exit: release whatever is still blocked, then close (never hang)."""
    for comm in list(_OPEN):
        try:
            if any(op.value > comm._host_word.value for op in comm._inflight):
                comm.abort("interpreter exit with unfinished work")
            comm.close()
        except Exception as error:  # exit must go on
            log.warning("rank %d exit: %r", comm.rank, error)


_SHARED: Dict[Tuple[int, int], Tuple[Plan, Tuple[str, ...]]] = {}


def _shared(plan: Plan, rank: int) -> Tuple[str, ...]:
    """``plan.shared(rank)``, computed once per plan (plans are cached per shape)."""
    entry = _SHARED.get((id(plan), rank))
    if entry is None or entry[0] is not plan:
        if len(_SHARED) > 4096:
            _SHARED.clear()
        entry = _SHARED[(id(plan), rank)] = (plan, plan.shared(rank))
    return entry[1]


_VERIFIED: Dict[int, Plan] = {}


def _verified(plan: Plan) -> None:
    if id(plan) not in _VERIFIED:
        verify(plan)
        _VERIFIED[id(plan)] = plan


def _options(base: Options, call: str, **changes) -> Options:
    allowed = {"self_route", "chunk_bytes", "copy_lanes"}
    unknown = set(changes) - allowed
    if unknown:
        raise InvalidArgumentError(f"{call}: unknown options {sorted(unknown)}; expected any of "
                                   f"{sorted(allowed)}")
    route = changes.get("self_route", base.self_route)
    if route not in ("peer", "local"):
        raise InvalidArgumentError(f"{call}: self_route must be 'peer' or 'local'; got {route!r}")
    chunk = changes.get("chunk_bytes", base.chunk_bytes)
    if not isinstance(chunk, int) or chunk < 1:
        raise InvalidArgumentError(f"{call}: chunk_bytes must be a positive int; got {chunk!r}")
    lanes = changes.get("copy_lanes", base.copy_lanes)
    if lanes is not None and (not isinstance(lanes, int) or lanes < 1):
        raise InvalidArgumentError(f"{call}: copy_lanes must be None or a positive int; got {lanes!r}")
    return Options(copy_lanes=lanes, chunk_bytes=chunk, self_route=route)
