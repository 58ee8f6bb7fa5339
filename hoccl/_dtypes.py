"""Element types: hoccl's dtype names and how each array interface spells them.

The one table of dtypes.  The scheduler and the backends use the names and item sizes
(``NAMES``, ``ITEMSIZE``) and the floating ones (``FLOATING``: what a sum may scale);
buffer resolution finds a type from a numpy dtype, a ``__cuda_array_interface__``
typestr, a DLPack type code or a torch dtype.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["DType", "DTYPES", "BOOL", "NAMES", "ITEMSIZE", "FLOATING", "numpy_dtype",
           "from_numpy", "from_typestr", "from_dlpack", "from_torch", "reduce_arrays",
           "reduce_into", "REDUCE_BLOCK_BYTES"]

# DLPack type codes (dlpack.h, DLDataTypeCode)
_DLPACK_INT, _DLPACK_UINT, _DLPACK_FLOAT, _DLPACK_BFLOAT, _DLPACK_BOOL = 0, 1, 2, 4, 6


@dataclass(frozen=True)
class DType:
    """One element type.  ``name`` is hoccl's name for it and also torch's
    (``torch.<name>``) and numpy's (ml_dtypes' for bfloat16)."""
    name: str
    itemsize: int
    typestr: str  # __cuda_array_interface__ typestr; numpy's dtype.str on a little-endian host
    dlpack: Tuple[int, int]  # DLPack (type code, bits); hoccl takes lanes == 1 only

    @property
    def floating(self) -> bool:
        """A floating-point type (bfloat16 included)."""
        return self.dlpack[0] in (_DLPACK_FLOAT, _DLPACK_BFLOAT)

    @property
    def numpy(self) -> np.dtype:
        if self.name == "bfloat16":
            import ml_dtypes  # imported on first use: most programs never need it
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self.name)


DTYPES = (
    DType("float16", 2, "<f2", (_DLPACK_FLOAT, 16)),
    # bfloat16 has no standard typestr: "<V2" is ml_dtypes' dtype.str and what torch exports
    DType("bfloat16", 2, "<V2", (_DLPACK_BFLOAT, 16)),
    DType("float32", 4, "<f4", (_DLPACK_FLOAT, 32)),
    DType("float64", 8, "<f8", (_DLPACK_FLOAT, 64)),
    DType("int8", 1, "|i1", (_DLPACK_INT, 8)),
    DType("uint8", 1, "|u1", (_DLPACK_UINT, 8)),
    DType("int32", 4, "<i4", (_DLPACK_INT, 32)),
    DType("int64", 8, "<i8", (_DLPACK_INT, 64)),
)
#: Recognised in arrays but not a hoccl dtype: buffer resolution moves bool data as
#: uint8 bytes and refuses it in reductions (``hoccl._buffers`` says why).
BOOL = DType("bool", 1, "|b1", (_DLPACK_BOOL, 8))

#: hoccl's dtype names, the ones every backend reduces.
NAMES = tuple(d.name for d in DTYPES)
ITEMSIZE = {d.name: d.itemsize for d in DTYPES}
#: the floating ones, in the table's order: the dtypes whose sums take a ``scale``
#: (torch's PREMUL_SUM).
FLOATING = tuple(d.name for d in DTYPES if d.floating)

_BY_NAME = {d.name: d for d in DTYPES}
_BY_TYPESTR = {d.typestr: d for d in DTYPES + (BOOL,)}
_BY_DLPACK = {d.dlpack: d for d in DTYPES + (BOOL,)}
# Filled as dtype objects are met: a key per object avoids building the bfloat16 dtype
# (an ml_dtypes import) before an array of it exists, and torch is never imported here.
_BY_NUMPY: Dict[np.dtype, DType] = {}
_BY_TORCH: Dict[Any, DType] = {}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a hoccl dtype name (bfloat16 comes from ml_dtypes)."""
    return _BY_NAME[name].numpy


def from_numpy(dtype: np.dtype) -> Optional[DType]:
    """The type of a numpy dtype, or None when hoccl has no such type (a non-native byte
    order is none)."""
    found = _BY_NUMPY.get(dtype)
    if found is None:
        found = _BY_TYPESTR.get(dtype.str)
        if found is None or dtype != found.numpy:
            return None
        _BY_NUMPY[dtype] = found
    return found


def from_typestr(typestr: str) -> Optional[DType]:
    """The type a ``__cuda_array_interface__`` typestr names, or None."""
    return _BY_TYPESTR.get(typestr)


def from_dlpack(code: int, bits: int, lanes: int) -> Optional[DType]:
    """The type of a DLPack ``DLDataType``, or None (vector types included)."""
    return _BY_DLPACK.get((code, bits)) if lanes == 1 else None


def from_torch(dtype: Any) -> Optional[DType]:
    """The type of a torch dtype, or None.  Only called with a tensor in hand, so torch
    is already imported."""
    if not _BY_TORCH:
        torch = sys.modules["torch"]
        _BY_TORCH.update({getattr(torch, d.name): d for d in DTYPES + (BOOL,)})
    return _BY_TORCH.get(dtype)


def reduce_arrays(inputs, op: str, out_dtype: np.dtype, divisor: Optional[int] = None,
                  scale: Optional[float] = None) -> np.ndarray:
    """``op`` over ``inputs`` in the order given, accumulating as the GPU kernels do:
    16-bit floats in float32, other types in their own precision (integers wrap).
    ``avg`` divides by ``divisor`` (default: the number of inputs); a sum with ``scale``
    is multiplied by it in the accumulator's precision before the one rounding."""
    accumulate = np.float32 if out_dtype.itemsize == 2 and out_dtype.kind in "fV" else out_dtype
    acc = np.array(inputs[0], dtype=accumulate, copy=True)
    with np.errstate(over="ignore", invalid="ignore"):
        for x in inputs[1:]:
            x = x.astype(accumulate, copy=False)
            if op in ("sum", "avg"):
                acc += x
            elif op == "prod":
                acc *= x
            elif op == "max":
                np.maximum(acc, x, out=acc)
            elif op == "min":
                np.minimum(acc, x, out=acc)
            else:
                raise ValueError(f"reduce_arrays: unknown op {op!r}")
        if op == "avg":
            k = len(inputs) if divisor is None else divisor
            if acc.dtype.kind in "iu":
                # in 64 bits and toward zero, as C divides: floor division rounded up
                # where a negative sum leaves a remainder
                wide = acc.astype(np.int64)
                acc = (wide // k + ((wide < 0) & (wide % k != 0))).astype(acc.dtype)
            else:
                acc = acc / np.asarray(k, dtype=acc.dtype)
        if scale is not None and op == "sum":
            acc = acc * np.asarray(scale, dtype=acc.dtype)
        return acc.astype(out_dtype)


#: the output bytes ``reduce_into`` folds at a time: its inputs, scratch and output stay
#: in a core's caches, and no temporary is as large as the call
REDUCE_BLOCK_BYTES = 4 << 20

#: an input ``reduce_into`` reads block by block: elements [start, stop) as an array (a
#: peer's memory copied into a buffer of the reader's own, for example)
Reader = Callable[[int, int], np.ndarray]

_IN_PLACE = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum,
             "min": np.minimum}


def reduce_into(out: np.ndarray, inputs: Sequence[Union[np.ndarray, Reader]], op: str,
                divisor: Optional[int] = None, scale: Optional[float] = None, *,
                threads: int = 1, block_bytes: Optional[int] = None) -> None:
    """``out[...] = reduce_arrays(inputs, op, out.dtype, divisor, scale)``, the same bits,
    a block of ``block_bytes`` (default ``REDUCE_BLOCK_BYTES``) at a time: each element is
    folded in the same order and precision, with no temporary of the whole size (the host
    backend's and the hierarchy's reductions of hundreds of MiB ran at a quarter of the
    memory's speed through ``reduce_arrays``' copies).  ``out`` is flat; an input is a
    flat array of its dtype and length or a ``Reader``.  An input that overlaps ``out``
    other than exactly (an in-place call) is folded whole, as ``reduce_arrays`` does.

    Up to ``threads`` threads fold contiguous parts of the elements at once
    (``hoccl._threads``), each part at least two blocks: readers are then called from
    several threads at once, so each must hand every thread an array of its own."""
    if op not in _IN_PLACE:
        raise ValueError(f"reduce_into: unknown op {op!r}")
    count, dtype = out.shape[0], out.dtype
    arrays = [x for x in inputs if isinstance(x, np.ndarray)]
    if any(x.dtype != dtype or x.shape[0] != count for x in arrays) or any(
            np.may_share_memory(out, x) and x.ctypes.data != out.ctypes.data for x in arrays):
        out[...] = reduce_arrays([_whole(x, count) for x in inputs], op, dtype, divisor, scale)
        return
    wide = dtype.itemsize == 2 and dtype.kind in "fV"
    exact = dtype.kind in "fiu" and not wide and not (op == "avg" and dtype.kind in "iu")
    per_block = max(1, (block_bytes or REDUCE_BLOCK_BYTES) // dtype.itemsize)

    def fold(first: int, last: int) -> None:
        """Elements [first, last), block by block, with scratch of this part's own."""
        size = min(last - first, per_block)
        scratch = (np.empty(size, np.float32), np.empty(size, np.float32)) if wide else None
        for start in range(first, last, per_block):
            stop = min(last, start + per_block)
            views = [x[start:stop] if isinstance(x, np.ndarray) else x(start, stop)
                     for x in inputs]
            target = out[start:stop]
            if scratch is not None:
                _fold_wide(target, views, op, divisor, scale, scratch)
            elif exact and not any(np.may_share_memory(target, x) for x in views[1:]):
                _fold_in(target, views, op, divisor, scale)
            else:
                target[...] = reduce_arrays(views, op, dtype, divisor, scale)

    parts = min(threads, count // (2 * per_block))
    if parts < 2:
        fold(0, count)
        return
    # imported here: the scheduler, which imports this module for its tables and its
    # reference, imports nothing of threads
    from ._threads import run_parts, split
    run_parts(fold, split(count, parts, max(1, 64 // dtype.itemsize)))


def _whole(x: Union[np.ndarray, Reader], count: int) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else np.array(x(0, count), copy=True)


def _fold_in(target: np.ndarray, views: Sequence[np.ndarray], op: str,
             divisor: Optional[int], scale: Optional[float]) -> None:
    """``reduce_arrays``' loop with ``target`` as its accumulator (the output's own
    dtype: no 16-bit floats, no integer average)."""
    ufunc = _IN_PLACE[op]
    with np.errstate(over="ignore", invalid="ignore"):
        if len(views) == 1:
            if target.ctypes.data != views[0].ctypes.data:
                np.copyto(target, views[0])
        else:  # the first two in one pass: op(x0, x1) is what op(copy of x0, x1) gives
            ufunc(views[0], views[1], out=target)
        for x in views[2:]:
            ufunc(target, x, out=target)
        _finish(target, op, len(views) if divisor is None else divisor, scale)


def _fold_wide(target: np.ndarray, views: Sequence[np.ndarray], op: str,
               divisor: Optional[int], scale: Optional[float],
               scratch: Tuple[np.ndarray, np.ndarray]) -> None:
    """The same for 16-bit floats: a float32 accumulator of the block, one rounding."""
    n = target.shape[0]
    acc, widened = scratch[0][:n], scratch[1][:n]
    acc[...] = views[0]
    ufunc = _IN_PLACE[op]
    with np.errstate(over="ignore", invalid="ignore"):
        for x in views[1:]:
            widened[...] = x
            ufunc(acc, widened, out=acc)
        _finish(acc, op, len(views) if divisor is None else divisor, scale)
        target[...] = acc


def _finish(acc: np.ndarray, op: str, divisor: int, scale: Optional[float]) -> None:
    """avg's one division and a sum's ``scale``, in the accumulator's precision, in place
    (``reduce_arrays``' last steps, for floating accumulators)."""
    if op == "avg":
        np.divide(acc, np.asarray(divisor, dtype=acc.dtype), out=acc)
    if scale is not None and op == "sum":
        np.multiply(acc, np.asarray(scale, dtype=acc.dtype), out=acc)
