"""DDP and FSDP2 training on hoccl against gloo, one rank per process: run with
``mpiexec -n N python tests/torch_programs/run_training.py [--device cuda]`` (MASTER_ADDR and
MASTER_PORT set).

The default process group is hoccl; a group of the same ranks on gloo (NCCL with
``--device cuda``) is the reference.  Each configuration trains the same model from the same weights on the same
data with SGD (whose update is proportional to the gradient, so a wrong reduction
shows in the loss) and its losses are compared with gloo's, step by step:

* DDP on hoccl (several buckets);
* FSDP2 on a hoccl mesh, and FSDP2 on the gloo mesh with its all-gathers and
  reduce-scatters through ``hoccl.torch.use_for_fsdp``, in fp32 and with bf16 compute;
* both with explicit asynchronous prefetch (``unshard(async_op=True)``);
* a gradient divide factor (reduce-scatter with PREMUL_SUM), against gloo given the
  same gradients by a loss scaled instead (gloo has no PREMUL_SUM).

Prints one line per configuration with the largest loss difference, failures, and
``torch training ranks=N: P passed, F failed`` (rank 0).
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import hoccl.torch
from common import rank_and_world

warnings.filterwarnings("ignore")

RANK, WORLD = rank_and_world()
STEPS = 6
DEVICE = torch.device("cpu")
REFERENCE = None  # the group the losses are compared with


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # 37 and 29 wide: shards are uneven and padded
    return nn.Sequential(nn.Linear(37, 64), nn.Tanh(), nn.Linear(64, 29), nn.Tanh(),
                         nn.Linear(29, 5)).to(DEVICE)


def data():
    """Rank ``RANK``'s batch, the same at every step (so the loss falls step by step):
    targets a fixed linear map of the inputs, plus noise."""
    mapping = torch.randn(37, 5, generator=torch.Generator().manual_seed(7)) / 6
    generator = torch.Generator().manual_seed(1000 + RANK)
    inputs = torch.randn(8, 37, generator=generator)
    targets = inputs @ mapping + 0.01 * torch.randn(8, 5, generator=generator)
    return inputs.to(DEVICE), targets.to(DEVICE)


def train(model: nn.Module, scale: float = 1.0, prefetch=None, dtype=torch.float32) -> list:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    inputs, targets = data()
    for _ in range(STEPS):
        if prefetch is not None:
            prefetch(model)
        loss = (model(inputs.to(dtype)).float() - targets).pow(2).mean()
        (loss * scale).backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=REFERENCE)  # the mean over ranks, through the reference
        losses.append(total.item() / WORLD)
    return losses


def ddp(group) -> list:
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(make_model(), process_group=group, bucket_cap_mb=0.005,
                                    device_ids=[DEVICE] if DEVICE.type == "cuda" else None)
    return train(model)


def fsdp(group, hooks=None, bf16=False, prefetch=False, divide=None, scale=1.0) -> list:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = make_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32)
    mesh = DeviceMesh.from_group(group, DEVICE.type)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if hooks is not None:
        assert hoccl.torch.use_for_fsdp(model, hooks) == 4
    if divide is not None:  # each FSDP module's own parameters
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(divide)

    def unshard_first(module):
        module[0].unshard(async_op=True).wait()
    return train(model, scale=scale, prefetch=unshard_first if prefetch else None,
                 dtype=torch.bfloat16 if bf16 else torch.float32)


def compare(name, got, want, tolerance):
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))
    if RANK == 0:
        print(f"{name}: largest relative loss difference {worst:.2e} "
              f"({'identical' if got == want else 'within ' + format(tolerance, 'g')})",
              flush=True)
    assert len(got) == len(want) == STEPS
    assert worst <= tolerance, f"{name}: losses {got} vs the reference's {want}"
    assert want[-1] < want[0], f"{name}: the reference did not train: {want}"


def configurations():
    """(name, the run on hoccl, the reference run, tolerance).  A reference run is shared
    by the configurations that compare with it."""
    hoccl_group = dist.distributed_c10d._get_default_group()
    cache = {}

    def reference(**settings):
        key = tuple(sorted(settings.items()))
        return lambda: cache[key] if key in cache else cache.setdefault(
            key, fsdp(REFERENCE, **settings))
    yield ("DDP", lambda: ddp(hoccl_group), lambda: ddp(REFERENCE), 1e-6)
    for bf16 in (False, True):
        for prefetch in (False, True):
            label = f"{'bf16' if bf16 else 'fp32'}{', prefetch' if prefetch else ''}"
            tolerance = 1e-2 if bf16 else 1e-6
            yield (f"FSDP2 on hoccl, {label}",
                   lambda b=bf16, p=prefetch: fsdp(hoccl_group, bf16=b, prefetch=p),
                   reference(bf16=bf16, prefetch=prefetch), tolerance)
            yield (f"FSDP2 with hoccl hooks, {label}",
                   lambda b=bf16, p=prefetch: fsdp(REFERENCE, hooks=hoccl_group, bf16=b,
                                                   prefetch=p),
                   reference(bf16=bf16, prefetch=prefetch), tolerance)
    # not the world size, so FSDP2 sends PREMUL_SUM(1 / divide); the reference has no
    # PREMUL_SUM and gets the same gradients from a loss scaled by world / divide
    divide = 2.0 * WORLD
    scaled = reference(scale=WORLD / divide)
    yield ("FSDP2 on hoccl, divide factor (PREMUL_SUM)",
           lambda: fsdp(hoccl_group, divide=divide), scaled, 1e-5)
    yield ("FSDP2 with hoccl hooks, divide factor (PREMUL_SUM)",
           lambda: fsdp(REFERENCE, hooks=hoccl_group, divide=divide), scaled, 1e-5)


def main():
    global DEVICE, REFERENCE
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    if parser.parse_args().device == "cuda":
        DEVICE = torch.device("cuda", RANK % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("hoccl", rank=RANK, world_size=WORLD, timeout=timedelta(seconds=60))
    REFERENCE = dist.new_group(backend="nccl" if DEVICE.type == "cuda" else "gloo")
    passed = failed = 0
    for name, run, reference, tolerance in configurations():
        try:
            compare(name, run(), reference(), tolerance)
            passed += 1
        except Exception:
            failed += 1
            print(f"rank {RANK} FAILED {name}\n{traceback.format_exc()}", flush=True)
    totals = torch.tensor([passed, failed], device=DEVICE)
    dist.all_reduce(totals, group=REFERENCE)
    if RANK == 0:
        print(f"torch training ranks={WORLD}: {totals[0]} passed, {totals[1]} failed", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if totals[1] else 0)


if __name__ == "__main__":
    main()
