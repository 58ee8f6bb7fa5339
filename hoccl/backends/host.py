"""The host backend: the same semantics as the CUDA backend on host memory.

Streams are FIFO queues run by one worker thread each (which splits a copy or a reduction
of many MiB over ``host_threads()`` threads); events, 64-bit signal slots with wait-value
``>=``, copies and reductions act on plain host memory.  In one process peers' addresses
are used directly.  Across processes (mpirun) a buffer is "exported" as (pid, address)
and, where it lies in a shared segment (``hoccl.backends._segments``: the backend's own
scratch, ``hoccl.host_empty``'s arrays), the segment's name; the importer maps such a
segment once and uses the buffer as its own memory.  Any other buffer is "imported" as a
``RemotePtr`` and reached with Linux cross-memory attach
(``hoccl.backends._cross_memory``).

It is a real CPU backend (like Gloo for torch), and the reference the CUDA
backend's semantics are checked against in CI.
"""

from __future__ import annotations

import ctypes
import os
import queue
import random
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..config import environ, host_threads
from .._dtypes import numpy_dtype, reduce_arrays, reduce_into
from .._errors import HocclError, HocclTimeoutError, InvalidArgumentError
from ._base import (DIRECT_COPY, DIRECT_REDUCE, DIRECT_SIGNAL, DIRECT_VALUE_BITS, DIRECT_WAIT,
                    Device, DirectProgram, HostWord, check_reduce_extras)
from ._cross_memory import FOLD_BLOCK_BYTES, RemotePtr, move, remote_reader
from ._kernels import DIRECT_WORDS, block_range
from ._host_pads import _PADS, pad_counts, released_pad_writes
from ._segments import NO_SEGMENT, HeldSegments, PeerSegments, segment_of, shared_bytes

__all__ = ["HostDevice", "HostStream", "RemotePtr", "open_device", "released_pad_writes",
           "pad_counts"]


def _reduce_now(output: Any, inputs: Sequence[Any], count: int, dtype: str, op: str,
                divisor: Optional[int], scale: Optional[float]) -> None:
    """``output = op(*inputs)`` now (a host stream's reduction), a block at a time
    (``reduce_into``, on ``host_threads()`` threads): a peer's input is read where it lies
    (``remote_reader``)."""
    np_dtype = numpy_dtype(dtype)
    nbytes = count * np_dtype.itemsize

    def local(address: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))

    remote = any(isinstance(a, RemotePtr) for a in inputs)
    reduce_into(local(output).view(np_dtype),
                [remote_reader(a, np_dtype) if isinstance(a, RemotePtr) else
                 local(a).view(np_dtype) for a in inputs],
                op, divisor, scale, threads=host_threads(),
                block_bytes=FOLD_BLOCK_BYTES if remote else None)


def _read_u64(address: int) -> int:
    return ctypes.c_uint64.from_address(address).value


def _check_order(address: Any, value: int) -> None:
    """Raise if writing ``value`` would lower the word at ``address``: a signal slot or a
    completion word.  Only the rank that signals writes a slot's nonzero values (its
    receiver only puts a graph slot back to 0), so a lower value means an earlier call's
    signal landed after a later call's, and a peer would wait past it for ever.  Writes
    of 0 (graph slots put back) and words holding an abort's value are left alone."""
    if not value:
        return
    word = np.zeros(1, dtype=np.uint64)
    move(word.ctypes.data, address, 8)
    current = int(word[0])
    if value < current < 1 << 62:
        raise HocclError(f"signal order: writing {value} over {current} at {address!r} would "
                         f"lower the word: an earlier call's signal landed after a later "
                         f"call's (HOCCL_HOST_CHECK_SIGNALS)")


_ABANDONED: List[Any] = []  # memory of devices closed with stuck work


class _Aborted(Exception):
    """Raised inside a worker when its device was aborted: the item is dropped."""


class _Queue:
    """An in-order queue of work and the worker thread that runs it: one per host stream,
    or shared by several (``HOCCL_HOST_QUEUES``), as a GPU's streams share its hardware
    queues."""

    def __init__(self, name: str):
        self._items: "queue.SimpleQueue" = queue.SimpleQueue()
        self.users = 0  # the streams that feed it
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, stream: "HostStream", work, marker: bool) -> None:
        self._items.put((stream, work, marker))

    def _run(self) -> None:
        while True:
            item = self._items.get()
            if item is None:
                return
            stream, work, marker = item
            stream._run_item(work, marker)

    def close(self, join: bool = True) -> None:
        self._items.put(None)
        if join:
            self._thread.join(timeout=5)


class HostStream:
    """An in-order queue of work run by a worker thread (a host "stream").  With
    ``HOCCL_HOST_QUEUES`` several streams share one worker, in order of enqueueing across
    them: a wait on one of them holds the others' later work too, as a GPU's stream that
    shares a hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS``) is held behind another
    stream's wait."""

    def __init__(self, device: "HostDevice", name: str, jitter: float = 0.0,
                 shared: "Optional[_Queue]" = None):
        self._device = device
        #: ``HOCCL_HOST_JITTER``: at most this many seconds of sleep before each item, so
        #: that the streams of a rank interleave in orders a loaded machine would rarely show
        self._jitter = jitter
        self._worker = shared if shared is not None else _Queue(name)
        self._worker.users += 1
        self._idle = threading.Condition()
        self._pending = 0
        self.error: BaseException | None = None
        #: set by ``HostDevice.abort``: queued waits of this stream give up, writes are dropped
        self.aborted = threading.Event()

    def enqueue(self, work, marker: bool = False) -> None:
        """Queue ``work``; a ``marker`` (an event's record) runs even after an item of
        this stream failed, which skips the rest: the stream is then idle, and teardown
        can see that it is."""
        with self._idle:
            self._pending += 1
        self._worker.put(self, work, marker)

    def _run_item(self, work, marker: bool) -> None:
        try:
            if self.error is None or marker:
                if self._jitter:
                    time.sleep(random.random() * self._jitter)
                work()
        except _Aborted:
            pass
        except BaseException as error:  # surfaced by synchronize
            self.error = error
        with self._idle:
            self._pending -= 1
            if self._pending == 0:
                self._idle.notify_all()

    def synchronize(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HocclTimeoutError(f"synchronize_stream: host stream still has "
                                            f"{self._pending} items after {timeout:.1f} s")
                self._idle.wait(min(left, 0.05))
        if self.error is not None:
            raise HocclError(f"synchronize_stream: work on a host stream failed: "
                             f"{self.error!r}") from self.error

    def close(self, join: bool = True) -> None:
        """Stop its worker, once no other stream feeds it."""
        self._worker.users -= 1
        if self._worker.users == 0:
            self._worker.close(join)


class _Event:
    """Like a CUDA event: a wait binds to the latest record at the time of the wait call."""

    def __init__(self):
        self.latest: List[bool] = [True]  # the latest record's "reached" flag


class _HostWord(HostWord):
    def __init__(self, array: np.ndarray):
        self._array = array
        self.address = array.ctypes.data

    @property
    def value(self) -> int:
        return int(self._array[0])


class HostDevice(Device):
    """One rank's host "device"."""

    backend = "host"

    def __init__(self, *, max_sms: int, copy_sms: int):
        self.ordinal = None
        self.max_sms = max_sms  # kept for interface parity (threads: host_threads())
        self.copy_sms = copy_sms
        self._memory: Dict[int, np.ndarray] = {}
        #: the peers' segments this device has mapped (``import_``)
        self._peer_segments = PeerSegments(writable=True, hold_live=True)
        #: the peers' signal pads this device writes into, held while a pad uses them
        self._peer_pads = HeldSegments()
        self._streams: List[HostStream] = []
        self._default: HostStream | None = None
        self._aborted = threading.Event()
        self._pid = os.getpid()
        self._closed = False
        #: ``HOCCL_HOST_CHECK_SIGNALS=1`` (the CPU test tier sets it): every signal and
        #: completion word this device writes is checked, as it lands, never to lower the
        #: word (``_check_order``)
        self._check_signals = environ("HOCCL_HOST_CHECK_SIGNALS") == "1"
        self._jitter = float(environ("HOCCL_HOST_JITTER") or 0)
        #: ``HOCCL_HOST_QUEUES=K``: the streams share K workers, in creation order (0: a
        #: worker each); the workers made so far
        self._queue_count = int(environ("HOCCL_HOST_QUEUES") or 0)
        self._queues: Dict[int, _Queue] = {}
        self._made = 0
        host_threads()  # a bad HOCCL_HOST_THREADS raises here, not later on a stream's thread

    def fresh(self) -> "HostDevice":
        return HostDevice(max_sms=self.max_sms, copy_sms=self.copy_sms)

    # -- streams and events ------------------------------------------------------------
    def create_stream(self) -> HostStream:
        name = f"hoccl-host-lane-{len(self._streams)}"
        shared = None
        if self._queue_count > 0:
            index = self._made % self._queue_count
            shared = self._queues.get(index)
            if shared is None or not shared.users:  # closed with its last stream
                shared = self._queues[index] = _Queue(f"hoccl-host-queue-{index}")
        self._made += 1
        stream = HostStream(self, name, self._jitter, shared)
        self._streams.append(stream)
        return stream

    def destroy_stream(self, stream: HostStream) -> None:
        if stream in self._streams:
            self._streams.remove(stream)
            stream.close()

    @property
    def default_stream(self) -> HostStream:
        if self._default is None:
            self._default = self.create_stream()
        return self._default

    def resolve_stream(self, stream: Any, arrays: Sequence[Any]) -> HostStream:
        if stream is None:
            return self.default_stream
        if isinstance(stream, HostStream):
            return stream
        raise InvalidArgumentError(f"resolve_stream: the host backend takes stream=None or a "
                                   f"stream this host device created (device.create_stream()); got "
                                   f"{type(stream).__name__}")

    def create_event(self) -> _Event:
        return _Event()

    def destroy_event(self, event: _Event) -> None:
        pass

    def record(self, stream: HostStream, event: _Event) -> None:
        reached = event.latest = [False]

        def reach():
            reached[0] = True
        stream.enqueue(reach, marker=True)

    def wait_event(self, stream: HostStream, event: _Event) -> None:
        reached = event.latest
        stream.enqueue(lambda: self._poll(stream, lambda: reached[0]))

    def done(self, event: _Event) -> bool:
        return event.latest[0]

    def synchronize_stream(self, stream: HostStream, timeout: float) -> None:
        stream.synchronize(timeout)

    def _poll(self, stream: HostStream, ready) -> None:
        """Spin, then sleep with back-off, until ``ready()``; an abort of ``stream`` (or of
        the whole device) releases it."""
        delay = 0.0
        while not ready():
            if self._aborted.is_set() or stream.aborted.is_set():
                raise _Aborted()
            time.sleep(delay)
            delay = min(delay * 2 + 20e-6, 1e-3)

    # -- memory ------------------------------------------------------------------------
    #: scratch of at least this many bytes lies in a segment that peers map
    SHARED_FROM = 1 << 20

    def alloc(self, nbytes: int) -> int:
        array = (shared_bytes(nbytes) if nbytes >= self.SHARED_FROM
                 else np.empty(max(nbytes, 8), dtype=np.uint8))
        self._memory[array.ctypes.data] = array
        return array.ctypes.data

    def free(self, address: int) -> None:
        self._memory.pop(address, None)

    def alloc_pad(self, slots: int) -> int:
        return _PADS.take(slots)

    def free_pad(self, address: int) -> None:
        _PADS.give_back(address)

    def import_pad(self, descriptor: tuple) -> Any:
        """A peer's pad (``export`` of it with its size), mapped and held until
        ``drop_pad``: this rank's writes into it never reach memory its owner freed."""
        kind, pid, address, *words = descriptor
        if kind != "host":
            raise InvalidArgumentError(f"import_pad: expected a host descriptor, got {kind!r}")
        if pid == self._pid:
            return address
        try:
            return self._peer_pads.hold(pid, tuple(words), address)
        except OSError as error:
            raise HocclError(f"import_pad: could not map the signal pad of process {pid} "
                             f"(/proc/{pid}/fd, which needs the permission cross-memory "
                             f"attach needs): {error}") from None

    def drop_pad(self, descriptor: tuple) -> None:
        kind, pid, _, *words = descriptor
        if pid != self._pid:
            self._peer_pads.drop(pid, tuple(words))

    def alloc_host_word(self) -> HostWord:
        array = np.zeros(1, dtype=np.uint64)
        self._memory[array.ctypes.data] = array
        return _HostWord(array)

    def free_host_word(self, word: HostWord) -> None:
        self._memory.pop(word.address, None)

    def export(self, address: int, nbytes: int = 0) -> tuple:
        """``("host", pid, address, *segment)``: the segment's words (``segment_of``)
        where the ``nbytes`` at ``address`` lie in one, else zeros."""
        words = segment_of(address, nbytes) if nbytes else NO_SEGMENT
        return ("host", self._pid, int(address), *words)

    def import_(self, descriptor: tuple) -> Any:
        """A peer's buffer: where it lies in a segment this process can map, its address
        here (the segment is mapped once and kept while its owner has it), else a
        ``RemotePtr``."""
        kind, pid, address, *words = descriptor
        if kind != "host":
            raise InvalidArgumentError(f"import_: expected a host descriptor, got {kind!r}")
        if pid == self._pid:
            return address
        if words and words[1]:
            mapped = self._peer_segments.address(pid, tuple(words), address)
            if mapped is not None:
                return mapped
        return RemotePtr(pid, address)

    @property
    def mapped_segments(self) -> int:
        """How many of the peers' segments this device has mapped."""
        return len(self._peer_segments)

    @property
    def held_pads(self) -> int:
        """How many of the peers' signal pads this device holds mapped (``import_pad``)."""
        return len(self._peer_pads)

    @property
    def allocations(self) -> int:
        """How many allocations of this device (scratch, rings, host words) are live."""
        return len(self._memory)

    def enable_peer_access(self, peer: Device) -> None:
        pass

    # -- the primitives ----------------------------------------------------------------
    def copy(self, stream: HostStream, dst: Any, src: Any, nbytes: int) -> None:
        def run():
            # after an abort nothing more moves: a peer that let go may have freed ``dst``
            if self._aborted.is_set() or stream.aborted.is_set():
                raise _Aborted()
            move(dst, src, nbytes)
        stream.enqueue(run)

    def local_copy(self, stream: HostStream, dst: Any, src: Any, nbytes: int,
                   sms: Optional[int] = None) -> None:
        self.copy(stream, dst, src, nbytes)

    def write_value(self, stream: HostStream, address: Any, value: int) -> None:
        word = np.array([value], dtype=np.uint64)

        def write():
            # after an abort nothing is signalled any more: a late write would undo the poison
            if not (self._aborted.is_set() or stream.aborted.is_set()):
                if self._check_signals:
                    _check_order(address, value)
                move(address, word.ctypes.data, 8)
        stream.enqueue(write)

    def wait_value(self, stream: HostStream, address: Any, value: int) -> None:
        if isinstance(address, RemotePtr):
            raise InvalidArgumentError("wait_value: waits are on this rank's own pad")
        stream.enqueue(lambda: self._poll(stream, lambda: _read_u64(address) >= value))

    def reduce(self, stream: HostStream, output: Any, inputs: Sequence[Any], count: int,
               dtype: str, op: str, divisor: Optional[int] = None,
               sms: Optional[int] = None, scale: Optional[float] = None) -> None:
        check_reduce_extras(op, dtype, divisor, scale)
        if count:
            stream.enqueue(lambda: _reduce_now(output, inputs, count, dtype, op, divisor, scale))

    def reduce_chunks(self, stream: HostStream, flags: Sequence[Any], value: int, output: Any,
                      inputs: Sequence[Any], count: int, last_count: int, chunks: int,
                      stride: int, dtype: str, op: str, sms: Optional[int] = None,
                      scale: Optional[float] = None) -> None:
        """One item, as the GPU's one launch: chunk by chunk, wait until every word at
        ``flags`` reaches the chunk's value (an abort's value ends it), then sum the chunk.
        Under ``HOCCL_HOST_JITTER`` it also sleeps between chunks, as a kernel's blocks may
        be slow to run."""
        check_reduce_extras(op, dtype, None, scale)
        if any(isinstance(flag, RemotePtr) for flag in flags):
            raise InvalidArgumentError("reduce_chunks: waits are on this rank's own pad")
        itemsize = numpy_dtype(dtype).itemsize

        def run():
            for k in range(chunks):
                for flag in flags:
                    self._poll(stream, lambda: _read_u64(flag) >= value + k)
                if any(_read_u64(flag) >= 1 << 62 for flag in flags):
                    return  # released by an abort: nothing more is written
                if stream._jitter:
                    time.sleep(random.random() * stream._jitter)
                shift = k * stride * itemsize
                _reduce_now(output + shift, [address + shift for address in inputs],
                            last_count if k == chunks - 1 else count, dtype, op, None, scale)
        if chunks and count:
            stream.enqueue(run)

    def direct(self, stream: HostStream, program: DirectProgram, value: int = 0) -> None:
        """The direct kernel's protocol on the host: every block's signal slot, waits for
        every block's, each block's share of each data step (``block_range``), and the
        epoch in the rank's pad.  The blocks go step by step together (block 0's share,
        block 1's, ...), one of the interleavings the GPU may run."""
        blocks, counter = program.blocks, program.counter
        np_dtype = numpy_dtype(program.dtype)
        itemsize = np_dtype.itemsize

        def read(address: Any, nbytes: int) -> np.ndarray:
            data = np.empty(nbytes, dtype=np.uint8)
            move(data.ctypes.data, address, nbytes)
            return data

        def run():
            epoch = _read_u64(counter)
            if epoch >= 1 << 46:  # aborted
                return
            base = epoch << DIRECT_VALUE_BITS
            odd = epoch & 1  # the rings' half this call uses
            twin = program.signature_shift + odd * program.signature_half
            moving = True  # until a peer is seen making another call
            for op in program.ops:
                kind = op[0]
                if kind == DIRECT_SIGNAL:
                    # every word of the slot (block b's are b, b + blocks, ...), after the
                    # call's signature in every twin
                    if self._aborted.is_set() or stream.aborted.is_set():
                        raise _Aborted()
                    twins = np.full(DIRECT_WORDS, program.signature, dtype=np.uint64)
                    words = np.full(DIRECT_WORDS, base + op[2], dtype=np.uint64)
                    move(op[1] + twin, twins.ctypes.data, twins.nbytes)
                    move(op[1], words.ctypes.data, words.nbytes)
                elif kind == DIRECT_WAIT:
                    slot = np.ctypeslib.as_array(
                        (ctypes.c_uint64 * DIRECT_WORDS).from_address(op[1]))
                    self._poll(stream, lambda slot=slot, need=base + op[2]:
                               int(slot.min()) >= need)
                    if int(slot.max()) >= 1 << 62:
                        return  # released by an abort: nothing more moves
                    seen = np.ctypeslib.as_array(
                        (ctypes.c_uint64 * DIRECT_WORDS).from_address(op[1] + twin))
                    if moving and program.signature and bool(
                            (seen != np.uint64(program.signature)).any()):
                        moving = False  # a peer made another call: no more data moves
                        ctypes.c_uint64.from_address(int(program.error)).value = (
                            value if value else 1 << 61)
                elif not moving:
                    continue
                elif kind == DIRECT_COPY:
                    _, dst, src, nbytes, dst_shift, src_shift = op
                    dst, src = dst + odd * dst_shift, src + odd * src_shift
                    for block in range(blocks):
                        start, stop = block_range(nbytes, blocks, block)
                        move(dst + start, src + start, stop - start)
                else:
                    assert kind == DIRECT_REDUCE
                    _, output, inputs, count, out_shift = op
                    output = output + odd * out_shift
                    addresses = [address + odd * shift for address, shift in inputs]
                    for block in range(blocks):
                        start, stop = block_range(count * itemsize, blocks, block)
                        if start == stop:
                            continue
                        views = [read(address + start, stop - start).view(np_dtype)
                                 for address in addresses]
                        result = reduce_arrays(views, program.op, np_dtype, None, program.scale)
                        move(output + start, result.ctypes.data, stop - start)
            if _read_u64(counter) == epoch:  # not over an abort value
                ctypes.c_uint64.from_address(counter).value = epoch + 1
            # the kernel's last block: the call's completion words (not after an abort),
            # the host's first (``StreamManager.completion_writes``)
            if value and not (self._aborted.is_set() or stream.aborted.is_set()):
                completion = ctypes.c_uint64.from_address(int(program.completion))
                if completion.value < 1 << 62:  # not over an abort value
                    if self._check_signals:
                        _check_order(int(program.host_word), value)
                    ctypes.c_uint64.from_address(int(program.host_word)).value = value
                    completion.value = max(completion.value, value)
        stream.enqueue(run)

    # -- out of band ---------------------------------------------------------------------
    def peek(self, address: Any, count: int) -> List[int]:
        words = np.zeros(count, dtype=np.uint64)
        move(words.ctypes.data, address, 8 * count)
        return [int(word) for word in words]

    def poke(self, writes: Sequence[Tuple[Any, int]]) -> None:
        for address, value in writes:
            word = np.array([value], dtype=np.uint64)
            move(address, word.ctypes.data, 8)

    def failure(self) -> Optional[str]:
        for stream in self._streams:
            if stream.error is not None:
                return f"{type(stream.error).__name__}: {stream.error}"
        return None

    # -- lifetime ----------------------------------------------------------------------
    def abort(self, streams: Optional[Sequence[Any]] = None) -> None:
        """Release every blocked wait of ``streams`` (default: all of this device's);
        their pending items are dropped."""
        if streams is None:
            self._aborted.set()
            return
        for stream in streams:
            stream.aborted.set()

    def close(self, leak: bool = False) -> None:
        """With ``leak`` the worker threads of stuck streams are not waited for (they are
        daemons; abort makes them drop their queued work once they wake)."""
        if self._closed:
            return
        self._closed = True
        self._aborted.set()
        for stream in list(self._streams):
            stream.close(join=not leak)
        self._streams.clear()
        self._default = None
        if leak:
            # a stuck stream may still read its pad or a peer's mapped buffer
            _ABANDONED.append((self._memory, self._peer_segments, self._peer_pads))
            self._memory, self._peer_segments = {}, PeerSegments(True, True)
            self._peer_pads = HeldSegments()
        self._memory.clear()
        self._peer_segments.clear()
        self._peer_pads.clear()


def open_device(ordinal: Any = None, *, max_sms: int, copy_sms: int) -> HostDevice:
    """A host device for one rank (``ordinal`` is ignored: host memory is one space)."""
    return HostDevice(max_sms=max_sms, copy_sms=copy_sms)
