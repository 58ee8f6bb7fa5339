"""Arrays of any framework (numpy, torch, cupy) as the phases of a hierarchical call
use them: flat views, scratch, the caller's stream, raw addresses."""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Tuple

import numpy as np

from ..backends._caller_stream import array_framework

__all__ = ["Arrays", "framework_array", "address", "torch_stream"]


class Arrays:
    """Flat views and scratch for one array framework (numpy, torch, cupy), each ordered
    on the stream given as a raw handle (None: the host backend)."""

    def __init__(self, kind: str):
        self.kind = kind

    @staticmethod
    def of(array: Any) -> "Arrays":
        return Arrays(array_framework([array]) or "numpy")

    def flat(self, array: Any) -> Any:
        return array.reshape(-1)

    def on_stream(self, handle: Optional[int], like: Any) -> Any:
        """A context that makes ``handle`` (a stream of ``like``'s GPU) current (None: no
        stream, a host array)."""
        if handle is None:
            return contextlib.nullcontext()
        if self.kind == "torch":
            import torch
            return torch.cuda.stream(torch_stream(torch, handle, like.device))
        import cupy
        return cupy.cuda.ExternalStream(handle)

    def empty(self, like: Any, count: int, stream: Optional[int]) -> Any:
        """``count`` elements of ``like``'s dtype on its device, allocated on ``stream``
        (the caching allocators reuse it only after the work later enqueued there)."""
        if self.kind == "numpy":
            return np.empty(count, like.dtype)
        if self.kind == "torch":
            import torch
            with self.on_stream(stream, like):
                return torch.empty(count, dtype=like.dtype, device=like.device)
        import cupy
        with cupy.cuda.Device(like.device.id), self.on_stream(stream, like):
            return cupy.empty(count, like.dtype)


#: the raw handles of the null stream and of ``CU_STREAM_LEGACY``: torch's default stream
_NULL_STREAMS = (0, 1)


def torch_stream(torch: Any, handle: int, device: Any = None) -> Any:
    """torch's stream object for the raw stream ``handle`` on ``device``, for work that
    must be ordered with what hoccl enqueues on that handle.

    ``torch.cuda.ExternalStream(0)`` is not the null stream: torch reads a ``stream_ptr``
    of 0 as "none given" and hands out a stream from its pool, unordered with the null
    stream (torch's pool streams are non-blocking).  The null stream and
    ``CU_STREAM_LEGACY`` are torch's default stream (torch runs on the legacy default
    stream); the current stream is itself; any other handle is wrapped."""
    current = torch.cuda.current_stream(device)
    if current.cuda_stream == handle:
        return current
    if handle in _NULL_STREAMS:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(handle, device=device)


def framework_array(array: Any) -> Any:
    """``array``, or a cupy view of a device array of another kind (any object with
    ``__cuda_array_interface__``), so that phases can slice it."""
    if isinstance(array, np.ndarray) or array_framework([array]) is not None:
        return array
    import cupy
    return cupy.asarray(array)


def address(array: Any) -> Tuple[int, int]:
    """(address, nbytes) of a flat array of any framework."""
    if isinstance(array, np.ndarray):
        return array.ctypes.data, array.nbytes
    if array_framework([array]) == "torch":
        return array.data_ptr(), array.numel() * array.element_size()
    return array.data.ptr, array.nbytes


