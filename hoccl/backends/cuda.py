"""The CUDA device backend: the only module in hoccl that calls the CUDA driver.

Everything hoccl does on a GPU goes through ``CudaDevice``: streams and events, memory,
IPC export and import, peer access, the zero-SM primitives (copies on copy engines,
``cuStreamWriteValue64`` / ``cuStreamWaitValue64`` signals) and the two SM kernels
(a capped same-GPU copy and the reduction).  Keeping the driver behind this one module
means the scheduler and the executor stay testable without a GPU (the host backend
implements the same ``Device`` interface), and every driver call is checked in one
place: ``_check`` turns a failing status into a ``DriverError`` that names the call,
the error and what to do about it when that is known.

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

import collections
import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from cuda.bindings import driver

from .._dtypes import ITEMSIZE as _ITEMSIZE
from .._errors import DriverError, HocclTimeoutError, InvalidArgumentError
from . import _kernels
from ._base import (DIRECT_COPY, DIRECT_REDUCE, DIRECT_SIGNAL, DIRECT_WAIT, DTYPES, OPS, Device,
                    DirectProgram, HostWord, MemOp, check_reduce_extras)
from ._caller_stream import array_framework, stream_handle

__all__ = ["CudaDevice", "CudaIpcDescriptor", "device_count", "open_device"]

log = logging.getLogger("hoccl")

_NOT_READY = driver.CUresult.CUDA_ERROR_NOT_READY
_PEER_ALREADY_ENABLED = driver.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
_ALREADY_MAPPED = driver.CUresult.CUDA_ERROR_ALREADY_MAPPED
#: statuses a teardown tolerates: the peer's context (or access to it) is already gone.
_GONE = (driver.CUresult.CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
         driver.CUresult.CUDA_ERROR_INVALID_CONTEXT,
         driver.CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED)
_LEGACY_STREAMS = (0, int(driver.CU_STREAM_LEGACY))
_BUFFER_ID = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID
#: cuStreamBatchMemOp takes fewer than 256 operations per call.
_MAX_BATCH_MEMOPS = 255
_SINGLE_MEMOPS = 8  # up to this many memops go as single calls (cheaper from Python)
_WRITE_DEFAULT = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
_WAIT_GEQ = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ

_HINTS = {
    driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY: "free GPU memory or use smaller buffers",
    driver.CUresult.CUDA_ERROR_PEER_ACCESS_UNSUPPORTED:
        "these GPUs cannot map each other's memory (see `nvidia-smi topo -m`)",
    driver.CUresult.CUDA_ERROR_TOO_MANY_PEERS: "a GPU can map at most 8 peers at once",
    driver.CUresult.CUDA_ERROR_NO_DEVICE: "no GPU is visible (check CUDA_VISIBLE_DEVICES)",
    driver.CUresult.CUDA_ERROR_INVALID_DEVICE: "the device ordinal is out of range",
    driver.CUresult.CUDA_ERROR_NOT_SUPPORTED:
        "the driver or GPU does not support this operation (64-bit stream memory "
        "operations need CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)",
    driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        "the handle belongs to another context (e.g. an IPC handle opened in the "
        "process that exported it)",
}


# -- the gateway ---------------------------------------------------------------------------
def _error(call_name: str, status: Any) -> DriverError:
    _, name = driver.cuGetErrorName(status)
    _, text = driver.cuGetErrorString(status)
    name = name.decode() if isinstance(name, bytes) else str(status)
    text = text.decode() if isinstance(text, bytes) else "unknown error"
    hint = _HINTS.get(status)
    return DriverError(f"{call_name} failed: {name} ({text})" + (f"; {hint}" if hint else ""))


def _check(result: tuple, call_name: str) -> Any:
    """Unpack a cuda-bindings result tuple ``(status, *values)``; raise unless success.

    Returns None, the single value, or the tuple of values.
    """
    if result[0]:
        raise _error(call_name, result[0])
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def _status(result: tuple, call_name: str, allow: Tuple[Any, ...]) -> Any:
    """The status of a call for which the statuses in ``allow`` are answers, not errors."""
    status = result[0]
    if status and status not in allow:
        raise _error(call_name, status)
    return status


def _call(function: Any, *args: Any) -> Any:
    """Call a driver function and check it; the error names the function."""
    return _check(function(*args), function.__name__)


_init_lock = threading.Lock()
_initialised = False


def _init_driver() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            _call(driver.cuInit, 0)
            _initialised = True


# -- kernels -------------------------------------------------------------------------------
def _function(module: Any, name: str) -> Any:
    """``name`` from a cupy ``RawModule``, loaded onto the GPU now.

    Under CUDA's lazy loading a kernel may otherwise be loaded at its first launch, and a
    load may synchronize the context: inside a collective, with this GPU's copy lanes
    waiting on a peer that is itself still issuing, that wait would never end."""
    function = driver.CUfunction(module.get_function(name).kernel.ptr)
    if hasattr(driver, "cuFuncLoad"):  # CUDA >= 12.4
        _call(driver.cuFuncLoad, function)
    return function


class _ReduceArgs(ctypes.Structure):
    """Mirror of ``ReduceArgs`` in ``_kernels``; passed by value to every reduce launch."""
    _fields_ = [("output", ctypes.c_void_p),
                ("inputs", ctypes.c_void_p * _kernels.MAX_INPUTS),
                ("count", ctypes.c_uint64),
                ("head", ctypes.c_uint64),
                ("vectors", ctypes.c_uint64),
                ("num_inputs", ctypes.c_uint32),
                ("divisor", ctypes.c_uint32),
                ("scaled", ctypes.c_uint32),
                ("scale", ctypes.c_double)]


class _ChunkArgs(ctypes.Structure):
    """Mirror of ``ChunkArgs`` in ``_kernels``: ``reduce_chunks``'s one launch."""
    _fields_ = [("first", _ReduceArgs),
                ("flags", ctypes.c_void_p * _kernels.CHUNK_FLAGS),
                ("num_flags", ctypes.c_uint64),
                ("value", ctypes.c_uint64),
                ("chunks", ctypes.c_uint64),
                ("stride", ctypes.c_uint64),
                ("last_count", ctypes.c_uint64),
                ("last_vectors", ctypes.c_uint64)]


class _CopyArgs(ctypes.Structure):
    """Mirror of ``CopyArgs`` in ``_kernels``."""
    _fields_ = [("dst", ctypes.c_void_p),
                ("src", ctypes.c_void_p),
                ("nbytes", ctypes.c_uint64),
                ("head", ctypes.c_uint64)]


class _DirectOp(ctypes.Structure):
    """Mirror of ``DirectOp`` in ``_kernels``."""
    _fields_ = [("a", ctypes.c_uint64), ("b", ctypes.c_uint64), ("c", ctypes.c_uint64),
                ("sa", ctypes.c_uint64), ("sb", ctypes.c_uint64),
                ("kind", ctypes.c_uint32), ("n", ctypes.c_uint32)]


class _DirectInput(ctypes.Structure):
    """Mirror of ``DirectInput`` in ``_kernels``."""
    _fields_ = [("address", ctypes.c_uint64), ("shift", ctypes.c_uint64)]


class _DirectArgs(ctypes.Structure):
    """Mirror of ``DirectArgs`` in ``_kernels``."""
    _fields_ = [("counter", ctypes.c_uint64),
                ("completion", ctypes.c_uint64),
                ("host_word", ctypes.c_uint64),
                ("value", ctypes.c_uint64),
                ("error", ctypes.c_uint64),
                ("signature", ctypes.c_uint64),
                ("sig_shift", ctypes.c_uint64),
                ("sig_half", ctypes.c_uint64),
                ("num_ops", ctypes.c_uint32),
                ("divisor", ctypes.c_uint32),
                ("scaled", ctypes.c_uint32),
                ("unused", ctypes.c_uint32),
                ("scale", ctypes.c_double),
                ("ops", _DirectOp * _kernels.DIRECT_OPS),
                ("inputs", _DirectInput * _kernels.DIRECT_INPUTS)]


def _pack_direct(program: DirectProgram) -> Tuple[_DirectArgs, Any]:
    """``program`` as the kernel's argument struct and the launch's parameter array."""
    ops = program.ops
    if len(ops) > _kernels.DIRECT_OPS:
        raise InvalidArgumentError(f"direct: a direct kernel takes at most {_kernels.DIRECT_OPS} "
                                   f"steps, the plan has {len(ops)}; lower kernel_bytes")
    args = _DirectArgs()
    args.counter = int(program.counter)
    args.completion = int(program.completion or 0)
    args.host_word = int(program.host_word or 0)
    args.error = int(program.error or 0)
    args.signature = program.signature
    args.sig_shift, args.sig_half = program.signature_shift, program.signature_half
    args.num_ops = len(ops)
    divisor = 1
    inputs: List[Tuple[int, int]] = []
    for index, op in enumerate(ops):
        entry = args.ops[index]
        entry.kind = op[0]
        if op[0] in (DIRECT_SIGNAL, DIRECT_WAIT):
            entry.a, entry.c = int(op[1]), op[2]
        elif op[0] == DIRECT_COPY:
            entry.a, entry.b, entry.c, entry.sa, entry.sb = (int(op[1]), int(op[2]), op[3],
                                                             op[4], op[5])
        else:
            assert op[0] == DIRECT_REDUCE
            entry.a, entry.b, entry.c, entry.n, entry.sa = (int(op[1]), len(inputs), op[3],
                                                            len(op[2]), op[4])
            inputs.extend((int(address), shift) for address, shift in op[2])
            divisor = len(op[2])
    if len(inputs) > _kernels.DIRECT_INPUTS:
        raise InvalidArgumentError(f"direct: a direct kernel reads at most "
                                   f"{_kernels.DIRECT_INPUTS} inputs, the plan has "
                                   f"{len(inputs)}; lower kernel_bytes")
    for index, (address, shift) in enumerate(inputs):
        args.inputs[index].address, args.inputs[index].shift = address, shift
    args.divisor = divisor
    args.scaled = program.scale is not None
    args.scale = 1.0 if program.scale is None else program.scale
    parameters = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    return args, parameters


class _Kernels:
    """The kernels of ``_kernels.source()`` in one GPU's primary context.

    cupy's ``RawModule`` compiles them with NVRTC for the GPU's architecture and keeps
    the binary in its on-disk kernel cache (``CUPY_CACHE_DIR``, ``~/.cupy/kernel_cache``
    by default) keyed by source, options and compiler; the loaded module lives as long
    as the process, like cupy's own kernels.
    """

    def __init__(self, ordinal: int):
        try:
            import cupy
        except ImportError as error:
            raise DriverError(
                "compile kernels: hoccl's reduction and copy kernels are built with cupy, "
                "which is not installed: pip install 'hoccl[cuda]'") from error
        with cupy.cuda.Device(ordinal):
            module = cupy.RawModule(code=_kernels.source(),
                                    options=tuple(_kernels.compile_options()))
            try:
                self.reduce = {(dtype, op): _function(module, _kernels.reduce_kernel_name(dtype, op))
                               for dtype in DTYPES for op in OPS}
                self.reduce_chunks = {
                    (dtype, op): _function(module, _kernels.reduce_chunks_kernel_name(dtype, op))
                    for dtype in DTYPES for op in OPS}
                self.copy = {width: _function(module, _kernels.copy_kernel_name(width))
                             for width in _kernels.COPY_WIDTHS}
            except cupy.cuda.compiler.CompileException as error:
                raise DriverError(f"compile kernels: NVRTC failed: {error}") from error
        self.module = module
        _ACTIVE.context = None  # cupy restored its own current device: set ours again


# -- owned handles -------------------------------------------------------------------------
class _PinnedWord(HostWord):
    """A 64-bit counter in pinned, device-mapped host memory."""

    def __init__(self, host_address: int, device_address: int):
        self._host_address = host_address
        self.address = device_address

    @property
    def value(self) -> int:
        if not self._host_address:
            raise InvalidArgumentError("HostWord.value: the device that owned this word is closed")
        return ctypes.c_uint64.from_address(self._host_address).value

    def __repr__(self) -> str:
        return f"<cuda HostWord at {self.address:#x}>"


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


_IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE


def _handle_bytes(handle: Any) -> bytes:
    """The 64 bytes of a ``CUipcMemHandle`` (cuda-bindings 13.3 has a ``reserved``
    field; 13.5 only ``getPtr``)."""
    reserved = getattr(handle, "reserved", None)
    if reserved is not None:
        return bytes(reserved)
    return ctypes.string_at(handle.getPtr(), _IPC_HANDLE_BYTES)


def _handle_from(data: bytes) -> Any:
    """A ``CUipcMemHandle`` holding ``data`` (see ``_handle_bytes``)."""
    handle = driver.CUipcMemHandle()
    if hasattr(handle, "reserved"):
        handle.reserved = data
    else:
        ctypes.memmove(handle.getPtr(), data, _IPC_HANDLE_BYTES)
    return handle


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


#: what ``export`` returns; a plain tuple on the wire (it pickles as a namedtuple).
CudaIpcDescriptor = collections.namedtuple(
    "CudaIpcDescriptor", ["kind", "handle", "base", "size", "buffer_id", "offset"])


# -- the device ----------------------------------------------------------------------------
_ACTIVE = threading.local()  # the context hoccl last made current on this thread
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


class CudaDevice(Device):
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
        self._memop_params: dict = {}  # (kind, address) -> CUstreamBatchMemOpParams

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
        self._make_current()
        least, greatest = _call(driver.cuCtxGetStreamPriorityRange)
        # Copy lanes default to the highest priority; HOCCL_LANE_PRIORITY=normal gives the
        # default priority (for measuring how SM work of reductions meets other kernels).
        self._priority = least if os.environ.get("HOCCL_LANE_PRIORITY") == "normal" else greatest
        # A private stream for setup work that must finish before a call returns.
        self._setup_stream = self.create_stream()
        self._batch_attributes = driver.CUmemcpyAttributes()
        self._batch_attributes.srcAccessOrder = \
            driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM

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
                return driver.CUstream(torch.cuda.current_stream(self.ordinal).cuda_stream)
            if framework == "cupy":
                cupy = sys.modules["cupy"]
                with cupy.cuda.Device(self.ordinal):
                    return driver.CUstream(cupy.cuda.get_current_stream().ptr)
            return driver.CUstream(driver.CU_STREAM_LEGACY)
        if isinstance(stream, driver.CUstream):
            return stream
        return driver.CUstream(stream_handle(stream))

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

    # -- memory ------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        self._make_current()
        address = int(_call(driver.cuMemAlloc, nbytes))
        self._owned.allocations.add(address)
        return address

    def free(self, address: int) -> None:
        address = int(address)
        owner = next((pool for pool in (self._owned.allocations, self._owned.pads)
                      if address in pool), None)
        if owner is None:
            raise InvalidArgumentError(
                "free: expected an address from this device's alloc or alloc_pad, "
                f"got {address:#x}")
        self._make_current()
        owner.discard(address)
        _call(driver.cuMemFree, address)

    def alloc_pad(self, slots: int) -> int:
        self._make_current()
        address = int(_call(driver.cuMemAlloc, slots * 8))
        self._owned.pads.add(address)
        # A small memset runs without SMs; on a private stream so that no caller's work waits.
        _call(driver.cuMemsetD32Async, address, 0, slots * 2, self._setup_stream)
        _call(driver.cuStreamSynchronize, self._setup_stream)
        return address

    def alloc_host_word(self) -> HostWord:
        self._make_current()
        flags = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
        host_address = int(_call(driver.cuMemHostAlloc, 8, flags))
        ctypes.c_uint64.from_address(host_address).value = 0
        try:
            device_address = int(_call(driver.cuMemHostGetDevicePointer, host_address, 0))
        except DriverError:
            _call(driver.cuMemFreeHost, host_address)
            raise
        word = _PinnedWord(host_address, device_address)
        self._owned.host_words.append(word)
        return word

    def export(self, address: int) -> CudaIpcDescriptor:
        """``("cuda-ipc", handle, base, size, buffer_id, offset)`` for the allocation
        holding ``address``; the handle of an allocation is made once and cached.

        A repeat costs one driver call: the allocation's buffer id, unique for the life
        of the process, tells a freed-and-reallocated address from the same allocation."""
        self._make_current()
        address = int(address)
        result = driver.cuPointerGetAttribute(_BUFFER_ID, address)
        if result[0]:
            raise InvalidArgumentError(
                "export: expected an address inside a CUDA device allocation, "
                f"got {address:#x} ({_error('cuPointerGetAttribute', result[0])})")
        buffer_id = int(result[1])
        descriptor = self._descriptors.get((address, buffer_id))
        if descriptor is not None:
            return descriptor
        base, size = _call(driver.cuMemGetAddressRange, address)
        base = int(base)
        entry = self._exports.get((base, buffer_id))
        if entry is None:
            capable = _call(
                driver.cuPointerGetAttribute,
                driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, address)
            if not int(capable):
                raise InvalidArgumentError(
                    f"export: the buffer at {address:#x} (allocation {base:#x}, {int(size)} bytes) "
                    "cannot be shared with cuIpcGetMemHandle; it must come from a cudaMalloc-style "
                    "allocation (cupy's default memory pool, torch's caching allocator without "
                    "expandable_segments, or hoccl's alloc), not from cuMemCreate/VMM or "
                    "expandable segments")
            handle = _call(driver.cuIpcGetMemHandle, base)
            entry = (_handle_bytes(handle), int(size))
            self._exports[(base, buffer_id)] = entry
        descriptor = CudaIpcDescriptor("cuda-ipc", entry[0], base, entry[1], buffer_id,
                                       address - base)
        if len(self._descriptors) > 4096:
            self._descriptors.clear()
        self._descriptors[(address, buffer_id)] = descriptor
        return descriptor

    def import_(self, descriptor: Any) -> int:
        key, address = self._map(descriptor)
        self._called.add(key)
        return address

    def hold_import(self, descriptor: Any) -> int:
        key, address = self._map(descriptor)
        self._holds[key] = self._holds.get(key, 0) + 1
        return address

    def drop_import(self, descriptor: Any) -> None:
        """Unmapped once no window holds it, unless a call mapped it too: calls' bound
        programs may still address it, so it stays until ``close``."""
        key, _ = self._key(descriptor)
        holds = self._holds.pop(key, 0) - 1
        if holds > 0:
            self._holds[key] = holds
        elif key not in self._called:
            self._close_import(key)

    @staticmethod
    def _key(descriptor: Any) -> Tuple[tuple, int]:
        if not (isinstance(descriptor, tuple) and len(descriptor) == 6
                and descriptor[0] == "cuda-ipc"):
            raise InvalidArgumentError(
                "import_: expected a ('cuda-ipc', handle, base, size, buffer_id, offset) "
                f"descriptor from CudaDevice.export, got {type(descriptor).__name__}")
        _, handle, base, size, buffer_id, offset = descriptor
        return (handle, base, buffer_id, int(size)), offset

    def _map(self, descriptor: Any) -> Tuple[tuple, int]:
        """(cache key, local address) of a peer's exported buffer, mapped on first use.

        A key is (handle, allocation base, buffer id, allocation size).  When the
        exporter frees an allocation and makes a new one over the same addresses, opening
        the new one's handle fails with CUDA_ERROR_ALREADY_MAPPED while this process still
        maps the old one (seen with two ranks on one GPU, and under split): a cached
        mapping of an exporter range that overlaps the new one, under another buffer id,
        is of freed memory (the exporter's calls on it, and so this rank's, have
        finished), so it is closed and the handle opened again."""
        key, offset = self._key(descriptor)
        imports = self._owned.imports
        mapped = imports.get(key)
        if mapped is None:
            self._make_current()
            ipc_handle = _handle_from(key[0])
            flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            result = driver.cuIpcOpenMemHandle(ipc_handle, flags)
            if result[0] == _ALREADY_MAPPED:
                _, base, _, size = key
                stale = [other for other in imports if other != key
                         and other[1] < base + size and base < other[1] + other[3]]
                for other in stale:
                    self._close_import(other)
                log.debug("import: closed %d stale mapping(s) over %#x (+%d) and retried",
                          len(stale), base, size)
                result = driver.cuIpcOpenMemHandle(ipc_handle, flags)
            mapped = int(_check(result, "cuIpcOpenMemHandle"))
            imports[key] = mapped
        return key, mapped + offset

    def _close_import(self, key: tuple) -> None:
        mapped = self._owned.imports.pop(key, None)
        self._called.discard(key)
        self._holds.pop(key, None)
        if mapped is not None:
            self._make_current()
            _call(driver.cuIpcCloseMemHandle, mapped)

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
        """Writes and waits in order: a few as single calls, more in batches of up to 255.
        Through cuda-bindings a batch costs more host time than a few single calls (its
        ``CUstreamBatchMemOpParams`` are Python objects filled per operation), so batching
        pays only beyond ``_SINGLE_MEMOPS`` operations; ``tools/profile_call.py`` times
        both."""
        if len(operations) <= _SINGLE_MEMOPS:
            self._make_current()
            for kind, address, value in operations:
                if kind is MemOp.WRITE:
                    _call(driver.cuStreamWriteValue64, stream, address, value, _WRITE_DEFAULT)
                else:
                    _call(driver.cuStreamWaitValue64, stream, address, value, _WAIT_GEQ)
            return
        params = []
        cache, used = self._memop_params, set()
        for kind, address, value in operations:
            key = (kind, address)
            entry = cache.get(key)
            if entry is None or key in used:  # one object twice in a batch: one value
                entry = _memop(kind, address)
                cache.setdefault(key, entry)
            used.add(key)
            entry[1].value64 = value  # the call copies the structs: reuse is safe after it
            params.append(entry[0])
        self._make_current()
        for start in range(0, len(params), _MAX_BATCH_MEMOPS):
            chunk = params[start:start + _MAX_BATCH_MEMOPS]
            _call(driver.cuStreamBatchMemOp, stream, len(chunk), chunk, 0)

    # -- SM work -----------------------------------------------------------------------------
    def _kernels(self) -> _Kernels:
        kernels = self._owned.kernels
        if kernels is None:
            with self._kernel_lock:
                if self._owned.kernels is None:
                    self._make_current()
                    self._owned.kernels = _Kernels(self.ordinal)
                kernels = self._owned.kernels
        return kernels

    def prepare_direct(self, dtype: str, op: str) -> None:
        """Compile (NVRTC through cupy, cached on disk) and load the direct kernel of
        ``dtype`` and ``op``, once per device."""
        key = (dtype, op)
        if key in self._owned.direct:
            return
        try:
            import cupy
        except ImportError as error:
            raise DriverError("compile kernels: hoccl's direct kernel is built with cupy, "
                              "which is not installed: pip install 'hoccl[cuda]'") from error
        with self._kernel_lock:
            if key in self._owned.direct:
                return
            self._make_current()
            with cupy.cuda.Device(self.ordinal):
                module = cupy.RawModule(code=_kernels.direct_source(dtype, op),
                                        options=tuple(_kernels.direct_compile_options()))
                try:
                    function = _function(module, _kernels.direct_kernel_name(dtype, op))
                except cupy.cuda.compiler.CompileException as error:
                    raise DriverError(f"compile kernels: NVRTC failed: {error}") from error
            _ACTIVE.context = None  # cupy restored its own current device: set ours again
            self._owned.direct[key] = (module, function)

    def direct(self, stream: Any, program: DirectProgram, value: int = 0) -> None:
        """One launch of the direct kernel: ``program.blocks`` blocks, its steps packed
        once into the argument struct (passed by value: the driver copies it during the
        call, so the call's completion value is set in place)."""
        packed = program.packed
        if packed is None:
            packed = program.packed = _pack_direct(program)
        packed[0].value = value
        entry = self._owned.direct.get((program.dtype, program.op))
        if entry is None:  # prepared by ``Executor.reserve``; here only if that was skipped
            self.prepare_direct(program.dtype, program.op)
            entry = self._owned.direct[(program.dtype, program.op)]
        self._make_current()
        _call(driver.cuLaunchKernel, entry[1], program.blocks, 1, 1, _kernels.DIRECT_THREADS,
              1, 1, 0, stream, ctypes.addressof(packed[1]), 0)

    def _blocks(self, work_items: int, threads: int, cap: int) -> int:
        return max(1, min(cap, self.sm_count, -(-work_items // threads)))

    def _launch(self, function: Any, blocks: int, threads: int, stream: Any,
                args: ctypes.Structure) -> None:
        # The driver copies the argument struct during the call: no lifetime to manage.
        parameters = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        _call(driver.cuLaunchKernel, function, blocks, 1, 1, threads, 1, 1, 0, stream,
              ctypes.addressof(parameters), 0)

    def local_copy(self, stream: Any, dst: Any, src: Any, nbytes: int,
                   sms: Optional[int] = None) -> None:
        """A same-GPU copy on at most ``sms`` (default ``copy_sms``) SMs (``cuMemcpyAsync``
        would take them all)."""
        if not nbytes:
            return
        dst, src = int(dst), int(src)
        width = next(width for width in _kernels.COPY_WIDTHS if dst % width == src % width)
        head = min(nbytes, -dst % width)
        kernels = self._kernels()
        self._make_current()
        threads = _kernels.TUNING["copy_threads"]
        blocks = self._blocks((nbytes - head) // width, threads,
                             self.copy_sms if sms is None else sms)
        self._launch(kernels.copy[width], blocks, threads, stream,
                     _CopyArgs(dst, src, nbytes, head))

    def reduce(self, stream: Any, output: Any, inputs: Sequence[Any], count: int,
               dtype: str, op: str, divisor: Optional[int] = None,
               sms: Optional[int] = None, scale: Optional[float] = None) -> None:
        """``output = op(*inputs)`` on at most ``sms`` (default ``max_sms``) SMs; ``output``
        may be an input.  ``avg`` divides by ``divisor`` (default: the number of inputs);
        a ``sum`` with ``scale`` is multiplied by it before rounding.

        Up to 64 inputs per launch; more are chained (the output joins the next launch
        as its first input; ``avg`` sums until the last launch divides by the total, and
        only the last launch scales).
        The first launch overwrites ``output``: when an input equal to it lies beyond the
        first launch, the inputs equal to ``output`` are moved to the front, so that the
        first launch reads them (``_kernels.reduce_launches``).
        """
        if dtype not in _ITEMSIZE:
            raise InvalidArgumentError(f"reduce: expected dtype in {DTYPES}, got {dtype!r}")
        if op not in OPS:
            raise InvalidArgumentError(f"reduce: expected op in {OPS}, got {op!r}")
        if not inputs:
            raise InvalidArgumentError("reduce: expected at least one input, got none")
        check_reduce_extras(op, dtype, divisor, scale)
        if divisor is None:
            divisor = len(inputs)
        if not count:
            return
        itemsize = _ITEMSIZE[dtype]
        output = int(output)
        inputs = [int(address) for address in inputs]
        misaligned = [address for address in [output] + inputs if address % itemsize]
        if misaligned:
            raise InvalidArgumentError(
                f"reduce: expected addresses aligned to the {itemsize}-byte {dtype} elements, "
                f"got {', '.join(f'{address:#x}' for address in misaligned)}")
        launches = _kernels.reduce_launches(output, inputs)
        kernels = self._kernels()
        self._make_current()
        last = len(launches) - 1
        for index, launch_inputs in enumerate(launches):
            kernel_op = "sum" if op == "avg" and index < last else op
            self._launch_reduce(kernels.reduce[dtype, kernel_op], stream, output, launch_inputs,
                                count, itemsize, divisor, self.max_sms if sms is None else sms,
                                scale if index == last else None)

    def reduce_chunks(self, stream: Any, flags: Sequence[Any], value: int, output: Any,
                      inputs: Sequence[Any], count: int, last_count: int, chunks: int,
                      stride: int, dtype: str, op: str, sms: Optional[int] = None,
                      scale: Optional[float] = None) -> None:
        """``Device.reduce_chunks`` as one launch of ``hoccl_reduce_chunks_*``: its blocks
        wait on the device for each chunk's signal (``_kernels.ChunkArgs``)."""
        if dtype not in _ITEMSIZE or op not in OPS:
            raise InvalidArgumentError(f"reduce_chunks: expected dtype in {DTYPES} and op in "
                                       f"{OPS}, got {dtype!r}, {op!r}")
        itemsize = _ITEMSIZE[dtype]
        if (not inputs or len(inputs) > _kernels.MAX_INPUTS or (stride * itemsize) % 16
                or not 0 < len(flags) <= _kernels.CHUNK_FLAGS):
            raise InvalidArgumentError(
                f"reduce_chunks: expected 1 to {_kernels.MAX_INPUTS} inputs, 1 to "
                f"{_kernels.CHUNK_FLAGS} flags and a stride of whole 16-byte vectors, got "
                f"{len(inputs)} inputs, {len(flags)} flags and {stride} elements of "
                f"{itemsize} bytes")
        check_reduce_extras(op, dtype, None, scale)
        if not chunks or not count:
            return
        output = int(output)
        inputs = [int(address) for address in inputs]
        first, blocks, threads = self._reduce_arguments(
            output, inputs, count, itemsize, len(inputs), self.max_sms if sms is None else sms,
            scale)
        if first.vectors:
            lead = min(last_count, first.head)
            last_vectors = (last_count - lead) * itemsize // 16
        else:  # mutually misaligned: element by element, in every chunk alike
            last_vectors = 0
        args = _ChunkArgs(first, (ctypes.c_void_p * _kernels.CHUNK_FLAGS)(*map(int, flags)),
                          len(flags), value, chunks, stride, last_count, last_vectors)
        self._make_current()
        self._launch(self._kernels().reduce_chunks[dtype, op], blocks, threads, stream, args)

    def _reduce_arguments(self, output: int, inputs: list, count: int, itemsize: int,
                          divisor: int, sms: int, scale: Optional[float] = None,
                          threads: Optional[int] = None) -> Tuple[_ReduceArgs, int, int]:
        """``(argument struct, blocks, threads)`` of one reduce launch: the struct the
        kernel receives by value and its grid, capped at ``sms`` blocks of ``threads``
        (default ``TUNING["reduce_threads"]``).  Apart from the launch so that programs
        that build kernels on ``reduce_body`` (``benchmarks/levers.py``) size them alike."""
        if threads is None:
            threads = _kernels.TUNING["reduce_threads"]
        offset = output % 16
        if all(address % 16 == offset for address in inputs):
            head = min(count, (-output % 16) // itemsize)
            vectors = (count - head) * itemsize // 16
        else:  # mutually misaligned: element by element
            head, vectors = count, 0
        scalars = count - vectors * 16 // itemsize
        args = _ReduceArgs(output, (ctypes.c_void_p * _kernels.MAX_INPUTS)(*inputs), count,
                           head, vectors, len(inputs), divisor, scale is not None,
                           1.0 if scale is None else scale)
        return args, self._blocks(max(vectors, scalars), threads, sms), threads

    def _launch_reduce(self, function: Any, stream: Any, output: int, inputs: list, count: int,
                       itemsize: int, divisor: int, sms: int,
                       scale: Optional[float] = None, threads: Optional[int] = None) -> None:
        args, blocks, threads = self._reduce_arguments(output, inputs, count, itemsize, divisor,
                                                       sms, scale, threads)
        self._launch(function, blocks, threads, stream, args)

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

