"""Buffer resolution: turn a user's array into (address, count, dtype, device).

Accepted: numpy arrays and torch tensors, and any object with ``__cuda_array_interface__``
(cupy arrays, numba device arrays) or ``__dlpack__``.  Each is read through its own
interface: numpy's dtype and flags, torch's dtype and ``data_ptr``, the interface dict's
typestr, shape, strides and data, and the DLPack tensor struct itself.  Framework modules
are never imported here: a torch tensor is recognised only once torch is imported.

Rules every kind of array follows:

* Only C-contiguous memory: blocks are contiguous slices of the flattened array.
* A buffer hoccl writes into (``writable=True``) must be writable.  Refused: numpy arrays
  with ``writeable=False``, an array interface whose ``data[1]`` (read-only) is true, a
  DLPack tensor flagged ``DLPACK_FLAG_BITMASK_READ_ONLY``, and a torch tensor that requires
  grad while grad mode is on (torch refuses the same in-place write to a leaf; autograd
  would not see hoccl's write).  hoccl never writes a send buffer, so it may be read-only.
* bool is not a hoccl dtype (NCCL has none either).  A bool array moves as uint8 bytes in
  collectives that only copy, as torch's NCCL backend moves it (``ncclUint8``), and is
  refused in reductions (``reduction=True``): bytes of bools summed are not bools.  To
  reduce bools, pass a uint8 view: ``max`` is then logical or and ``min`` logical and.
* A description is refused unless it describes a range of memory: a data pointer that
  is not null (unless the array is empty), extents that are ints >= 0, one stride per
  dimension, an end below 2**63 (``_checked_memory``); hoccl then touches only that
  range.  Whether the range is the producer's memory cannot be checked here.
* No synchronisation here: hoccl orders its work after the caller's ``stream`` only, so
  it asks DLPack producers for none (``stream=-1``) and ignores an array interface's
  ``stream`` entry.
"""

from __future__ import annotations

import ctypes
import math
import operator
import sys
from typing import Any, Mapping, Optional, Sequence, Tuple, cast

import numpy as np

from . import _dtypes
from ._dtypes import BOOL, ITEMSIZE, NAMES
from ._errors import InvalidArgumentError

__all__ = ["Buffer", "as_buffer", "repeat_key", "integer", "integers", "ADDRESS_END"]


class Buffer:
    """A contiguous array as hoccl sees it.  ``owner`` keeps the array alive.

    Every call makes two or three of these, so it is a plain class with slots (a frozen
    dataclass takes three times as long to build); nothing changes one once built."""

    __slots__ = ("address", "count", "dtype", "itemsize", "device", "owner")

    def __init__(self, address: int, count: int, dtype: str, device: Optional[int], owner: Any):
        self.address = address
        self.count = count
        self.dtype = dtype
        self.itemsize: int = ITEMSIZE[dtype]
        self.device = device  # CUDA ordinal, or None for host memory
        self.owner = owner

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    def block(self, index: int, count: int) -> "Buffer":
        """Elements ``[index*count, (index+1)*count)`` as a Buffer."""
        return Buffer(self.address + index * count * self.itemsize, count, self.dtype,
                      self.device, self.owner)

    def __repr__(self) -> str:
        return (f"Buffer(address={self.address:#x}, count={self.count}, dtype={self.dtype}, "
                f"device={self.device})")


def as_buffer(call: str, name: str, array: Any, *, writable: bool = True,
              reduction: bool = True) -> Buffer:
    """Resolve ``array`` or raise InvalidArgumentError naming ``call`` and the argument.

    ``writable``: hoccl writes into the buffer (every receive buffer; a send buffer is
    only read).  ``reduction``: hoccl combines its elements (both buffers of all_reduce,
    reduce_scatter and reduce); bool arrays are refused there.  Both default to the
    stricter answer.
    """
    if isinstance(array, np.ndarray):
        dtype = _dtype_name(call, name, _dtypes.from_numpy(array.dtype), array.dtype, reduction)
        flags = array.flags
        if not flags.c_contiguous:
            raise _not_contiguous(call, name)
        if writable and not flags.writeable:
            raise _read_only(call, name, "numpy writeable=False")
        return Buffer(array.ctypes.data, array.size, dtype, None, array)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        return _from_torch(call, name, array, torch, writable, reduction)
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is not None:
        return _from_array_interface(call, name, array, interface, writable, reduction)
    if hasattr(array, "__dlpack__"):
        return _from_dlpack(call, name, array, writable, reduction)
    raise InvalidArgumentError(f"{call}: {name} must be a numpy array, a torch tensor, or an "
                               f"object with __cuda_array_interface__ or __dlpack__; got "
                               f"{type(array).__name__}")


def repeat_key(array: Any) -> Any:
    """What ``as_buffer`` decides ``array``'s Buffer from, as a hashable key, read cheaply:
    two arrays of one key resolve alike (the same address, count, dtype and device, the
    same verdicts), so a call repeated on such arrays needs no resolution
    (``hoccl._api``).  None where the array's answer could change without its key
    changing (a torch tensor that requires grad: grad mode decides) or where the kind is
    not read cheaply (other array interfaces, DLPack): those calls resolve every time."""
    kind = type(array)
    if kind is np.ndarray:
        flags = array.flags
        return (kind, array.__array_interface__["data"][0], array.size, array.dtype,
                flags.c_contiguous, flags.writeable)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        if array.requires_grad:
            return None
        return (torch.Tensor, array.data_ptr(), array.numel(), array.dtype, array.device,
                array.layout, array.is_contiguous())
    cupy = sys.modules.get("cupy")
    if cupy is not None and kind is cupy.ndarray:  # always writable
        return (kind, array.data.ptr, array.size, array.dtype, array.device.id,
                array.flags.c_contiguous)
    return None


def _from_torch(call: str, name: str, tensor: Any, torch: Any, writable: bool,
                reduction: bool) -> Buffer:
    dtype = _dtype_name(call, name, _dtypes.from_torch(tensor.dtype), tensor.dtype, reduction)
    if tensor.is_cuda:
        device = tensor.get_device()
    elif tensor.is_cpu:
        device = None
    else:
        raise InvalidArgumentError(f"{call}: {name} is on device {tensor.device}; expected a "
                                   f"CUDA or CPU tensor")
    if not tensor.is_contiguous():
        raise _not_contiguous(call, name)
    if writable and tensor.requires_grad and torch.is_grad_enabled():
        raise InvalidArgumentError(
            f"{call}: {name} requires grad (torch requires_grad=True) and hoccl writes into it, "
            f"which autograd cannot record; pass tensor.detach() or call under torch.no_grad()")
    return Buffer(tensor.data_ptr(), tensor.numel(), dtype, device, tensor)


def _from_array_interface(call: str, name: str, array: Any, interface: Any, writable: bool,
                          reduction: bool) -> Buffer:
    what = f"{name}'s __cuda_array_interface__"
    if not isinstance(interface, Mapping):
        raise InvalidArgumentError(f"{call}: {what} must be a dict; got "
                                   f"{type(interface).__name__}")
    missing = [key for key in ("typestr", "shape", "data") if key not in interface]
    if missing:
        raise InvalidArgumentError(f"{call}: {what} has no {', '.join(map(repr, missing))}; "
                                   f"expected the keys typestr, shape and data")
    typestr = interface["typestr"]
    found = _dtypes.from_typestr(typestr) if isinstance(typestr, str) else None
    dtype = _dtype_name(call, name, found, f"typestr {typestr!r}", reduction)
    if interface.get("mask") is not None:
        raise InvalidArgumentError(f"{call}: {what} has a mask; expected mask None (hoccl "
                                   f"moves every element)")
    shape = _extents(call, what, "shape", interface["shape"])
    strides = interface.get("strides")
    if strides is not None:
        strides = _extents(call, what, "strides", strides, len(shape), signed=True)
        if not _c_contiguous(shape, strides, ITEMSIZE[dtype]):
            raise _not_contiguous(call, name)
    data = interface["data"]
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise InvalidArgumentError(f"{call}: {what} data must be a pair (address, read_only); "
                                   f"got {data!r}")
    address, read_only = integer(data[0]), data[1]
    if writable and read_only:
        raise _read_only(call, name, "__cuda_array_interface__ data[1] is True")
    address, count = _checked_memory(call, what, address, data[0], shape, ITEMSIZE[dtype])
    return Buffer(address, count, dtype, _interface_device(call, what, array, interface),
                  array)


def _interface_device(call: str, what: str, array: Any, interface: Mapping) -> Optional[int]:
    """The array's ``device.id`` (cupy), else the interface's optional ``device`` entry;
    None when neither says."""
    ordinal = getattr(getattr(array, "device", None), "id", None)
    if isinstance(ordinal, int):
        return ordinal
    given = interface.get("device")
    ordinal = integer(given)
    if given is not None and (ordinal is None or ordinal < 0):
        raise InvalidArgumentError(f"{call}: {what} device must be a CUDA ordinal (an int "
                                   f">= 0) or absent; got {given!r}")
    return ordinal


# -- DLPack (dlpack.h) -------------------------------------------------------------------
# numpy cannot import a bfloat16 DLPack tensor, and cupy neither imports bfloat16 nor
# checks the read-only flag, so hoccl reads the struct the capsule points to.
_DLPACK_CPU, _DLPACK_CUDA = 1, 2
_DLPACK_READ_ONLY, _DLPACK_IS_COPIED = 1 << 0, 1 << 1
_DLPACK_VERSION = (1, 0)  # the newest struct layout read here


class _DLTensor(ctypes.Structure):
    # DLDevice and DLDataType written out: the same offsets as the nested structs
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


# Own function objects: setting argtypes on ctypes.pythonapi's would change them for
# every other user of that shared object.
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def _from_dlpack(call: str, name: str, array: Any, writable: bool, reduction: bool) -> Buffer:
    where = array.__dlpack_device__()
    pair = integers(where) if isinstance(where, (tuple, list)) and len(where) == 2 else None
    if pair is None:
        raise InvalidArgumentError(f"{call}: {name}.__dlpack_device__() returned {where!r}; "
                                   f"expected (device type, device id), two ints")
    device_type, device_id = pair
    if device_type not in (_DLPACK_CPU, _DLPACK_CUDA):
        raise InvalidArgumentError(f"{call}: {name} is a DLPack array on device type "
                                   f"{device_type}; expected CPU (1) or CUDA (2)")
    stream = -1 if device_type == _DLPACK_CUDA else None
    try:
        try:
            capsule = array.__dlpack__(stream=stream, max_version=_DLPACK_VERSION, copy=False)
        except TypeError:  # a producer older than DLPack 1.0 (array API 2023.12)
            capsule = array.__dlpack__(stream=stream)
    except BufferError as error:
        raise InvalidArgumentError(f"{call}: {name} cannot be exported through DLPack: "
                                   f"{error}") from error
    if type(capsule).__name__ != "PyCapsule":
        raise InvalidArgumentError(f"{call}: {name}.__dlpack__() returned a "
                                   f"{type(capsule).__name__}; expected a DLPack capsule")
    kind = _capsule_name(capsule)
    if kind not in (b"dltensor_versioned", b"dltensor"):
        raise InvalidArgumentError(f"{call}: {name}.__dlpack__() returned a capsule named "
                                   f"{kind!r}; expected 'dltensor' or 'dltensor_versioned'")
    pointer = _capsule_pointer(capsule, kind)
    if kind == b"dltensor_versioned":
        managed = _DLManagedTensorVersioned.from_address(pointer)
        if managed.major > _DLPACK_VERSION[0]:
            raise InvalidArgumentError(f"{call}: {name} was exported as DLPack "
                                       f"{managed.major}.{managed.minor}; hoccl reads "
                                       f"{_DLPACK_VERSION[0]}.x")
        tensor, flags = managed.dl_tensor, managed.flags
    else:
        tensor, flags = _DLTensor.from_address(pointer), 0
    found = _dtypes.from_dlpack(tensor.code, tensor.bits, tensor.lanes)
    dtype = _dtype_name(call, name, found, f"DLPack type (code {tensor.code}, bits "
                        f"{tensor.bits}, lanes {tensor.lanes})", reduction)
    if flags & _DLPACK_IS_COPIED:
        raise InvalidArgumentError(f"{call}: {name} was exported as a copy (DLPack flag "
                                   f"IS_COPIED); pass an array hoccl can use in place")
    what = f"{name}'s DLPack tensor"
    ndim = tensor.ndim
    if not 0 <= ndim <= _MAX_DIMS or (ndim and not tensor.shape):
        raise InvalidArgumentError(f"{call}: {what} has ndim {ndim} and "
                                   f"{'a' if tensor.shape else 'no'} shape; expected 0 to "
                                   f"{_MAX_DIMS} dimensions and a shape for each")
    shape = _extents(call, what, "shape", tensor.shape[:ndim])
    if tensor.strides and not _c_contiguous(shape, tensor.strides[:ndim], 1):
        raise _not_contiguous(call, name)
    if writable and flags & _DLPACK_READ_ONLY:
        raise _read_only(call, name, "DLPack flag READ_ONLY")
    device = int(device_id) if device_type == _DLPACK_CUDA else None
    data = tensor.data or 0
    address = data + tensor.byte_offset if data else 0
    address, count = _checked_memory(call, what, address, f"data {data:#x} + byte_offset "
                            f"{tensor.byte_offset}", shape, ITEMSIZE[dtype])
    # The capsule stays unconsumed and alive with the buffer: the memory is valid until its
    # deleter runs, which the capsule's destructor does.
    return Buffer(address, count, dtype, device, (array, capsule))


# -- shared checks -----------------------------------------------------------------------
def _dtype_name(call: str, name: str, found: Optional[_dtypes.DType], given: Any,
                reduction: bool) -> str:
    """The hoccl dtype name of ``found`` (what the array's interface reported as
    ``given``), applying the bool rule."""
    if found is BOOL:
        if reduction:
            raise InvalidArgumentError(
                f"{call}: {name} is a bool array; hoccl does not reduce bools (bool bytes "
                f"summed are not bools): pass a uint8 view, on which op='max' is logical or "
                f"and op='min' logical and")
        return "uint8"
    if found is None:
        raise InvalidArgumentError(f"{call}: {name} has dtype {given}; expected one of "
                                   f"{', '.join(NAMES)}")
    return found.name


def _c_contiguous(shape: Sequence[int], strides: Sequence[int], step: int) -> bool:
    """Whether ``strides`` lay ``shape`` out in C order, ``step`` being one element's
    stride.  An extent of 1 or an empty array puts no constraint on strides."""
    if 0 in shape:
        return True
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent != 1 and stride != step:
            return False
        step *= extent
    return True


#: the most dimensions a DLPack tensor may have here (numpy's NPY_MAXDIMS)
_MAX_DIMS = 64
#: no buffer reaches past this address: user memory on 64-bit Linux (host or mapped into
#: the GPU's unified address space) lies below 2**57, and every size and offset hoccl
#: hands the drivers fits a signed 64-bit int
ADDRESS_END = 1 << 63


def integer(value: Any) -> Optional[int]:
    """``value`` as an int when it is an integer: an int, or an integer scalar with
    ``__index__`` (numpy's, a 0-dim torch tensor); never a bool of any kind; else None."""
    if type(value) is int:
        return value
    if (isinstance(value, (bool, np.bool_)) or getattr(value, "ndim", 0) != 0
            or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def integers(values: Any) -> Optional[Tuple[int, ...]]:
    """``values`` (any iterable) as a tuple of ints when each is an integer (``integer``);
    else None."""
    try:
        found = tuple(integer(value) for value in values)
    except TypeError:
        return None
    return None if None in found else cast(Tuple[int, ...], found)


def _extents(call: str, what: str, key: str, values: Any, ndim: Optional[int] = None,
             signed: bool = False) -> Tuple[int, ...]:
    """A description's ``shape`` (ints >= 0) or ``strides`` (ints, ``ndim`` of them)."""
    found = integers(values)
    if (found is None or (ndim is not None and len(found) != ndim)
            or (not signed and any(value < 0 for value in found))):
        expected = (f"{ndim} ints" if signed else "a sequence of ints >= 0" if ndim is None
                    else f"{ndim} ints >= 0")
        given = tuple(values) if isinstance(values, ctypes.Array) else values
        raise InvalidArgumentError(f"{call}: {what} has {key} {given!r}; expected {expected}")
    return found


def _checked_memory(call: str, what: str, address: Optional[int], given: Any,
                    shape: Tuple[int, ...], itemsize: int) -> Tuple[int, int]:
    """``address`` and the element count of ``shape``, once its bytes there are a range of the
    address space: a real address (not null) unless the array is empty, and no byte past
    the end.  Whether that memory exists and is the array's cannot be known here."""
    count = math.prod(shape)
    nbytes = count * itemsize
    if address is None or address < 0:
        raise InvalidArgumentError(f"{call}: {what} has data address {given!r}; expected an "
                                   f"int address >= 0")
    if nbytes and not address:
        raise InvalidArgumentError(f"{call}: {what} has a null data pointer for shape "
                                   f"{shape} ({nbytes} bytes); expected the address of its "
                                   f"memory (null only for an empty array)")
    if address + nbytes > ADDRESS_END:
        raise InvalidArgumentError(f"{call}: {what} describes {nbytes} bytes (shape {shape}, "
                                   f"{itemsize} bytes each) at {address:#x}, past 2**63, where "
                                   f"no process's memory lies")
    return address, count


def _not_contiguous(call: str, name: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{call}: {name} must be C-contiguous (blocks are contiguous "
                                f"slices of the flattened array); pass a contiguous copy")


def _read_only(call: str, name: str, reason: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{call}: {name} is read-only ({reason}); hoccl writes into it: "
                                f"pass a writable array")
