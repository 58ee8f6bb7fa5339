"""Arrays of any framework (numpy, torch, cupy) as the phases of a hierarchical call
use them: flat views, scratch, staging through host memory, raw addresses."""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Tuple

import numpy as np

from .._dtypes import numpy_dtype
from ..backends._caller_stream import array_framework

__all__ = ["Arrays", "framework_array", "address"]


class Arrays:
    """Flat views, scratch, staging and division for one array framework (numpy, torch,
    cupy), each ordered on the stream given as a raw handle (None: the host backend)."""

    def __init__(self, kind: str):
        self.kind = kind

    @staticmethod
    def of(array: Any) -> "Arrays":
        return Arrays(array_framework([array]) or "numpy")

    def flat(self, array: Any) -> Any:
        return array.reshape(-1)

    def _stream(self, handle: Optional[int], like: Any) -> Any:
        """A context that makes ``handle`` (a stream of ``like``'s GPU) current (None: no
        stream, a host array)."""
        if handle is None:
            return contextlib.nullcontext()
        if self.kind == "torch":
            import torch
            return torch.cuda.stream(torch.cuda.ExternalStream(handle, device=like.device))
        import cupy
        return cupy.cuda.ExternalStream(handle)

    def empty(self, like: Any, count: int, stream: Optional[int]) -> Any:
        """``count`` elements of ``like``'s dtype on its device, allocated on ``stream``
        (the caching allocators reuse it only after the work later enqueued there)."""
        if self.kind == "numpy":
            return np.empty(count, like.dtype)
        if self.kind == "torch":
            import torch
            with self._stream(stream, like):
                return torch.empty(count, dtype=like.dtype, device=like.device)
        import cupy
        with cupy.cuda.Device(like.device.id), self._stream(stream, like):
            return cupy.empty(count, like.dtype)

    def to_host(self, view: Any) -> np.ndarray:
        """A numpy copy of ``view`` (whose stream work the caller has waited for)."""
        if self.kind == "numpy":
            return view
        if self.kind == "torch":
            import torch
            if view.dtype == torch.bfloat16:
                return view.view(torch.int16).cpu().numpy().view(numpy_dtype("bfloat16"))
            return view.cpu().numpy()
        return view.get()

    def from_host(self, view: Any, host: np.ndarray, stream: Optional[int]) -> None:
        """``view[...] = host``, ordered on ``stream`` (synchronous with the host)."""
        if self.kind == "numpy":
            if host is not view:
                view[...] = host
            return
        if self.kind == "torch":
            import torch
            if str(host.dtype) == "bfloat16":
                source = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
            else:
                source = torch.from_numpy(host)
            with self._stream(stream, view):
                view.copy_(source)
                torch.cuda.current_stream().synchronize()  # ``host`` may go once we return
            return
        stream_object = self._stream(stream, view)
        view.set(host, stream=stream_object)
        stream_object.synchronize()


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


