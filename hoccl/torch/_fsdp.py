"""FSDP2's custom collectives (``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter``) on a hoccl Communicator.

FSDP2 calls them on its own streams (all-gather stream, reduce-scatter stream) with
``stream=None`` meaning that current stream, all-gathers in place (the input is this
rank's block of the output: zero SMs on GPUs) and reduce-scatters with AVG, SUM or
PREMUL_SUM(1/factor).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGather
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter

from .. import InvalidArgumentError
from ._collectives import all_gather_into, reduce_scatter_into
from ._ops import reduction
from ._p2p import issue_held
from ._work import Launcher

__all__ = ["AllGather", "ReduceScatter", "use_for_fsdp", "comm_buffer"]


def comm_buffer(comm: Any, size: Sequence[Any], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """The buffers FSDP2 communicates through (its all-gather output, its reduce-scatter
    input and output).  Plain tensors from torch's allocator: hoccl exchanges their
    addresses per call.  Registered buffers, exchanged once, would come from here."""
    return torch.empty(*size, dtype=dtype, device=device)


class _Hooked:
    def __init__(self, comm: Any):
        # a hoccl process group lends its launcher (and side stream); a Communicator gets one
        self.launcher = getattr(comm, "launcher", None) or Launcher(comm)
        self.comm = self.launcher.comm

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return comm_buffer(self.comm, size, dtype, device)

    def _check(self, call: str, group: Optional[dist.ProcessGroup]) -> None:
        if group is not None and (group.size(), group.rank()) != (self.comm.world_size,
                                                                  self.comm.rank):
            raise InvalidArgumentError(
                f"{call}: FSDP's group is rank {group.rank()} of {group.size()}, but the hoccl "
                f"communicator is rank {self.comm.rank} of {self.comm.world_size}: give "
                f"use_for_fsdp the communicator of the mesh FSDP shards over")


class AllGather(_Hooked, _AllGather):
    """FSDP2's all-gather through ``comm`` (a hoccl Communicator or hoccl process group)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Optional[dist.ProcessGroup] = None,
                 async_op: bool = False) -> Optional[dist.Work]:
        self._check("fsdp all_gather", group)
        issue_held()
        work = all_gather_into(self.launcher, output_tensor, input_tensor, async_op)
        return work if async_op else None


class ReduceScatter(_Hooked, _ReduceScatter):
    """FSDP2's reduce-scatter through ``comm``.  PREMUL_SUM(f) with a number f is a sum
    the reduction kernel multiplies by f as it rounds (no pass of its own); with a tensor
    f, a temporary copy of the input is scaled first."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Optional[dist.ProcessGroup] = None, op: Any = dist.ReduceOp.SUM,
                 async_op: bool = False) -> Optional[dist.Work]:
        call = "fsdp reduce_scatter"
        self._check(call, group)
        issue_held()
        name, factor = reduction(call, op)
        work = reduce_scatter_into(call, self.launcher, output_tensor, input_tensor, name,
                                   factor, async_op)
        return work if async_op else None


def use_for_fsdp(model: torch.nn.Module, comm: Any) -> int:
    """Make every FSDP2 module of ``model`` (call after ``fully_shard``) all-gather and
    reduce-scatter through ``comm`` (a hoccl Communicator, or a hoccl process group).
    Returns how many modules now use it."""
    from torch.distributed.fsdp import FSDPModule
    all_gather, reduce_scatter = AllGather(comm), ReduceScatter(comm)
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not modules:
        raise InvalidArgumentError("use_for_fsdp: no module of the model is sharded; call "
                                   "fully_shard first")
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
    return len(modules)
