"""Which stream the caller meant: the pure half of ``CudaDevice.resolve_stream``.

``CudaDevice.resolve_stream`` asks the two functions here what the caller's ``stream=``
argument and arrays stand for, then turns the answer into a ``CUstream`` (querying the
framework's current stream where that is the answer).  Nothing here touches the driver,
so the decisions are tested on CPU with fake streams and arrays.

Streams and arrays are recognised by protocol, never by the name of the module their
type comes from, and no framework is imported to recognise its objects: a torch tensor
exists only if torch is in ``sys.modules`` already.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Literal

from .._errors import InvalidArgumentError

__all__ = ["array_framework", "stream_handle"]

Framework = Literal["torch", "cupy"]


def array_framework(arrays: Sequence[Any]) -> Framework | None:
    """The framework whose current stream ``stream=None`` means for ``arrays``: that of
    the first torch tensor or cupy array among them, or None (numpy arrays, other
    ``__cuda_array_interface__`` objects: the caller's default stream)."""
    torch = sys.modules.get("torch")
    cupy = sys.modules.get("cupy")
    if torch is None and cupy is None:
        return None
    for array in arrays:
        if torch is not None and isinstance(array, torch.Tensor):
            return "torch"
        if cupy is not None and isinstance(array, cupy.ndarray):
            return "cupy"
    return None


def stream_handle(stream: Any) -> int:
    """The raw ``CUstream`` handle of a stream given as ``stream=``, other than None.

    In order: an int handle; the CUDA stream protocol, ``__cuda_stream__()`` returning
    ``(0, handle)`` (torch streams, cuda.core, cuda.bindings); then a stream object (one
    with ``wait_event``) holding its handle in ``ptr`` (``cupy.cuda.Stream``, which has no
    ``__cuda_stream__`` yet) or in ``cuda_stream`` (``torch.cuda.Stream`` of torch
    versions before the protocol).  ``wait_event`` is asked for because a cupy memory
    pointer has a ``ptr`` too.
    """
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        version, handle = protocol() if callable(protocol) else protocol
        if version != 0:
            raise InvalidArgumentError(
                f"resolve_stream: expected __cuda_stream__ version 0, got version {version!r} "
                f"from {_type_name(stream)}")
        return int(handle)
    if hasattr(stream, "wait_event"):
        handle = getattr(stream, "ptr", None)
        if handle is None:
            handle = getattr(stream, "cuda_stream", None)
        if isinstance(handle, int) and not isinstance(handle, bool):
            return handle
    raise InvalidArgumentError(
        "resolve_stream: expected None, an int stream handle, a CUstream, an object with "
        "__cuda_stream__, or a stream object (with wait_event) whose int ptr (cupy) or "
        f"cuda_stream (torch) attribute is its handle; got {_type_name(stream)}")


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"
