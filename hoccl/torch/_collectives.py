"""The two calls FSDP2 makes, shared by the process group and FSDP's custom hooks."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ._ops import averaged, movable, premultiply, reducible
from ._work import Launcher

__all__ = ["all_gather_into", "reduce_scatter_into"]


def all_gather_into(launcher: Launcher, output: torch.Tensor, input: torch.Tensor,
                    async_op: bool, mark: bool = False) -> Any:
    """``output`` = every rank's ``input`` in rank order.  In place (no own-block copy)
    when ``input`` is this rank's block of ``output``, as FSDP passes them.  ``mark``: a
    synchronous call returns a ``Mark`` (``Launcher.run``)."""
    def issue(stream: Any) -> None:
        launcher.comm.all_gather(movable(input), movable(output), stream=stream)
    return launcher.run(issue, [output], [input, output], async_op, mark=mark)


def reduce_scatter_into(call: str, launcher: Launcher, output: torch.Tensor,
                        input: torch.Tensor, op: str, factor: Optional[Any],
                        async_op: bool, mark: bool = False) -> Any:
    """``output`` = ``op`` over ranks of their block ``rank`` of ``input``; with a
    ``factor`` (PREMUL_SUM) the sum times ``factor`` (``premultiply``: a number goes to
    the reduction kernel; a tensor factor scales a temporary copy of the input first,
    and the call is then out of place)."""
    reducible(call, output, factor)

    def issue(stream: Any) -> Optional[Callable[[], None]]:
        source, scale = premultiply(launcher.comm, input, factor, in_place=False)
        called, divide = averaged(launcher.comm, op, output)
        launcher.comm.reduce_scatter(source, output, called, scale=scale, stream=stream)
        return divide
    return launcher.run(issue, [output], [input, output], async_op, mark=mark)
