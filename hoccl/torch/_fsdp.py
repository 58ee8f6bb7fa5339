"""FSDP2's custom collectives (``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter``) on a hoccl Communicator.

FSDP2 calls them on its own streams (all-gather stream, reduce-scatter stream) with
``stream=None`` meaning that current stream, all-gathers in place (the input is this
rank's block of the output: zero SMs on GPUs) and reduce-scatters with AVG, SUM or
PREMUL_SUM(1/factor).  The all-gather's ``allocate`` hands out registered memory
(``RegisteredPool``), at the same offsets on every rank, so the all-gathers go without a
descriptor exchange.  A reduce-scatter that pushes (the default) needs no registered
buffer (its peers write only into hoccl's scratch); one that pulls (its input at most
the communicator's ``pull_bytes``) has its peers read its input where it lies, so its
``allocate`` hands out registered memory for those sizes too.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGather
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter

from .. import InvalidArgumentError
from ._collectives import all_gather_into, reduce_scatter_into
from ._ops import reduction
from ._p2p import issue_held
from ._pool import RegisteredPool
from ._work import Launcher

__all__ = ["AllGather", "ReduceScatter", "FSDPHooks", "use_for_fsdp"]


class _Hooked:
    def __init__(self, comm: Any):
        # a hoccl process group lends its launcher (and side stream); a Communicator gets one
        self.launcher = getattr(comm, "launcher", None) or Launcher(comm)
        self.comm = self.launcher.comm
        self.calls = 0              # calls made through this hook
        self.without_exchange = 0   # of which issued with no descriptor exchange
        self.host_seconds = 0.0     # the host's time inside the hook's calls, in all
        self._checked: Any = None   # the last group found to match the communicator

    def _count(self, issue: Any) -> Any:
        engine = getattr(self.comm, "_engine", None)
        before = engine.issued_fast if engine is not None else 0
        work = issue()
        self.calls += 1
        if engine is not None and engine.issued_fast > before:
            self.without_exchange += 1
        return work

    def _timed(self, start: float) -> None:
        self.host_seconds += time.perf_counter() - start

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _check(self, call: str, group: Optional[dist.ProcessGroup]) -> None:
        if group is None or group is self._checked:
            return
        if (group.size(), group.rank()) != (self.comm.world_size, self.comm.rank):
            raise InvalidArgumentError(
                f"{call}: FSDP's group is rank {group.rank()} of {group.size()}, but the hoccl "
                f"communicator is rank {self.comm.rank} of {self.comm.world_size}: give "
                f"use_for_fsdp the communicator of the mesh FSDP shards over")
        self._checked = group  # FSDP passes the same group every call


class AllGather(_Hooked, _AllGather):
    """FSDP2's all-gather through ``comm`` (a hoccl Communicator or hoccl process group).

    ``registered``: hand FSDP its all-gather outputs from a ``RegisteredPool`` (``pool``),
    so each all-gather is a call on registered buffers (no descriptor exchange, no host
    wait for the peers); False: plain torch tensors, exchanged per call."""

    def __init__(self, comm: Any, *, registered: bool = True):
        super().__init__(comm)
        self.pool = RegisteredPool(self.comm) if registered else None

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        if self.pool is None:
            return super().allocate(size, dtype=dtype, device=device)
        return self.pool.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Optional[dist.ProcessGroup] = None,
                 async_op: bool = False) -> Optional[dist.Work]:
        start = time.perf_counter()
        self._check("fsdp all_gather", group)
        issue_held()
        pool = self.pool
        shadowed = pool.shadow(output_tensor) if pool is not None else None
        if pool is None or shadowed is None:
            work = self._count(lambda: all_gather_into(self.launcher, output_tensor,
                                                       input_tensor, async_op))
            self._timed(start)
            return work if async_op else None
        # the call holds views of the same memory through storages of their own: what
        # frees the slot is FSDP dropping its tensors, the same moment on every rank
        output, slot = shadowed
        found = pool.shadow(input_tensor)
        input = found[0] if found is not None and found[1] is slot else input_tensor
        work = self._count(lambda: all_gather_into(self.launcher, output, input, async_op,
                                                   mark=not async_op))
        pool.used(slot, work)
        self._timed(start)
        return work if async_op else None


class ReduceScatter(_Hooked, _ReduceScatter):
    """FSDP2's reduce-scatter through ``comm``.  PREMUL_SUM(f) with a number f is a sum
    the reduction kernel multiplies by f as it rounds (no pass of its own); with a tensor
    f, a temporary copy of the input is scaled first.

    ``registered``: buffers of at most the communicator's ``pull_bytes`` or
    ``kernel_bytes`` (the sizes whose reduce-scatters read the peers' inputs where they
    lie) come from a ``RegisteredPool`` (``pool``), so those calls go without a descriptor
    exchange; larger ones, and every one when both are 0 (the default: peers push into
    hoccl's scratch, which needs no registered buffer), are plain torch tensors."""

    def __init__(self, comm: Any, *, registered: bool = True):
        super().__init__(comm)
        self.pool = RegisteredPool(self.comm) if registered else None

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        options = getattr(self.comm, "options", None)
        pulled = max(getattr(options, "pull_bytes", 0), getattr(options, "kernel_bytes", 0))
        nbytes = math.prod(int(extent) for extent in size) * dtype.itemsize
        if self.pool is None or nbytes > pulled:
            return super().allocate(size, dtype=dtype, device=device)
        return self.pool.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Optional[dist.ProcessGroup] = None, op: Any = dist.ReduceOp.SUM,
                 async_op: bool = False) -> Optional[dist.Work]:
        start = time.perf_counter()
        call = "fsdp reduce_scatter"
        self._check(call, group)
        issue_held()
        name, factor = reduction(call, op)
        # as in AllGather: the call holds shadows of pool memory, the slots remember it
        shadows = [self.pool.shadow(tensor) if self.pool is not None else None
                   for tensor in (output_tensor, input_tensor)]
        output, input = (found[0] if found is not None else tensor
                         for found, tensor in zip(shadows, (output_tensor, input_tensor)))
        work = self._count(lambda: reduce_scatter_into(call, self.launcher, output, input,
                                                       name, factor, async_op,
                                                       mark=not async_op))
        for found in shadows:
            if found is not None:
                self.pool.used(found[1], work)  # type: ignore[union-attr]
        self._timed(start)
        return work if async_op else None


class FSDPHooks(NamedTuple):
    """What ``use_for_fsdp`` installed: how many FSDP2 modules use it, and the two hooks
    (whose ``calls`` and ``without_exchange`` count what went through them, and
    ``host_seconds`` adds up the host's time in them)."""
    modules: int
    all_gather: AllGather
    reduce_scatter: ReduceScatter


def use_for_fsdp(model: torch.nn.Module, comm: Any, *, registered: bool = True) -> FSDPHooks:
    """Make every FSDP2 module of ``model`` (call after ``fully_shard``) all-gather and
    reduce-scatter through ``comm`` (a hoccl Communicator, or a hoccl process group).
    ``registered``: the all-gathers' outputs come from memory registered with ``comm``
    (``AllGather``), and so do the reduce-scatters' buffers of sizes that pull
    (``ReduceScatter``).  Every rank calls it, in the same order."""
    from torch.distributed.fsdp import FSDPModule
    all_gather = AllGather(comm, registered=registered)
    reduce_scatter = ReduceScatter(comm, registered=registered)
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not modules:
        raise InvalidArgumentError("use_for_fsdp: no module of the model is sharded; call "
                                   "fully_shard first")
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
    return FSDPHooks(len(modules), all_gather, reduce_scatter)
