"""Argument checks of the public API: one place for each rule.

Every check raises ``InvalidArgumentError`` whose message starts with the public
call's name and says what was expected and what was given; nothing is enqueued
before these checks pass.  The vocabularies come from one table each: reduction
operators from ``hoccl.sched.plan.OPS``, dtypes from ``hoccl._dtypes``,
collectives from ``hoccl.sched.COLLECTIVES``.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np

from ._buffers import ADDRESS_END, Buffer, integer, integers
from ._dtypes import FLOATING, ITEMSIZE, NAMES, from_numpy
from ._errors import InvalidArgumentError
from .sched.plan import OPS

__all__ = ["ReduceOp", "integer", "integers", "real", "positive_int", "count", "flag", "shape",
           "mark", "reduce_op", "rank", "dtype_name", "dtype_itemsize", "renamed",
           "caller_stream", "same_dtype", "same_shape", "blocks", "disjoint", "in_place",
           "on_device"]


class ReduceOp:
    """Reduction operators (their lower-case names are accepted too)."""
    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    AVG = "avg"


assert {value for name, value in vars(ReduceOp).items() if name.isupper()} == set(OPS)


def positive_int(call: str, name: str, value: Any, optional: bool = False) -> Optional[int]:
    """``value`` must be an integer > 0 (``None`` too, when ``optional``); as an int."""
    if value is None and optional:
        return None
    number = integer(value)
    if number is None or number < 1:
        raise InvalidArgumentError(f"{call}: {name} must be a positive int"
                                   f"{' or None' if optional else ''}; got {value!r}")
    return number


def count(call: str, name: str, value: Any, unit: int = 1, what: str = "") -> int:
    """A size: an integer >= 0, a multiple of ``unit`` (``what`` says why), below 2**63
    (no memory lies beyond); as an int."""
    number = integer(value)
    if number is None or number < 0 or number % unit or number >= ADDRESS_END:
        multiple = f", a multiple of {unit}{f' ({what})' if what else ''}" if unit > 1 else ""
        raise InvalidArgumentError(f"{call}: {name} must be an int >= 0{multiple}, below 2**63; "
                                   f"got {value!r}")
    return number


def flag(call: str, name: str, value: Any) -> bool:
    """``value`` must be True or False (numpy's bools too)."""
    if value is True or value is False or isinstance(value, np.bool_):
        return bool(value)
    raise InvalidArgumentError(f"{call}: {name} must be True or False; got {value!r}")


def shape(call: str, value: Any, itemsize: int) -> Tuple[Tuple[int, ...], int]:
    """An array's shape (an integer or a sequence of integers >= 0) of ``itemsize``-byte
    elements: (the dimensions as ints, the bytes), the bytes below 2**63."""
    single = integer(value)
    dims = (single,) if single is not None else integers(value)
    if dims is None or any(not 0 <= d < ADDRESS_END for d in dims):
        raise InvalidArgumentError(f"{call}: shape must be an int >= 0 or a sequence of them; "
                                   f"got {value!r}")
    nbytes = math.prod(dims) * itemsize
    if nbytes >= ADDRESS_END:
        raise InvalidArgumentError(f"{call}: shape {value!r} of {itemsize}-byte elements is "
                                   f"{nbytes} bytes, more than any memory (2**63)")
    return dims, nbytes


def reduce_op(call: str, op: Any) -> str:
    """The operator's name: a ``ReduceOp`` member, an enum with such a ``value``, or a string."""
    name = getattr(op, "value", op)
    if isinstance(name, str) and name.lower() in OPS:
        return name.lower()
    raise InvalidArgumentError(f"{call}: op must be one of {', '.join(OPS)} or a hoccl.ReduceOp "
                               f"member; got {op!r}")


def scale(call: str, value: Any, op: str, dtype: str) -> Optional[float]:
    """A sum's ``scale`` (torch's PREMUL_SUM): None, or a finite real number, for a sum
    of a floating dtype; as a Python float."""
    if value is None:
        return None
    if op != "sum" or dtype not in FLOATING:
        raise InvalidArgumentError(f"{call}: scale applies to a sum of a floating dtype; got "
                                   f"op {op!r} on {dtype}")
    number = real(value)
    if number is None or number != number or number in (float("inf"), float("-inf")):
        raise InvalidArgumentError(f"{call}: scale must be a finite real number; got {value!r}")
    return number


def real(value: Any) -> Optional[float]:
    """``value`` as a float when it is a real number (an int, a float, numpy's, a 0-dim
    torch tensor), never a bool nor a string; else None."""
    if (isinstance(value, (str, bytes, bool)) or getattr(value, "ndim", 0) != 0
            or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")
            or not hasattr(type(value), "__float__")):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def dtype_name(call: str, dtype: Any) -> str:
    """A dtype's hoccl name: one of ``hoccl._dtypes.NAMES``, a numpy dtype or a torch
    dtype of one."""
    if isinstance(dtype, str) and dtype in NAMES:
        return dtype
    text = str(dtype)
    if text.startswith("torch.") and text[len("torch."):] in NAMES:
        return text[len("torch."):]
    try:
        found = from_numpy(np.dtype(dtype)) if dtype is not None else None  # None: float64
    except (TypeError, ValueError):
        found = None
    if found is None:
        raise InvalidArgumentError(f"{call}: dtype must be one of {list(NAMES)}; got {dtype!r}")
    return found.name


def dtype_itemsize(call: str, dtype: Any) -> int:
    return ITEMSIZE[dtype_name(call, dtype)]


def rank(call: str, name: str, value: Any, world_size: int,
         other_than: Optional[int] = None) -> int:
    """A rank of the communicator (``root``, ``peer``): an integer (numpy's and 0-dim
    torch tensors' too), optionally not ``other_than``; as an int."""
    number = integer(value)
    if number is None or not 0 <= number < world_size or number == other_than:
        besides = f" other than {other_than}" if other_than is not None else ""
        raise InvalidArgumentError(f"{call}: {name} must be a rank in [0, {world_size}){besides}; "
                                   f"got {value!r}")
    return number


#: helpers below the API whose errors name themselves (the device's ``resolve_stream``)
_HELPERS = ("resolve_stream: ",)


def renamed(call: str, error: InvalidArgumentError) -> InvalidArgumentError:
    """``error`` from a helper below the API, named after the public ``call`` instead."""
    message = str(error)
    for helper in _HELPERS:
        if message.startswith(helper):
            return InvalidArgumentError(f"{call}: {message[len(helper):]}")
    return error


def caller_stream(call: str, device: Any, stream: Any) -> Any:
    """``device.resolve_stream(stream)``, its refusal named after ``call``."""
    try:
        return device.resolve_stream(stream, ())
    except InvalidArgumentError as error:
        named = renamed(call, error)
        if named is error:
            raise
        raise named from None


def mark(call: str, value: Any) -> int:
    """A mark of ``Communicator.calls``: an integer; as an int."""
    number = integer(value)
    if number is None:
        raise InvalidArgumentError(f"{call}: mark must be an int (a value of calls); got "
                                   f"{value!r}")
    return number


# -- buffers -------------------------------------------------------------------------------
def on_device(call: str, name: str, buffer: Buffer, backend: str, device: Optional[int]) -> None:
    """Host memory for the host backend; memory of this rank's GPU for the CUDA backend."""
    if backend == "host":
        if buffer.device is not None:
            raise InvalidArgumentError(f"{call}: {name} is on GPU {buffer.device}, but this "
                                       f"communicator uses the host backend; pass host memory")
    elif buffer.device is None:
        raise InvalidArgumentError(f"{call}: {name} is host memory, but this communicator "
                                   f"runs on GPU {device}; pass a device array")
    elif buffer.device != device:
        raise InvalidArgumentError(f"{call}: {name} is on GPU {buffer.device}; this rank's "
                                   f"communicator runs on GPU {device}")


def same_dtype(call: str, send: Buffer, recv: Buffer) -> None:
    if send.dtype != recv.dtype:
        raise InvalidArgumentError(f"{call}: sendbuf and recvbuf must have one dtype; got "
                                   f"{send.dtype} and {recv.dtype}")


def same_shape(call: str, send: Buffer, recv: Buffer) -> None:
    same_dtype(call, send, recv)
    if send.count != recv.count:
        raise InvalidArgumentError(f"{call}: sendbuf and recvbuf must have the same number "
                                   f"of elements; got {send.count} and {recv.count}")


def blocks(call: str, send: Buffer, recv: Buffer, world_size: int, recv_is_large: bool,
           whose: str = "") -> None:
    """The large buffer must hold world_size blocks of the small one's size and dtype
    (all_gather and gather: recv is large; reduce_scatter and scatter: send is)."""
    same_dtype(call, send, recv)
    large, small = (recv, send) if recv_is_large else (send, recv)
    large_name, small_name = ("recvbuf", "sendbuf") if recv_is_large else ("sendbuf", "recvbuf")
    if large.count != small.count * world_size:
        raise InvalidArgumentError(
            f"{call}: {whose}{large_name} must hold world_size * {small_name}.size = "
            f"{world_size} * {small.count} = {small.count * world_size} elements; got "
            f"{large.count}")


def _overlap(a: Buffer, b: Buffer) -> bool:
    return (a.nbytes > 0 and b.nbytes > 0 and a.address < b.address + b.nbytes
            and b.address < a.address + a.nbytes)


def disjoint(call: str, send: Buffer, recv: Buffer) -> None:
    if _overlap(send, recv):
        raise InvalidArgumentError(f"{call}: sendbuf and recvbuf overlap; this collective "
                                   f"has no in-place form, pass separate buffers")


def in_place(call: str, rank_: int, send: Buffer, recv: Buffer, own_block: Buffer,
             inner: Buffer) -> bool:
    """True when ``inner`` (the smaller of send and recv) is exactly ``own_block`` of the
    larger one: the in-place form.  Any other overlap of send and recv is an error."""
    if inner.nbytes and inner.address == own_block.address:
        return True
    if _overlap(send, recv):
        if send.nbytes == recv.nbytes:
            raise InvalidArgumentError(
                f"{call}: sendbuf and recvbuf overlap but are not the same buffer (starting "
                f"{recv.address - send.address:+d} bytes apart); in place, pass one buffer "
                f"as both")
        raise InvalidArgumentError(
            f"{call}: sendbuf and recvbuf overlap but not as the in-place form (the smaller "
            f"buffer must be exactly rank {rank_}'s block of the larger one)")
    return False
