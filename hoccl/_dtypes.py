"""dtype names shared by the scheduler, the backends and buffer resolution."""

from __future__ import annotations

import numpy as np

__all__ = ["ITEMSIZE", "numpy_dtype", "dtype_name", "reduce_arrays"]

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
            "int8": 1, "uint8": 1, "int32": 4, "int64": 8}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a hoccl dtype name (bfloat16 comes from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


_NAMES: dict = {}


def dtype_name(dtype) -> str:
    """Normalise a numpy / cupy / torch dtype (or its name) to a hoccl dtype name.
    Cached per dtype object: ``str()`` of a numpy dtype costs microseconds a call."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):
        pass
    name = _dtype_name(dtype)
    try:
        _NAMES[dtype] = name
    except TypeError:  # an unhashable dtype-like: not cached
        pass
    return name


def _dtype_name(dtype) -> str:
    text = str(dtype)
    text = text.rsplit(".", 1)[-1]  # "torch.bfloat16" -> "bfloat16"
    aliases = {"half": "float16", "float": "float32", "double": "float64",
               "int": "int32", "long": "int64", "char": "int8", "byte": "uint8"}
    return aliases.get(text, text)


def reduce_arrays(inputs, op: str, out_dtype: np.dtype) -> np.ndarray:
    """``op`` over ``inputs`` in the order given, accumulating as the GPU kernels do:
    16-bit floats in float32, other types in their own precision (integers wrap)."""
    accumulate = np.float32 if out_dtype.itemsize == 2 and out_dtype.kind in "fV" else out_dtype
    if str(out_dtype) == "bfloat16":
        accumulate = np.float32
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
            k = len(inputs)
            if acc.dtype.kind in "iu":
                # in 64 bits and toward zero, as C divides: floor division rounded up
                # where a negative sum leaves a remainder
                wide = acc.astype(np.int64)
                acc = (wide // k + ((wide < 0) & (wide % k != 0))).astype(acc.dtype)
            else:
                acc = acc / np.asarray(k, dtype=acc.dtype)
    return acc.astype(out_dtype)
