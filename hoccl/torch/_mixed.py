"""The "hoccl" backend on a job whose hosts differ: some on GPUs, some on CPUs, each host
with its own engine inside (``hoccl.Config.intra_host``, ``HOCCL_INTRA_HOST`` set per host).

Training code stays as it is: each rank's tensors live on its own device, and one hoccl
communicator across the hosts moves them.  Three things differ from a job of one kind:

* **When the communicator is made.**  A host whose engine is torch's device library
  ("torch": ProcessGroupNCCL, RCCL on ROCm, gloo on CPUs) runs on torch.distributed
  groups of its ranks, and torch makes groups only once its default group exists.  So
  the default group of such a job connects its communicator at its first call, and while
  it does, every hoccl group torch is asked for is the device library's own
  (``library_groups``): the host's engine really is NCCL or gloo, not hoccl again.
* **Where CPU tensors go.**  In a job of GPUs, a call on CPU tensors goes to a gloo group
  beside hoccl's, as torch's "cpu:gloo,cuda:nccl" does.  In a mixed job a CPU rank's
  tensors are CPU tensors for every call, so the GPU ranks cannot tell a CPU call
  apart: there a GPU rank's CPU tensors go through its GPU (``staged``), and every
  rank makes the same hoccl call.
* **What an error says.**  A call a host's engine cannot make raises an error naming
  the rank, its host and the engines (``where``).
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import InvalidArgumentError
from ._bootstrap import StoreBootstrap

__all__ = ["to_gloo", "needs_torch_groups", "library_groups", "making_library_groups",
           "library_group", "is_mixed", "where", "tensors_of", "staged"]

_MAKING = threading.local()


def to_gloo(call: str, tensors: Sequence[torch.Tensor], device: Optional[torch.device],
            beside: bool) -> bool:
    """Whether a call on ``tensors`` goes to the gloo group ``beside`` hoccl's: CPU
    tensors on a GPU rank (``device``) of a job of GPUs.  Raises for tensors the rank's
    communicator cannot take: GPU tensors on the host backend, both kinds in one call,
    and CPU tensors that a mixed job's collectives did not stage (send and recv)."""
    kinds = sorted({tensor.device.type for tensor in tensors})
    if device is None:
        if kinds not in ([], ["cpu"]):
            raise InvalidArgumentError(f"{call}: this hoccl process group runs on the host "
                                       f"backend and takes CPU tensors; got {kinds} tensors")
        return False
    if kinds == ["cpu"]:
        if not beside:
            raise InvalidArgumentError(f"{call}: takes GPU tensors on a GPU rank of a job "
                                       f"whose hosts differ; got CPU tensors")
        return True
    if kinds not in ([], ["cuda"]):
        raise InvalidArgumentError(f"{call}: the tensors of one call must all be on the GPU "
                                   f"or all on the CPU; got {kinds}")
    return False


def needs_torch_groups(store: Any, rank: int, world_size: int, intra_host: Optional[str],
                       inter_host: Optional[str]) -> bool:
    """Whether any rank's host runs on torch groups ("torch" inside it, or "gloo" between
    hosts): one exchange through the group's store, every rank's settings."""
    wanted = intra_host == "torch" or inter_host == "gloo"
    exchange = StoreBootstrap(store, rank, world_size, prefix="hoccl-engines")
    return any(exchange.allgather(wanted))


@contextlib.contextmanager
def library_groups() -> Iterator[None]:
    """While hoccl builds a communicator whose engines run on torch groups: every hoccl
    group made meanwhile is the device library's (``library_group``)."""
    _MAKING.active = True
    try:
        yield
    finally:
        _MAKING.active = False


def making_library_groups() -> bool:
    return bool(getattr(_MAKING, "active", False))


def library_group(store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
    """The device library's group of these ranks: NCCL where this rank has a GPU and
    torch's NCCL, else gloo (what stands for a vendor library on CPUs)."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def is_mixed(comm: Any) -> bool:
    """Whether ``comm`` spans hosts of more than one device kind."""
    described = comm.describe()
    return len({host["device"] for host in described.get("host_engines", [])}) > 1


def where(comm: Any) -> str:
    """This rank's place, for errors: its host and the engines inside and between hosts."""
    described = comm.describe()
    return (f"rank {comm.rank} on host {described['host']}, whose engine is "
            f"{described['intra_host']}, with {described['inter_host']} between hosts")


def tensors_of(arguments: Any) -> List[torch.Tensor]:
    """Every tensor in ``arguments`` (tensors, lists of them, lists of lists)."""
    if isinstance(arguments, torch.Tensor):
        return [arguments]
    if isinstance(arguments, (list, tuple)):
        return [tensor for argument in arguments for tensor in tensors_of(argument)]
    return []


def _to(arguments: Any, device: torch.device) -> Any:
    if isinstance(arguments, torch.Tensor):
        return arguments.to(device)
    if isinstance(arguments, (list, tuple)):
        return type(arguments)(_to(argument, device) for argument in arguments)
    return arguments


def staged(call: Callable[..., Any], arguments: List[Any], device: torch.device) -> Any:
    """``call(*arguments)`` with every tensor in ``arguments`` copied to ``device`` first
    and copied back once the call is done; returns a finished Work over the tensors."""
    on_device = _to(arguments, device)
    call(*on_device).wait()
    originals, copies = tensors_of(arguments), tensors_of(on_device)
    for original, copy in zip(originals, copies):
        original.copy_(copy)
    return Finished(originals)


class Finished(dist.Work):
    """The Work of a call done before it returned."""

    def __init__(self, outputs: List[torch.Tensor]):
        super().__init__()
        self.outputs = outputs

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self.outputs)
        return future

    def result(self) -> List[torch.Tensor]:
        return self.outputs
