"""What the torch programs under mpiexec share: rank, inputs, poison, exact checks."""

from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hoccl._dtypes import numpy_dtype, reduce_arrays
from hoccl.torch._ops import REDUCIBLE

#: dtypes hoccl only moves (as bytes)
COPY_ONLY = (torch.bool, torch.complex64, torch.int16)
#: where the programs' tensors live (``--device cuda``: this rank's GPU)
DEVICE = torch.device("cpu")

__all__ = ["REDUCIBLE", "COPY_ONLY", "DEVICE", "use_device", "rank_and_world", "data",
           "poisoned", "expect_bits", "reference", "torch_op"]


def rank_and_world() -> tuple:
    """This process's rank and the job's size, from the launcher's environment."""
    for rank, size in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                       ("RANK", "WORLD_SIZE")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    raise RuntimeError("run under mpiexec (PMI_RANK / OMPI_COMM_WORLD_RANK) or torchrun")


def use_device(device: torch.device) -> None:
    global DEVICE
    DEVICE = device
    if device.type == "cuda":
        torch.cuda.set_device(device)


def data(seed: int, rank: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input on ``DEVICE``: small integers (exact in every dtype and every
    order of a sum of a few ranks), the same on every process for the same arguments."""
    generator = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool().to(DEVICE)
    low = 0 if dtype == torch.uint8 else -8
    values = torch.randint(low, 8, shape, generator=generator)
    if dtype.is_complex:
        return torch.complex(values.float(), values.flip(-1).float()).to(dtype).to(DEVICE)
    return values.to(dtype).to(DEVICE)


def poisoned(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """On ``DEVICE``, every byte 0xA5: a NaN pattern for floats, a value ``data`` never
    draws otherwise."""
    tensor = torch.empty(shape, dtype=dtype, device=DEVICE)
    tensor.reshape(-1).view(torch.uint8).fill_(0xA5)
    return tensor


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def expect_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``got`` and ``want`` hold the same bits (and shape and dtype)."""
    assert got.dtype == want.dtype and got.numel() == want.numel(), \
        f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    same = _bytes(got) == _bytes(want)
    if not bool(same.all()):
        first = int((~same).nonzero()[0]) // got.element_size()
        raise AssertionError(f"{what}: element {first} is {got.reshape(-1)[first]!r}, want "
                             f"{want.reshape(-1)[first]!r}")


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return tensor.numpy()


def _torch(array: np.ndarray) -> torch.Tensor:
    if str(array.dtype) == "bfloat16":
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def reference(inputs: Sequence[torch.Tensor], op: str, factor: Optional[float]) -> torch.Tensor:
    """``op`` over ``inputs`` (rank order) as hoccl computes it; ``premul`` is the sum of
    every input times ``factor``, scaled in the input's dtype."""
    if op == "premul":
        inputs, op = [torch.mul(x, factor).to(x.dtype) for x in inputs], "sum"
    arrays = [_numpy(x.contiguous()) for x in inputs]
    result = _torch(reduce_arrays(arrays, op, arrays[0].dtype)).reshape(inputs[0].shape)
    return result.to(inputs[0].device)


def torch_op(name: str) -> "dist.ReduceOp.RedOpType":
    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}[name]
