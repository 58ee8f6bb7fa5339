"""torch's list forms, built on hoccl's flat calls through one flat temporary.

``dist.all_gather``, ``all_gather_coalesced``, ``reduce_scatter``, ``gather`` and
``scatter`` take a list of ``world_size`` tensors (or a list of lists) where hoccl takes
one flat buffer: the inputs are concatenated into a temporary before the call, or the
call writes a temporary that torch then copies out, cut in the outputs' sizes, on the
call's stream.  Each function checks the list against this rank's tensor, issues the
call through the rank's ``Launcher`` and returns its Work.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch

from .. import InvalidArgumentError
from ._ops import averaged, movable, premultiply, reducible
from ._work import Launcher

__all__ = ["all_gather_list", "all_gather_coalesced", "reduce_scatter_list", "gather_list",
           "scatter_list"]


def _check_blocks(call: str, tensors: Sequence[torch.Tensor], like: torch.Tensor,
                  world_size: int) -> None:
    """A list form's ``world_size`` tensors, each of ``like``'s size and dtype."""
    if len(tensors) != world_size:
        raise InvalidArgumentError(f"{call}: expected a list of world_size = {world_size} "
                                   f"tensors; got {len(tensors)}")
    for tensor in tensors:
        if tensor.numel() != like.numel() or tensor.dtype != like.dtype:
            raise InvalidArgumentError(
                f"{call}: every tensor of the list must have {like.numel()} elements of "
                f"{like.dtype}, like this rank's; got {tensor.numel()} of {tensor.dtype}")


def _copy_blocks(flat: torch.Tensor, outputs: Sequence[torch.Tensor]) -> Callable[[], None]:
    """What copies ``flat``, cut in pieces of the outputs' sizes, into ``outputs`` in
    order, run by the Launcher once the hoccl call is on the stream."""
    def copy_out() -> None:
        pieces = flat.split([output.numel() for output in outputs])
        for piece, output in zip(pieces, outputs):
            output.copy_(piece.view_as(output))
    return copy_out


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensor.reshape(-1) for tensor in tensors])


def all_gather_list(launcher: Launcher, outputs: List[torch.Tensor], input: torch.Tensor,
                    async_op: bool) -> Any:
    """dist.all_gather: ``outputs[r]`` = rank r's ``input``."""
    comm = launcher.comm
    _check_blocks("all_gather", outputs, input, comm.world_size)

    def issue(stream: Any) -> Callable[[], None]:
        flat = input.new_empty(input.numel() * comm.world_size)
        comm.all_gather(movable(input.contiguous()), movable(flat), stream=stream)
        return _copy_blocks(flat, outputs)
    return launcher.run(issue, outputs, [input, *outputs], async_op)


def all_gather_coalesced(launcher: Launcher, output_lists: List[List[torch.Tensor]],
                         input_list: List[torch.Tensor], async_op: bool) -> Any:
    """dist.all_gather_coalesced: ``output_lists[r][i]`` = rank r's ``input_list[i]``;
    one all_gather of every input, flattened into one temporary."""
    call, comm = "all_gather_coalesced", launcher.comm
    if len(output_lists) != comm.world_size:
        raise InvalidArgumentError(f"{call}: expected world_size = {comm.world_size} output "
                                   f"lists; got {len(output_lists)}")
    wanted = [(input.numel(), input.dtype) for input in input_list]
    for outputs_of_rank in output_lists:
        got = [(output.numel(), output.dtype) for output in outputs_of_rank]
        if got != wanted:
            raise InvalidArgumentError(f"{call}: every output list must hold tensors of "
                                       f"the inputs' (numel, dtype) {wanted}; got {got}")
    outputs = [output for outputs_of_rank in output_lists for output in outputs_of_rank]

    def issue(stream: Any) -> Callable[[], None]:
        flat_input = _flat(input_list)
        flat = flat_input.new_empty(flat_input.numel() * comm.world_size)
        comm.all_gather(movable(flat_input), movable(flat), stream=stream)
        return _copy_blocks(flat, outputs)
    return launcher.run(issue, outputs, [*input_list, *outputs], async_op)


def reduce_scatter_list(launcher: Launcher, output: torch.Tensor,
                        inputs: List[torch.Tensor], op: str, factor: Optional[Any],
                        async_op: bool) -> Any:
    """dist.reduce_scatter: ``output`` = ``op`` over ranks of their ``inputs[rank]``."""
    call, comm = "reduce_scatter", launcher.comm
    _check_blocks(call, inputs, output, comm.world_size)
    reducible(call, output, factor)

    def issue(stream: Any) -> Optional[Callable[[], None]]:
        source, scale = premultiply(comm, _flat(inputs), factor, in_place=True)
        called, divide = averaged(comm, op, output)
        comm.reduce_scatter(source, output, called, scale=scale, stream=stream)
        return divide
    return launcher.run(issue, [output], [output, *inputs], async_op)


def gather_list(launcher: Launcher, outputs: List[torch.Tensor], input: torch.Tensor,
                root: int, async_op: bool) -> Any:
    """dist.gather: the root's ``outputs[r]`` = rank r's ``input`` (no outputs off it)."""
    comm = launcher.comm
    is_root = comm.rank == root
    if is_root:
        _check_blocks("gather", outputs, input, comm.world_size)

    def issue(stream: Any) -> Optional[Callable[[], None]]:
        if not is_root:
            comm.gather(movable(input), None, root, stream=stream)
            return None
        flat = input.new_empty(input.numel() * comm.world_size)
        comm.gather(movable(input), movable(flat), root, stream=stream)
        return _copy_blocks(flat, outputs)
    return launcher.run(issue, outputs, [input, *outputs], async_op)


def scatter_list(launcher: Launcher, output: torch.Tensor, inputs: List[torch.Tensor],
                 root: int, async_op: bool) -> Any:
    """dist.scatter: ``output`` = the root's ``inputs[rank]`` (no inputs off it)."""
    comm = launcher.comm
    is_root = comm.rank == root
    if is_root:
        _check_blocks("scatter", inputs, output, comm.world_size)

    def issue(stream: Any) -> None:
        flat = _flat(inputs) if is_root else None
        comm.scatter(None if flat is None else movable(flat), movable(output), root,
                     stream=stream)
    return launcher.run(issue, [output], [output, *inputs], async_op)
