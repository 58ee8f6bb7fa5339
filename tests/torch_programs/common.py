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
           "poisoned", "expect_bits", "reference", "torch_op", "add_placement", "place"]


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


def add_placement(parser) -> None:
    """The options that place each rank of a job whose hosts differ."""
    parser.add_argument("--devices", default="",
                        help="each rank's device, comma-separated (cpu or cuda): a job whose "
                             "hosts differ; overrides --device (a cpu rank's engine inside "
                             "its host is hoccl's host backend unless --intra-host says)")
    parser.add_argument("--intra-host", default="",
                        help="each rank's engine inside its host (HOCCL_INTRA_HOST: host, "
                             "cuda or torch), comma-separated")
    parser.add_argument("--local-size", type=int, default=0,
                        help="ranks per simulated host (HOCCL_LOCAL_SIZE)")


def place(args, rank: int, world_size: int) -> bool:
    """This rank's device and host settings from ``add_placement``'s options, as a job
    launched per host would set them (``HOCCL_INTRA_HOST`` on each host); whether the job
    is placed so (a job whose hosts differ)."""
    def mine(text: str) -> str:
        values = text.split(",")
        return values[rank % len(values)] if len(values) in (1, world_size) else \
            _refuse(f"expected one value or {world_size}; got {text!r}")
    if args.local_size:
        os.environ["HOCCL_LOCAL_SIZE"] = str(args.local_size)
    if args.intra_host:
        os.environ["HOCCL_INTRA_HOST"] = mine(args.intra_host)
    if args.devices:
        kind = mine(args.devices)
        use_device(torch.device("cuda", rank % torch.cuda.device_count()) if kind == "cuda"
                   else torch.device("cpu"))
        if kind == "cpu" and not args.intra_host:
            # a CPU host as the guide launches one (HOCCL_INTRA_HOST=host): on a machine
            # whose GPUs it does not use, hoccl would otherwise take them
            os.environ["HOCCL_INTRA_HOST"] = "host"
    return bool(args.devices or args.intra_host or args.local_size)


def _refuse(message: str):
    raise SystemExit(f"--devices / --intra-host: {message}")


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
