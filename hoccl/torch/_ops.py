"""What torch asks for, in hoccl's terms: reduction operators, dtypes, byte views."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, TypeVar

import torch

from .. import InvalidArgumentError
from .._dtypes import FLOATING, NAMES

__all__ = ["REDUCIBLE", "reduction", "reducible", "movable", "one_tensor", "premultiply",
           "averaged"]

#: the dtypes hoccl's reduction kernels take (hoccl's dtype names are torch's)
REDUCIBLE = tuple(getattr(torch, name) for name in NAMES)
_NATIVE = frozenset(REDUCIBLE)
_FLOATING = frozenset(getattr(torch, name) for name in FLOATING)
T = TypeVar("T")
_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max"}
_SUPPORTED = "SUM, AVG, PRODUCT, MIN, MAX and PREMUL_SUM"


def reduction(call: str, op: Any) -> Tuple[str, Optional[Any]]:
    """(hoccl op, premultiplier or None) for a ``dist.ReduceOp`` (or its ``RedOpType``).

    PREMUL_SUM(factor) is SUM of every rank's input times ``factor`` (a float, or a
    one-element tensor, as NCCL takes it)."""
    kind = getattr(op, "op", op)
    name = getattr(kind, "name", str(kind))
    if name == "PREMUL_SUM":
        factor = getattr(op, "factor", None)
        if factor is None:  # releases whose ReduceOp has no .factor pickle it as (op, factor)
            factor = op.__getstate__()[1]
        return "sum", factor
    if name not in _OPS:
        raise InvalidArgumentError(f"{call}: hoccl has no reduction {name}; it supports "
                                   f"{_SUPPORTED}")
    return _OPS[name], None


def reducible(call: str, tensor: torch.Tensor, factor: Optional[Any] = None) -> None:
    """Raise unless hoccl can reduce ``tensor``'s dtype (PREMUL_SUM: floating dtypes only)."""
    if tensor.dtype not in _NATIVE:
        raise InvalidArgumentError(
            f"{call}: hoccl cannot reduce {tensor.dtype}; it reduces "
            f"{', '.join(str(dtype).split('.')[-1] for dtype in REDUCIBLE)}")
    if factor is not None and tensor.dtype not in _FLOATING:
        raise InvalidArgumentError(f"{call}: PREMUL_SUM needs a floating dtype; got "
                                   f"{tensor.dtype}")


def movable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as hoccl moves it: itself in a dtype hoccl knows, else its bytes (a copy
    moves bits, so bool, complex, float8, int16 ... travel as uint8)."""
    if tensor.dtype in _NATIVE:
        return tensor
    return tensor.reshape(-1).view(torch.uint8) if tensor.is_contiguous() else tensor


def one_tensor(call: str, tensors: Sequence[T]) -> T:
    """The one element of torch's per-rank list (a tensor, or a list of tensors)."""
    if len(tensors) != 1:
        raise InvalidArgumentError(f"{call}: hoccl takes one tensor per rank; got {len(tensors)}")
    return tensors[0]


def premultiply(comm: Any, tensor: torch.Tensor, factor: Any, *,
                in_place: bool) -> Tuple[torch.Tensor, Optional[float]]:
    """PREMUL_SUM(``factor``) of ``tensor`` as hoccl's sum takes it: (the tensor to reduce,
    the ``scale=`` of the call), for ``comm``'s reduce_scatter, all_reduce or reduce.

    No factor: ``(tensor, None)``.  A number, on a communicator of one host:
    ``(tensor, float(factor))``, multiplied by the reduction kernel before it rounds (no
    pass of its own).  Otherwise, a one-element tensor factor (reading its value would
    block the host) or a communicator across hosts (whose sums take no scale yet): one
    pass of its own, ``tensor * factor`` in ``tensor``'s dtype, written into ``tensor``
    when ``in_place`` (a temporary, or a tensor the output overwrites) else into a new
    tensor, and no scale.  Call it where the call is issued: the pass runs on the current
    stream."""
    if factor is None:
        return tensor, None
    from .._hierarchy import HierarchicalCommunicator
    if (isinstance(factor, (int, float)) and not isinstance(factor, bool)
            and not isinstance(comm, HierarchicalCommunicator)):
        return tensor, float(factor)
    if in_place:
        return tensor.mul_(factor), None
    return torch.mul(tensor, factor).to(tensor.dtype), None


def averaged(comm: Any, op: str, output: Optional[torch.Tensor]
             ) -> Tuple[str, Optional[Callable[[], None]]]:
    """(the op to call ``comm`` with, what divides ``output`` after the call, or None).

    Across hosts on the host backend an average is a sum that torch then divides as
    hoccl's avg does (integers truncate toward zero, 16-bit floats divide in float32),
    for the phases' division there takes numpy arrays only; everywhere else hoccl
    averages itself.  ``output`` None: this rank receives nothing (reduce off the root)."""
    from .._hierarchy import HierarchicalCommunicator
    if op != "avg" or comm.backend != "host" or not isinstance(comm, HierarchicalCommunicator):
        return op, None
    if output is None:
        return "sum", None

    def divide() -> None:
        assert output is not None
        if not output.is_floating_point():
            output.copy_(torch.div(output, comm.world_size, rounding_mode="trunc"))
        else:
            wide = output.float() if output.element_size() == 2 else output
            output.copy_(wide / comm.world_size)
    return "sum", divide
