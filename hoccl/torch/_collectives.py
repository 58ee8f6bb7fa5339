"""The two calls FSDP2 makes, shared by the process group and FSDP's custom hooks."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ._ops import kernel_scale, movable, reducible, scaled
from ._work import Launcher, Work

__all__ = ["all_gather_into", "reduce_scatter_into"]


def all_gather_into(launcher: Launcher, output: torch.Tensor, input: torch.Tensor,
                    async_op: bool) -> Work:
    """``output`` = every rank's ``input`` in rank order.  In place (no own-block copy)
    when ``input`` is this rank's block of ``output``, as FSDP passes them."""
    def issue(stream: Any) -> None:
        launcher.comm.all_gather(movable(input), movable(output), stream=stream)
    return launcher.run(issue, [output], [input, output], async_op)


def reduce_scatter_into(call: str, launcher: Launcher, output: torch.Tensor,
                        input: torch.Tensor, op: str, factor: Optional[Any],
                        async_op: bool) -> Work:
    """``output`` = ``op`` over ranks of their block ``rank`` of ``input``; with a
    ``factor`` (PREMUL_SUM) the sum times ``factor``: a number goes to the reduction
    kernel (``scale``, no pass of its own); a tensor factor scales a temporary copy of
    the input first (one extra pass; the call is then out of place)."""
    reducible(call, output, factor)
    scale = kernel_scale(launcher.comm, factor)

    def issue(stream: Any) -> None:
        if factor is not None and scale is None:
            launcher.comm.reduce_scatter(scaled(input, factor), output, op, stream=stream)
        elif scale is not None:
            launcher.comm.reduce_scatter(input, output, op, scale=scale, stream=stream)
        else:
            launcher.comm.reduce_scatter(input, output, op, stream=stream)
    return launcher.run(issue, [output], [input, output], async_op)
