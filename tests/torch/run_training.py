"""DDP and FSDP2 training on hoccl against gloo, one rank per process: run with
``mpiexec -n N python tests/torch/run_training.py`` (MASTER_ADDR/MASTER_PORT set).

The default process group is hoccl (host backend); a gloo group of the same ranks is the
reference.  Each configuration trains the same model from the same weights on the same
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


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # 37 and 29 wide: shards are uneven and padded
    return nn.Sequential(nn.Linear(37, 64), nn.Tanh(), nn.Linear(64, 29), nn.Tanh(),
                         nn.Linear(29, 5))


def data():
    """Rank ``RANK``'s batch, the same at every step (so the loss falls step by step):
    targets a fixed linear map of the inputs, plus noise."""
    mapping = torch.randn(37, 5, generator=torch.Generator().manual_seed(7)) / 6
    generator = torch.Generator().manual_seed(1000 + RANK)
    inputs = torch.randn(8, 37, generator=generator)
    return inputs, inputs @ mapping + 0.01 * torch.randn(8, 5, generator=generator)


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
        dist.all_reduce(total, group=GLOO)  # the mean over ranks, through the reference
        losses.append(total.item() / WORLD)
    return losses


def ddp(group) -> list:
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(make_model(), process_group=group, bucket_cap_mb=0.005)
    return train(model)


def fsdp(group, hooks=None, bf16=False, prefetch=False, divide=None) -> list:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = make_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32)
    mesh = DeviceMesh.from_group(group, "cpu")
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
    return train(model, prefetch=unshard_first if prefetch else None,
                 dtype=torch.bfloat16 if bf16 else torch.float32)


def compare(name, got, want, tolerance):
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))
    if RANK == 0:
        print(f"{name}: largest relative loss difference {worst:.2e} "
              f"({'identical' if got == want else 'within ' + format(tolerance, 'g')})",
              flush=True)
    assert len(got) == len(want) == STEPS
    assert worst <= tolerance, f"{name}: losses {got} vs gloo {want}"
    assert want[-1] < want[0], f"{name}: the reference did not train: {want}"


def configurations():
    hoccl_group = dist.distributed_c10d._get_default_group()
    reference = {}

    def gloo(key, run):
        if key not in reference:
            reference[key] = run()
        return reference[key]
    yield "DDP", lambda: compare("DDP", ddp(hoccl_group), gloo("ddp", lambda: ddp(GLOO)), 1e-6)
    for bf16 in (False, True):
        for prefetch in (False, True):
            label = f"{'bf16' if bf16 else 'fp32'}{' prefetch' if prefetch else ''}"
            tolerance = 1e-2 if bf16 else 1e-6

            def want(b=bf16, p=prefetch):
                return gloo(("fsdp", b, p), lambda: fsdp(GLOO, bf16=b, prefetch=p))
            yield f"FSDP2 on hoccl {label}", lambda b=bf16, p=prefetch, t=tolerance, w=want: compare(
                f"FSDP2 on hoccl {p and 'prefetch ' or ''}{b and 'bf16' or 'fp32'}",
                fsdp(hoccl_group, bf16=b, prefetch=p), w(), t)
            yield f"FSDP2 hooks {label}", lambda b=bf16, p=prefetch, t=tolerance, w=want: compare(
                f"FSDP2 on gloo, hoccl hooks {p and 'prefetch ' or ''}{b and 'bf16' or 'fp32'}",
                fsdp(GLOO, hooks=hoccl_group, bf16=b, prefetch=p), w(), t)
    divide = 2.0 * WORLD  # not the world size: FSDP2 sends PREMUL_SUM(1 / divide)
    scaled = lambda: gloo("scaled", lambda: _scaled_reference(WORLD / divide))
    yield "FSDP2 divide factor on hoccl", lambda: compare(
        "FSDP2 on hoccl, divide factor (PREMUL_SUM)", fsdp(hoccl_group, divide=divide),
        scaled(), 1e-5)
    yield "FSDP2 divide factor hooks", lambda: compare(
        "FSDP2 on gloo, hoccl hooks, divide factor (PREMUL_SUM)",
        fsdp(GLOO, hooks=hoccl_group, divide=divide), scaled(), 1e-5)


def _scaled_reference(scale: float) -> list:
    """gloo's AVG of gradients of ``scale * loss``: the gradients PREMUL_SUM gives."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    model = make_model()
    mesh = DeviceMesh.from_group(GLOO, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return train(model, scale=scale)


def main():
    global GLOO
    dist.init_process_group("hoccl", rank=RANK, world_size=WORLD, timeout=timedelta(seconds=60))
    GLOO = dist.new_group(backend="gloo")
    passed = failed = 0
    for name, case in configurations():
        try:
            case()
            passed += 1
        except Exception:
            failed += 1
            print(f"rank {RANK} FAILED {name}\n{traceback.format_exc()}", flush=True)
    totals = torch.tensor([passed, failed])
    dist.all_reduce(totals, group=GLOO)
    if RANK == 0:
        print(f"torch training ranks={WORLD}: {totals[0]} passed, {totals[1]} failed", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if totals[1] else 0)


GLOO = None

if __name__ == "__main__":
    main()
