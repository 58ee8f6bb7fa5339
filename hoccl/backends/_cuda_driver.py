"""The cuda backend's driver gateway: every CUDA driver call hoccl makes is checked here.

``_call(function, *args)`` calls a ``cuda.bindings.driver`` function and unpacks its
result; a failing status becomes a ``DriverError`` that names the call, the error and
what to do about it when that is known (``_HINTS``).  ``_status`` is for the calls whose
non-success statuses are answers (``CUDA_ERROR_NOT_READY``).  ``hoccl.backends.cuda`` and
its parts (``_cuda_memory``, ``_cuda_kernels``) are the only users."""

from __future__ import annotations

import threading
from typing import Any, Tuple

from cuda.bindings import driver

from .._errors import DriverError

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
_SINGLE_MEMOPS = 8  # up to this many memops go as single calls; more go as one batch
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


def _keep(kept: dict, key: Any, value: Any, most: int) -> Any:
    """``value`` kept under ``key`` in ``kept``, which holds at most ``most`` entries (the
    oldest goes first): the driver arguments a device builds once and reuses."""
    if len(kept) >= most:
        del kept[next(iter(kept))]
    kept[key] = value
    return value


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


_ACTIVE = threading.local()  # the context hoccl last made current on this thread
