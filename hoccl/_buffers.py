"""Buffer and array resolution: turn a user's array into (address, nbytes, dtype, device).

Accepted: numpy arrays (host backend), cupy arrays, torch tensors, and any object
with ``__cuda_array_interface__`` or ``__dlpack__``.  Only C-contiguous memory is
accepted, since blocks are contiguous slices of the flattened array.  Framework
modules are never imported here: an array is recognised by its own attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ._dtypes import ITEMSIZE, dtype_name
from ._errors import InvalidArgumentError

__all__ = ["Buffer", "as_buffer"]

_TYPESTR = {"<f2": "float16", "<f4": "float32", "<f8": "float64", "|i1": "int8", "|u1": "uint8",
            "<i4": "int32", "<i8": "int64", "<V2": "bfloat16", "|b1": "uint8"}


@dataclass(frozen=True)
class Buffer:
    """A contiguous array as hoccl sees it.  ``owner`` keeps the array alive."""
    address: int
    count: int
    dtype: str
    device: Optional[int]  # CUDA ordinal, or None for host memory
    owner: Any

    @property
    def nbytes(self) -> int:
        return self.count * ITEMSIZE[self.dtype]

    def block(self, index: int, count: int) -> "Buffer":
        """Elements ``[index*count, (index+1)*count)`` as a Buffer."""
        offset = index * count * ITEMSIZE[self.dtype]
        return Buffer(self.address + offset, count, self.dtype, self.device, self.owner)


def _check_dtype(call: str, name: str, dtype: Any) -> str:
    normalized = dtype_name(dtype)
    if normalized not in ITEMSIZE:
        raise InvalidArgumentError(f"{call}: {name} has dtype {dtype}; expected one of "
                                   f"{', '.join(ITEMSIZE)}")
    return normalized


def _not_contiguous(call: str, name: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{call}: {name} must be C-contiguous (blocks are contiguous "
                                f"slices of the flattened array); pass a contiguous copy")


def as_buffer(call: str, name: str, array: Any) -> Buffer:
    """Resolve ``array`` or raise InvalidArgumentError naming ``call`` and the argument."""
    module = type(array).__module__.split(".")[0]
    if isinstance(array, np.ndarray):
        if not array.flags.c_contiguous:
            raise _not_contiguous(call, name)
        dtype = _check_dtype(call, name, array.dtype)
        return Buffer(array.ctypes.data, array.size, dtype, None, array)
    if module == "torch":
        if not array.is_contiguous():
            raise _not_contiguous(call, name)
        dtype = _check_dtype(call, name, array.dtype)
        device = array.device.index if array.device.type == "cuda" else None
        if array.device.type not in ("cuda", "cpu"):
            raise InvalidArgumentError(f"{call}: {name} is on device {array.device}; "
                                       f"expected a CUDA or CPU tensor")
        return Buffer(array.data_ptr(), array.numel(), dtype, device, array)
    if module == "cupy":
        if not array.flags.c_contiguous:
            raise _not_contiguous(call, name)
        dtype = _check_dtype(call, name, array.dtype)
        return Buffer(array.data.ptr, array.size, dtype, array.device.id, array)
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is not None:
        shape = tuple(interface["shape"])
        typestr = interface["typestr"]
        dtype = _TYPESTR.get(typestr)
        if dtype is None:
            raise InvalidArgumentError(f"{call}: {name} has typestr {typestr!r}; expected one of "
                                       f"{sorted(_TYPESTR)}")
        count = int(np.prod(shape)) if shape else 1
        strides = interface.get("strides")
        if strides is not None and count > 1:
            expected, item = [], ITEMSIZE[dtype]
            for extent in reversed(shape):
                expected.insert(0, item)
                item *= extent
            if tuple(strides) != tuple(expected):
                raise _not_contiguous(call, name)
        return Buffer(int(interface["data"][0]), count, dtype, _cai_device(array, interface), array)
    if hasattr(array, "__dlpack__"):
        device_type, device_id = array.__dlpack_device__()
        if int(device_type) == 1:  # kDLCPU
            return as_buffer(call, name, np.from_dlpack(array))
        if int(device_type) == 2:  # kDLCUDA
            import cupy
            with cupy.cuda.Device(device_id):
                return as_buffer(call, name, cupy.from_dlpack(array))
        raise InvalidArgumentError(f"{call}: {name} is a DLPack array on device type "
                                   f"{device_type}; expected CPU (1) or CUDA (2)")
    raise InvalidArgumentError(f"{call}: {name} must be a numpy/cupy array, a torch tensor, or "
                               f"an object with __cuda_array_interface__ or __dlpack__; "
                               f"got {type(array).__name__}")


def _cai_device(array: Any, interface: dict) -> Optional[int]:
    device = getattr(array, "device", None)
    ordinal = getattr(device, "id", None)
    if isinstance(ordinal, int):
        return ordinal
    return interface.get("device")  # optional extension; the communicator's device otherwise
