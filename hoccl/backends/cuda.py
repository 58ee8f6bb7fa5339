"""The CUDA device backend: with its parts, the only code in hoccl that calls the driver.

Everything hoccl does on a GPU goes through ``CudaDevice``: streams and events, memory,
IPC export and import, peer access, the zero-SM primitives (copies on copy engines,
``cuStreamWriteValue64`` / ``cuStreamWaitValue64`` signals) and the two SM kernels
(a capped same-GPU copy and the reduction).  Keeping the driver behind this one module
means the scheduler and the executor stay testable without a GPU (the host backend
implements the same ``Device`` interface), and every driver call is checked in one
place: ``_check`` turns a failing status into a ``DriverError`` that names the call,
the error and what to do about it when that is known.

The parts: ``_cuda_driver`` (the gateway: ``_call``, ``_check``, ``_status``),
``_cuda_memory`` (allocations, pads, IPC export and import), ``_cuda_kernels`` (the
kernels and their launches), ``_cuda_structs`` (the kernels' argument structs).

The device works in its GPU's *primary* context, the one cupy and torch use, so
pointers and streams from those frameworks are valid here without translation.

Typical use (one process, two GPUs)::

    dev0, dev1 = open_device(0), open_device(1)
    dev0.enable_peer_access(dev1)
    lane = dev0.create_stream()
    dev0.copy(lane, dst_on_gpu1, src_on_gpu0, nbytes)   # a copy engine, no SM
    dev0.write_value(lane, pad_on_gpu1, seq)            # lands after the copy
    ...
    dev0.close(); dev1.close()
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
import weakref
from typing import Any, Iterator, List, Sequence, Tuple

from cuda.bindings import driver

from ..config import environ, whole_number
from .._errors import DriverError, HocclTimeoutError, InvalidArgumentError
from ._base import Device, MemOp
from ._caller_stream import array_framework, stream_handle
# ``_call`` (the gateway), ``_function``, ``_handle_bytes`` and ``_handle_from`` are used
# from here too, by tools, the lever study and the tests
from ._cuda_driver import (_ACTIVE, _GONE, _LEGACY_STREAMS, _MAX_BATCH_MEMOPS, _NOT_READY,
                           _PEER_ALREADY_ENABLED, _SINGLE_MEMOPS, _WAIT_GEQ, _WRITE_DEFAULT,
                           _call, _init_driver, _keep, _status)
from ._cuda_kernels import _function, _SmWork
from ._cuda_memory import CudaIpcDescriptor, _handle_bytes, _handle_from, _Memory

__all__ = ["CudaDevice", "CudaIpcDescriptor", "device_count", "open_device"]

#: the most memops one ``memops`` call issues as single driver calls, read at import
_GIVEN = whole_number("HOCCL_SINGLE_MEMOPS", 0, "memops", "memops issued as single driver calls")
_SINGLE: int = _SINGLE_MEMOPS if _GIVEN is None else _GIVEN
#: the most lists of memops a device keeps batches for (``CudaDevice.memops``)
_MEMOP_BATCHES = 256


# -- owned handles -------------------------------------------------------------------------
class _Owned:
    """Every handle a CudaDevice created, released by ``_release`` in teardown order.

    Kept apart from the device so that ``weakref.finalize`` can release it without
    holding the device alive.
    """

    def __init__(self, device: Any):
        self.device = device
        self.context: Any = None
        self.imports: dict = {}          # (handle bytes, base, buffer id, size) -> mapped base
        self.peers: list = []            # peer contexts whose access this device enabled
        self.events: set = set()
        self.streams: set = set()
        self.pads: set = set()
        self.host_words: list = []
        self.allocations: set = set()
        self.kernels: Any = None
        self.direct: dict = {}           # (dtype, op) -> direct kernel (module, function)


def _release(owned: _Owned) -> None:
    """Release in order: imports, peer access, events, streams, pads, host words,
    allocations, and last the primary context (the kernel module is cupy's)."""
    if owned.context is None:
        return
    errors = []

    def attempt(function: Any, *args: Any, allow: Tuple[Any, ...] = ()) -> None:
        try:
            _status(function(*args), function.__name__, allow)
        except DriverError as error:
            errors.append(error)

    attempt(driver.cuCtxSetCurrent, owned.context)
    _ACTIVE.context = None
    for mapped in owned.imports.values():
        attempt(driver.cuIpcCloseMemHandle, mapped)
    for peer_context in owned.peers:
        attempt(driver.cuCtxDisablePeerAccess, peer_context, allow=_GONE)
    for event in owned.events:
        attempt(driver.cuEventDestroy, event)
    for stream in owned.streams:
        attempt(driver.cuStreamDestroy, stream)
    # pads are never freed: a peer that aborts later pokes its poison into this rank's
    # pad through its mapping, and must never land in memory given to something else
    # (a pad is a few KiB per communicator)
    _KEPT_PADS.extend(owned.pads)
    for word in owned.host_words:
        attempt(driver.cuMemFreeHost, word._host_address)
        word._host_address = 0
    for address in owned.allocations:
        attempt(driver.cuMemFree, address)
    attempt(driver.cuDevicePrimaryCtxRelease, owned.device)
    for handles in (owned.imports, owned.peers, owned.events, owned.streams, owned.pads,
                    owned.host_words, owned.allocations):
        handles.clear()
    owned.kernels = None
    owned.direct = {}
    owned.context = None
    if errors:
        raise DriverError("close: " + "; ".join(str(error) for error in errors))


def _memop(kind: MemOp, address: int) -> Tuple[Any, Any]:
    """A batch entry writing or waiting (``>=``) on the 64-bit word at ``address``, and
    its part whose ``value64`` each use sets (building one costs microseconds, setting
    the value a fraction of one)."""
    operation = driver.CUstreamBatchMemOpParams()
    is_write = kind is MemOp.WRITE
    part = operation.writeValue if is_write else operation.waitValue
    part.operation = (driver.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64 if is_write
                      else driver.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64)
    part.address = int(address)
    part.flags = 0 if is_write else _WAIT_GEQ
    return operation, part


# -- the device ----------------------------------------------------------------------------
_ABANDONED: List[Any] = []   # handles of devices closed with stuck work: never freed
_KEPT_PADS: List[int] = []   # signal pads of closed devices (see ``_release``)


def device_count() -> int:
    """Visible CUDA devices; 0 when there is no driver (libcuda) or no GPU."""
    try:
        _init_driver()
        return _call(driver.cuDeviceGetCount)
    except (DriverError, RuntimeError):  # cuda-bindings raises RuntimeError without libcuda
        return 0


def open_device(ordinal: int, *, max_sms: int, copy_sms: int) -> "CudaDevice":
    """Open GPU ``ordinal`` in its primary context; ``max_sms`` caps the reduction kernel's
    grid, ``copy_sms`` the same-GPU copy kernel's."""
    if not isinstance(ordinal, int) or isinstance(ordinal, bool):
        raise InvalidArgumentError(
            f"open_device: expected an int ordinal, got {type(ordinal).__name__}")
    _init_driver()
    count = _call(driver.cuDeviceGetCount)
    if not 0 <= ordinal < count:
        raise InvalidArgumentError(
            f"open_device: expected an ordinal in [0, {count}), got {ordinal}")
    device = CudaDevice(ordinal, max_sms=max_sms, copy_sms=copy_sms)
    # Load the kernels now: a module load may synchronize the device, which must never
    # happen while a caller's stream waits on a collective another rank has yet to issue.
    device._kernels()
    return device


class CudaDevice(_SmWork, _Memory, Device):
    """One GPU seen through its primary context.  Create it with ``open_device``.

    Streams, events and addresses are the driver's own handles (``CUstream``,
    ``CUevent``, int device pointers); methods accept ints for streams too.
    """

    backend = "cuda"

    def __init__(self, ordinal: int, *, max_sms: int, copy_sms: int):
        self.ordinal = ordinal
        #: the most SMs (thread blocks) ``reduce`` may occupy
        self.max_sms = max_sms
        #: the most SMs (thread blocks) ``local_copy`` may occupy
        self.copy_sms = copy_sms
        self._device = _call(driver.cuDeviceGet, ordinal)
        self._owned = _Owned(self._device)
        self._context = _call(driver.cuDevicePrimaryCtxRetain, self._device)
        self._owned.context = self._context
        self._finalizer = weakref.finalize(self, _release, self._owned)
        self._finalizer.atexit = False
        self._kernel_lock = threading.Lock()
        self._exports: dict = {}       # (allocation base, buffer id) -> (handle, size)
        self._descriptors: dict = {}   # (address, buffer id) -> descriptor
        self._called: set = set()      # import keys a call mapped (kept until close)
        self._holds: dict = {}         # import key -> windows holding it (hold_import)
        self._memop_params: dict = {}  # ((kind, address), ...) -> kept batches
        self._reduce_launches = {}     # a reduce's arguments -> its launches (_SmWork)
        self._copy_launches = {}       # a local_copy's arguments -> its launch (_SmWork)
        self._streams: dict = {}       # a raw stream handle -> its CUstream (resolve_stream)

        def attribute(name: str) -> int:
            return _call(driver.cuDeviceGetAttribute, getattr(driver.CUdevice_attribute, name),
                         self._device)

        self.compute_capability = (attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
                                   attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"))
        self.sm_count = attribute("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")
        try:  # the same in every process, whatever CUDA_VISIBLE_DEVICES says
            bus = _call(driver.cuDeviceGetPCIBusId, 32, self._device)
            self.physical = bytes(bus).split(b"\0")[0].decode() or None
        except DriverError:  # an unknown id only keeps fuse_sums' default
            self.physical = None
        try:  # what a tuning table is keyed by (``hoccl.tuning.machine_of``)
            name = _call(driver.cuDeviceGetName, 256, self._device)
            self.model = bytes(name).split(b"\0")[0].decode() or "unknown"
        except DriverError:
            self.model = "unknown"
        self.link, self.peers = self._link_kind()
        try:
            self.driver = str(_call(driver.cuDriverGetVersion))
        except DriverError:
            self.driver = "unknown"
        self._make_current()
        least, greatest = _call(driver.cuCtxGetStreamPriorityRange)
        # Copy lanes default to the highest priority; HOCCL_LANE_PRIORITY=normal gives the
        # default priority (for measuring how SM work of reductions meets other kernels).
        self._priority = least if environ("HOCCL_LANE_PRIORITY") == "normal" else greatest
        # A private stream for setup work that must finish before a call returns.
        self._setup_stream = self.create_stream()
        self._batch_attributes = driver.CUmemcpyAttributes()
        self._batch_attributes.srcAccessOrder = \
            driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM

    def _link_kind(self) -> Tuple[str, int]:
        """How this GPU reaches the host's other GPUs, for tuning tables, and how many it
        reaches: "nvlink" where peer access has native atomics (NVLink links have them,
        PCIe ones not), "pcie" where it has not, "none" where no other GPU is reachable."""
        try:
            count = _call(driver.cuDeviceGetCount)
            native = driver.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
            kinds: List[str] = []
            for other in range(count):
                peer = _call(driver.cuDeviceGet, other)
                if other == self.ordinal or not _call(driver.cuDeviceCanAccessPeer,
                                                      self._device, peer):
                    continue
                atomics = _call(driver.cuDeviceGetP2PAttribute, native, self._device, peer)
                kinds.append("nvlink" if atomics else "pcie")
        except DriverError:
            return "unknown", 0
        return ("pcie" if "pcie" in kinds else "nvlink" if kinds else "none"), len(kinds)

    def __repr__(self) -> str:
        state = "closed" if self._owned.context is None else f"max_sms={self.max_sms}"
        major, minor = self.compute_capability
        return f"<CudaDevice {self.ordinal} sm_{major}{minor} {state}>"

    def __enter__(self) -> "CudaDevice":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _make_current(self) -> None:
        """Set this device's context unless ``activate`` already did on this thread, in the
        public call now running (nothing but hoccl runs between its driver calls)."""
        if self._owned.context is None:
            raise InvalidArgumentError(f"CudaDevice {self.ordinal}: the device is closed")
        if getattr(_ACTIVE, "context", None) is not self._context:
            _call(driver.cuCtxSetCurrent, self._context)
            _ACTIVE.context = self._context

    def activate(self) -> None:
        """Set the context now (user code may have changed it since hoccl's last call)."""
        if self._owned.context is None:
            raise InvalidArgumentError(f"CudaDevice {self.ordinal}: the device is closed")
        _call(driver.cuCtxSetCurrent, self._context)
        _ACTIVE.context = self._context

    # -- streams and events ----------------------------------------------------------------
    def create_stream(self) -> Any:
        self._make_current()
        stream = _call(driver.cuStreamCreateWithPriority,
                       driver.CUstream_flags.CU_STREAM_NON_BLOCKING, self._priority)
        self._owned.streams.add(stream)
        return stream

    def destroy_stream(self, stream: Any) -> None:
        stream = driver.CUstream(int(stream))
        if stream not in self._owned.streams:
            raise InvalidArgumentError(
                f"destroy_stream: expected a stream this device created, got {int(stream):#x}")
        self._make_current()
        self._owned.streams.discard(stream)
        _call(driver.cuStreamDestroy, stream)

    def resolve_stream(self, stream: Any, arrays: Sequence[Any]) -> Any:
        if stream is None:
            framework = array_framework(arrays)
            if framework == "torch":
                torch = sys.modules["torch"]
                raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object
                return self._stream_of(raw(self.ordinal) if raw is not None else
                                       torch.cuda.current_stream(self.ordinal).cuda_stream)
            if framework == "cupy":
                cupy = sys.modules["cupy"]
                with cupy.cuda.Device(self.ordinal):
                    return driver.CUstream(cupy.cuda.get_current_stream().ptr)
            return driver.CUstream(driver.CU_STREAM_LEGACY)
        if isinstance(stream, driver.CUstream):
            return stream
        return self._stream_of(stream_handle(stream))

    def _stream_of(self, handle: int) -> Any:
        """The ``CUstream`` of a raw handle, made once per handle (a caller's stream is
        usually one of a few; building the object costs more than finding it)."""
        stream = self._streams.get(handle)
        if stream is None:
            if len(self._streams) >= 64:
                self._streams.clear()
            stream = self._streams[handle] = driver.CUstream(handle)
        return stream

    def capturing(self, stream: Any) -> bool:
        status = _call(driver.cuStreamIsCapturing, stream)
        if status == driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_INVALIDATED:
            raise InvalidArgumentError(
                "capture: the caller's stream was being captured, but its capture has been "
                "invalidated by an earlier error; end it (cuStreamEndCapture) first")
        return status == driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE

    @contextlib.contextmanager
    def relaxed_capture(self) -> Iterator[None]:
        mode = _call(driver.cuThreadExchangeStreamCaptureMode,
                     driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        try:
            yield
        finally:
            _call(driver.cuThreadExchangeStreamCaptureMode, mode)

    def create_event(self) -> Any:
        self._make_current()
        event = _call(driver.cuEventCreate, driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self._owned.events.add(event)
        return event

    def destroy_event(self, event: Any) -> None:
        if event not in self._owned.events:
            raise InvalidArgumentError(
                f"destroy_event: expected an event this device created, got {event!r}")
        self._make_current()
        self._owned.events.discard(event)
        _call(driver.cuEventDestroy, event)

    def record(self, stream: Any, event: Any) -> None:
        self._make_current()
        _call(driver.cuEventRecord, event, stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        self._make_current()
        _call(driver.cuStreamWaitEvent, stream, event, 0)

    def done(self, event: Any) -> bool:
        self._make_current()
        return not _status(driver.cuEventQuery(event), "cuEventQuery", (_NOT_READY,))

    def synchronize_stream(self, stream: Any, timeout: float) -> None:
        """Poll ``cuStreamQuery``: spin ~50 µs, then sleep with backoff up to 1 ms."""
        self._make_current()
        start = time.monotonic()
        spin_until, deadline, delay = start + 50e-6, start + timeout, 10e-6
        while _status(driver.cuStreamQuery(stream), "cuStreamQuery", (_NOT_READY,)):
            now = time.monotonic()
            if now >= deadline:
                raise HocclTimeoutError(
                    f"synchronize_stream: stream {int(stream):#x} on GPU {self.ordinal} still had "
                    f"unfinished work after {timeout} s (cuStreamQuery kept answering "
                    "CUDA_ERROR_NOT_READY; a wait_value whose signal never came blocks a "
                    "stream forever)")
            if now >= spin_until:
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
            else:
                os.sched_yield()  # lets the process's other threads take the GIL

    # -- out of band -------------------------------------------------------------------------
    def _out_of_band(self, copy: Any, *args: Any, timeout: float = 10.0) -> None:
        """A copy on the private non-blocking setup stream: it queues behind no lane and
        no caller stream, so a blocked collective cannot delay it."""
        self._make_current()
        stream = self._setup_stream
        _call(copy, *args, stream)
        self.synchronize_stream(stream, timeout)

    def peek(self, address: Any, count: int) -> list:
        words = (ctypes.c_uint64 * count)()
        self._out_of_band(driver.cuMemcpyDtoHAsync, ctypes.addressof(words), int(address),
                          8 * count)
        return [int(word) for word in words]

    def poke(self, writes: Sequence[Tuple[Any, int]]) -> None:
        """Runs of consecutive words go in one copy each (an abort pokes a whole pad)."""
        runs: List[Tuple[int, List[int]]] = []
        for address, value in writes:
            address = int(address)
            if runs and runs[-1][0] + 8 * len(runs[-1][1]) == address:
                runs[-1][1].append(value)
            else:
                runs.append((address, [value]))
        for address, values in runs:
            words = (ctypes.c_uint64 * len(values))(*values)
            self._out_of_band(driver.cuMemcpyHtoDAsync, address, ctypes.addressof(words),
                              8 * len(values))

    def enable_peer_access(self, peer: Device) -> None:
        if not isinstance(peer, CudaDevice):
            raise InvalidArgumentError(
                f"enable_peer_access: expected a CudaDevice, got {type(peer).__name__}")
        if peer.ordinal == self.ordinal or peer._context in self._owned.peers:
            return
        self._make_current()
        status = _status(driver.cuCtxEnablePeerAccess(peer._context, 0), "cuCtxEnablePeerAccess",
                         (_PEER_ALREADY_ENABLED,))
        if not status:  # enabled by someone else: theirs to disable
            self._owned.peers.append(peer._context)

    # -- the zero-SM primitives -------------------------------------------------------------
    def copy(self, stream: Any, dst: Any, src: Any, nbytes: int) -> None:
        if nbytes:
            self._make_current()
            _call(driver.cuMemcpyAsync, dst, src, nbytes, stream)

    def copy_batch(self, stream: Any, copies: Sequence[Tuple[Any, Any, int]]) -> None:
        """One ``cuMemcpyBatchAsync`` (no order among the copies); single copies and the
        legacy stream, which the batch call refuses, go through ``copy``."""
        copies = [copy for copy in copies if copy[2]]
        if len(copies) < 2 or int(stream) in _LEGACY_STREAMS:
            for dst, src, nbytes in copies:
                self.copy(stream, dst, src, nbytes)
            return
        self._make_current()
        _call(driver.cuMemcpyBatchAsync,
              [driver.CUdeviceptr(int(dst)) for dst, _, _ in copies],
              [driver.CUdeviceptr(int(src)) for _, src, _ in copies],
              [nbytes for _, _, nbytes in copies], len(copies),
              [self._batch_attributes], [0], 1, stream)

    def write_value(self, stream: Any, address: Any, value: int) -> None:
        self._make_current()
        _call(driver.cuStreamWriteValue64, stream, address, value,
              driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)

    def wait_value(self, stream: Any, address: Any, value: int) -> None:
        self._make_current()
        _call(driver.cuStreamWaitValue64, stream, address, value,
              driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)

    def memops(self, stream: Any, operations: Sequence[Tuple[MemOp, Any, int]]) -> None:
        """Writes and waits in order: up to ``_SINGLE`` as single calls (``_SINGLE_MEMOPS``,
        or ``HOCCL_SINGLE_MEMOPS``), more as one ``cuStreamBatchMemOp`` (in batches of up
        to 255).  A batch's ``CUstreamBatchMemOpParams`` are kept per list of (kind,
        address), as a repeated call makes the same list again, and only their values
        set: building them costs microseconds, setting a value a fraction of one.
        ``tools/profile_call.py`` times both ways (one H100: two writes 5.41 µs as single
        calls, 3.10 µs as one batch of kept structs; ``results/h100/2026-12-06b``)."""
        if len(operations) <= _SINGLE:
            self._make_current()
            for kind, address, value in operations:
                if kind is MemOp.WRITE:
                    _call(driver.cuStreamWriteValue64, stream, address, value, _WRITE_DEFAULT)
                else:
                    _call(driver.cuStreamWaitValue64, stream, address, value, _WAIT_GEQ)
            return
        key = tuple([(kind, address) for kind, address, _ in operations])
        kept = self._memop_params.get(key)
        if kept is None:
            kept = self._memop_batch(key)
        for part, operation in zip(kept[1], operations):
            part.value64 = operation[2]  # the call copies the structs: reuse is safe after it
        self._make_current()
        for batch in kept[0]:
            _call(driver.cuStreamBatchMemOp, stream, len(batch), batch, 0)

    def _memop_batch(self, key: Tuple[Tuple[MemOp, Any], ...]) -> tuple:
        """The kept batches of one list of (kind, address): (the params of each batch of
        up to 255, every entry's value part in order); the oldest list goes first."""
        entries = [_memop(kind, address) for kind, address in key]
        params = [entry[0] for entry in entries]
        return _keep(self._memop_params, key,
                     ([params[start:start + _MAX_BATCH_MEMOPS]
                       for start in range(0, len(params), _MAX_BATCH_MEMOPS)],
                      [entry[1] for entry in entries]),
                     _MEMOP_BATCHES)

    # -- lifetime ----------------------------------------------------------------------------
    def close(self, leak: bool = False) -> None:
        """Release everything this device created (see ``_release`` for the order); idempotent.

        Work still queued on streams keeps running; wait for it first.  Pointers from
        ``import_`` and this device's allocations are invalid afterwards.  With ``leak``
        nothing is freed: the handles are kept for the life of the process, for work
        that is stuck behind a stream that never finished and would write into them.
        """
        self._exports.clear()
        self._descriptors.clear()
        self._memop_params.clear()
        if leak and self._finalizer.alive:
            self._finalizer.detach()
            _ABANDONED.append(self._owned)
            self._owned = _Owned(self._device)  # context None: later use says "closed"
            return
        self._finalizer()
