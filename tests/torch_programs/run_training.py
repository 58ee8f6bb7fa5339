"""DDP, FSDP2 and HSDP training on hoccl against gloo, one rank per process: run with
``mpiexec -n N python tests/torch_programs/run_training.py [--device cuda]
[--default-backend hoccl|reference] [--meshes 1x2,2x1] [--only HSDP]`` (MASTER_ADDR and
MASTER_PORT set).

A hoccl group and a group of the same ranks on gloo (NCCL with ``--device cuda``), the
reference; either is the default process group (``--default-backend``: hoccl, as in a
program moved to hoccl, or the reference, as in a program that keeps NCCL and makes
hoccl groups beside it).  Each configuration trains the same model from the same weights
on the same data with SGD (whose update is proportional to the gradient, so a wrong
reduction shows in the loss), and its losses, step by step, and final parameters are
compared with the reference's:

* DDP on hoccl (several buckets);
* FSDP2 on a hoccl mesh, and FSDP2 on the gloo mesh with its all-gathers and
  reduce-scatters through ``hoccl.torch.use_for_fsdp``, in fp32 and with bf16 compute
  (the latter's all-gathers into registered memory: after the first few calls, none
  exchanges descriptors);
* both with explicit asynchronous prefetch (``unshard(async_op=True)``);
* a gradient divide factor (reduce-scatter with PREMUL_SUM), against gloo given the
  same gradients by a loss scaled instead (gloo has no PREMUL_SUM);
* the reduce-scatters pulled (``pull_bytes``), and every collective a direct kernel
  (``kernel_bytes``), on groups of their own;
* HSDP: FSDP2 on a 2-D DeviceMesh (replicate, shard) made by ``init_device_mesh`` with
  ``backend_override={"shard": "hoccl", "replicate": <the reference>}``, against the same
  mesh with both dimensions on the reference; every mesh shape R x S with R * S = N
  (``--meshes`` picks some).

On a job whose hosts differ (``--devices``, ``--intra-host``, ``--local-size``: ranks on
GPUs and CPUs, engines inside hosts that differ), DDP and FSDP2 on the hoccl default group
only, each rank on its own device, against gloo with every rank on the CPU.

Prints one line per configuration with the largest differences, failures, and
``torch training ranks=N default=B: P passed, F failed`` (rank 0; P and F count every
rank's configurations).
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from datetime import timedelta
from typing import List, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import hoccl.torch
import common
from common import rank_and_world

warnings.filterwarnings("ignore")

RANK, WORLD = rank_and_world()
STEPS = 6
DEVICE = torch.device("cpu")
REFERENCE_DEVICE = torch.device("cpu")  # where the reference's runs and sums are
MIXED = False  # a job whose hosts differ (see the docstring)
REFERENCE = None  # the group the runs are compared with: gloo, or NCCL on GPUs
HOCCL = None  # the hoccl group of the same ranks
PULLED = None  # a hoccl group whose reduce-scatters pull (Options.pull_bytes)
DIRECT = None  # a hoccl group whose small collectives are direct kernels (kernel_bytes)
CHUNKED = None  # a hoccl group whose reductions run in many chunks, summed in one launch
MESHES: List[tuple] = []  # the (replicas, shards) of the HSDP runs


class Run(NamedTuple):
    """What a training run ends with: the mean loss over ranks at each step, and every
    parameter in full, on the CPU."""
    losses: List[float]
    parameters: List[torch.Tensor]


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


def train(model: nn.Module, scale: float = 1.0, prefetch=None, dtype=torch.float32) -> Run:
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
        total = loss.detach().to(REFERENCE_DEVICE, copy=True)
        dist.all_reduce(total, group=REFERENCE)  # the mean over ranks, through the reference
        losses.append(total.item() / WORLD)
    from torch.distributed.tensor import DTensor
    # a sharded parameter is gathered over its mesh (every rank takes part)
    parameters = [(parameter.full_tensor() if isinstance(parameter, DTensor) else parameter)
                  .detach().cpu() for parameter in model.parameters()]
    return Run(losses, parameters)


def ddp(group) -> Run:
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(make_model(), process_group=group, bucket_cap_mb=0.005,
                                    device_ids=[DEVICE] if DEVICE.type == "cuda" else None)
    return train(model)


def fsdp(group, hooks=None, bf16=False, prefetch=False, divide=None, scale=1.0,
         pulled=False) -> Run:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = make_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32)
    # named after the group: torch's meshes compare equal by ranks, device type and names,
    # not by group, and DTensor's caches would hand one group's mesh to the other's calls
    mesh = DeviceMesh.from_group(group, DEVICE.type,
                                 mesh_dim_names=(f"shard-{group.group_name}",))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if hooks is not None:
        installed = hoccl.torch.use_for_fsdp(model, hooks)
        assert installed.modules == 4
    if divide is not None:  # each FSDP module's own parameters
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(divide)

    def unshard_first(module):
        module[0].unshard(async_op=True).wait()
    direct = DIRECT is not None and DIRECT in (group, hooks)
    engine = hoccl.torch.communicator(DIRECT)._engine if direct else None
    kernels = engine.direct_calls if direct else 0
    chunked = CHUNKED is not None and CHUNKED in (group, hooks)
    executor = hoccl.torch.communicator(CHUNKED)._engine.executor if chunked else None
    fused = executor.fused_launches if chunked else 0
    run = train(model, scale=scale, prefetch=unshard_first if prefetch else None,
                dtype=torch.bfloat16 if bf16 else torch.float32)
    if direct:  # the model's every all-gather and reduce-scatter ran as a direct kernel
        assert engine.direct_calls - kernels >= 20, \
            f"{engine.direct_calls - kernels} direct kernels"
    if chunked:  # every step, at least the largest module's gradients (9.5 KiB, a dozen
        # chunks or more a rank) were reduce-scattered with their sums in one launch
        # (with two ranks three modules' are, with three two)
        assert executor.fused_launches - fused >= STEPS, \
            f"{executor.fused_launches - fused} one-launch chunk sums"
    if hooks is not None:
        # the all-gathers' outputs come from registered memory (use_for_fsdp's pool): none
        # exchanges descriptors; the reduce-scatters need only the peers' scratch: at most
        # one exchange for each of the 4 FSDP modules, the first reduce-scatter of a size
        # larger than before
        all_gather, reduce_scatter = installed.all_gather, installed.reduce_scatter
        assert all_gather.calls and all_gather.without_exchange == all_gather.calls, \
            f"{all_gather.without_exchange} of {all_gather.calls} all-gathers without an exchange"
        exchanged = reduce_scatter.calls - reduce_scatter.without_exchange
        assert reduce_scatter.calls and exchanged <= 4, \
            f"{exchanged} of {reduce_scatter.calls} reduce-scatters exchanged descriptors"
        if pulled:
            # the peers read each reduce-scatter's input where it lies: the hook handed out
            # every input from registered memory, so none of them exchanges descriptors
            assert reduce_scatter.pool.stats["registered"] >= 2 * reduce_scatter.calls, \
                reduce_scatter.pool.stats
            assert exchanged == 0, \
                f"{exchanged} of {reduce_scatter.calls} pulled reduce-scatters exchanged"
        if RANK == 0:
            print(f"  without an exchange: {all_gather.without_exchange} of {all_gather.calls} "
                  f"all-gathers, {reduce_scatter.without_exchange} of {reduce_scatter.calls} "
                  f"reduce-scatters", flush=True)
    return run


def hsdp(shape: tuple, shard_backend: str) -> Run:
    """FSDP2 on a 2-D mesh of ``shape`` (replicas, shards): each parameter sharded over
    the "shard" dimension's group, on ``shard_backend``, and replicated over the
    "replicate" dimension's, on the reference backend (HSDP: FSDP2 reduce-scatters the
    gradients in the shard group, then all-reduces each shard across the replicas)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    reference = dist.get_backend(REFERENCE)
    # torch takes the entries out of the dict it is given: a new one for every mesh
    mesh = init_device_mesh(DEVICE.type, shape, mesh_dim_names=("replicate", "shard"),
                            backend_override={"shard": shard_backend, "replicate": reference})
    shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
    assert (dist.get_backend(shard), dist.get_backend(replicate)) == (shard_backend, reference), \
        (dist.get_backend(shard), dist.get_backend(replicate))
    assert (replicate.size(), shard.size()) == shape, (replicate.size(), shard.size())
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    placements = {parameter.placements for parameter in model.parameters()}
    assert placements == {(Replicate(), Shard(0))}, placements
    calls = hoccl.torch.communicator(shard).calls if shard_backend == "hoccl" else 0
    run = train(model)
    if shard_backend == "hoccl" and shard.size() > 1:
        # FSDP2 calls no collective on a one-rank shard group; on a larger one it must
        # have all-gathered and reduce-scattered through hoccl
        assert hoccl.torch.communicator(shard).calls > calls, "no call went through hoccl"
    return run


def on_reference_device(run):
    """``run`` with the model and data on the reference's device (the CPU in a mixed job)."""
    def on_it():
        global DEVICE
        device, DEVICE = DEVICE, REFERENCE_DEVICE
        try:
            return run()
        finally:
            DEVICE = device
    return on_it


#: the configurations of a job whose hosts differ: the hoccl default group's
MIXED_RUNS = ("DDP", "FSDP2 on hoccl, fp32", "FSDP2 on hoccl, fp32, prefetch",
              "FSDP2 on hoccl, bf16", "FSDP2 on hoccl, bf16, prefetch",
              "FSDP2 on hoccl, divide factor (PREMUL_SUM)")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-12)


def compare(name: str, got: Run, want: Run, tolerance: float) -> None:
    """``got`` agrees with ``want`` within ``tolerance`` (relative; 0: bit for bit)."""
    assert len(got.losses) == len(want.losses) == STEPS
    assert len(got.parameters) == len(want.parameters)
    losses = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got.losses, want.losses))
    parameters = max(_relative(a, b) for a, b in zip(got.parameters, want.parameters))
    identical = got.losses == want.losses and all(
        torch.equal(a, b) for a, b in zip(got.parameters, want.parameters))
    within = "within" if max(losses, parameters) <= tolerance else "NOT within"
    if RANK == 0:
        print(f"{name}: largest relative difference of the losses {losses:.2e}, of the final "
              f"parameters {parameters:.2e} "
              f"({'identical' if identical else f'{within} {tolerance:g}'})", flush=True)
    assert losses <= tolerance, f"{name}: losses {got.losses} vs the reference's {want.losses}"
    assert parameters <= tolerance, f"{name}: final parameters differ by {parameters:.2e}"
    assert want.losses[-1] < want.losses[0], f"{name}: the reference did not train: {want.losses}"


def configurations():
    """(name, the run on hoccl, the reference run, tolerance).  A reference run is shared
    by the configurations that compare with it."""
    hoccl_group = HOCCL
    cache = {}
    # across hosts (HOCCL_LOCAL_SIZE): the runs that train; the hooks' registered memory
    # and the direct or one-launch paths are a flat communicator's (one host)
    flat = not hasattr(hoccl.torch.communicator(HOCCL), "topology")

    def reference(**settings):
        key = tuple(sorted(settings.items()))
        return on_reference_device(lambda: cache[key] if key in cache else cache.setdefault(
            key, fsdp(REFERENCE, **settings)))
    yield ("DDP", lambda: ddp(hoccl_group), on_reference_device(lambda: ddp(REFERENCE)), 1e-6)
    for bf16 in (False, True):
        for prefetch in (False, True):
            label = f"{'bf16' if bf16 else 'fp32'}{', prefetch' if prefetch else ''}"
            tolerance = 1e-2 if bf16 else 1e-6
            yield (f"FSDP2 on hoccl, {label}",
                   lambda b=bf16, p=prefetch: fsdp(hoccl_group, bf16=b, prefetch=p),
                   reference(bf16=bf16, prefetch=prefetch), tolerance)
            if flat:
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
    if flat:
        yield ("FSDP2 with hoccl hooks, divide factor (PREMUL_SUM)",
               lambda: fsdp(REFERENCE, hooks=hoccl_group, divide=divide), scaled, 1e-5)
    # a group whose reduce-scatters all pull (Options.pull_bytes): the hook hands FSDP
    # registered memory for their inputs and outputs
    for bf16 in (False, True) if flat else ():
        yield (f"FSDP2 with hoccl hooks, pulled reduce-scatters, {'bf16' if bf16 else 'fp32'}",
               lambda b=bf16: fsdp(REFERENCE, hooks=PULLED, bf16=b, pulled=True),
               reference(bf16=bf16, prefetch=False), 1e-2 if bf16 else 1e-6)
    # FSDP2 on a group, and through its hooks, whose calls run another way: DIRECT's small
    # collectives as direct kernels (Options.kernel_bytes: every call of this model; the
    # hooks hand out registered memory for the all-gathers' outputs and the reduce-scatters'
    # inputs, read by the peers' kernels), CHUNKED's reductions in 256-byte chunks, each
    # rank's sums of a call in one launch that waits for every chunk's copies (fuse_sums,
    # set on: it is off by default where ranks share a GPU)
    for group, way in ((DIRECT, "direct kernels"), (CHUNKED, "chunk sums in one launch")) \
            if flat else ():
        for bf16 in (False, True):
            label = "bf16" if bf16 else "fp32"
            yield (f"FSDP2 on hoccl, {way}, {label}",
                   lambda g=group, b=bf16: fsdp(g, bf16=b),
                   reference(bf16=bf16, prefetch=False), 1e-2 if bf16 else 1e-6)
            yield (f"FSDP2 with hoccl hooks, {way}, {label}",
                   lambda g=group, b=bf16: fsdp(REFERENCE, hooks=g, bf16=b),
                   reference(bf16=bf16, prefetch=False), 1e-2 if bf16 else 1e-6)
    reference_backend = dist.get_backend(REFERENCE)
    for replicas, shards in MESHES:
        # Both runs all-reduce across the replicas on the reference backend; they differ
        # in the shard dimension's all-gather (a copy) and reduce-scatter (an average,
        # in fp32).  An average of two is their sum (the same in either order) halved
        # (exact, whether before the sum, as NCCL may, or after it), so with up to 2
        # shards the runs agree bit for bit; with more, hoccl may sum in another order
        # than the reference and the last bits differ.  With one shard FSDP2 calls no
        # collective on the shard group at all.
        tolerance = 0.0 if shards <= 2 else 1e-6
        yield (f"HSDP {replicas}x{shards}, shard on hoccl, replicate on {reference_backend}",
               lambda shape=(replicas, shards): hsdp(shape, "hoccl"),
               lambda shape=(replicas, shards): hsdp(shape, reference_backend), tolerance)


def mesh_shapes(text: str) -> List[tuple]:
    """``"1x2,2x1"`` as [(1, 2), (2, 1)]; "" as every shape of WORLD ranks."""
    if not text:
        return [(replicas, WORLD // replicas) for replicas in range(1, WORLD + 1)
                if WORLD % replicas == 0]
    shapes = [tuple(int(size) for size in item.split("x")) for item in text.split(",")]
    for shape in shapes:
        if len(shape) != 2 or shape[0] * shape[1] != WORLD:
            raise SystemExit(f"--meshes: {shape} is not replicas x shards = {WORLD} ranks")
    return shapes


def main():
    global DEVICE, REFERENCE_DEVICE, MIXED, REFERENCE, HOCCL, PULLED, DIRECT, CHUNKED, MESHES
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--default-backend", choices=("hoccl", "reference"), default="hoccl",
                        help="the default process group's backend: hoccl, or the reference "
                             "(gloo; NCCL with --device cuda)")
    parser.add_argument("--meshes", default="", help="HSDP mesh shapes, e.g. 1x2,2x1 "
                        "(replicas x shards; default: every shape of the world)")
    parser.add_argument("--reference", choices=("gloo", "nccl", "hoccl"), default=None,
                        help="the reference backend (default: NCCL with --device cuda, else "
                             "gloo); hoccl: a second hoccl group without registered memory "
                             "or hooks, for one GPU shared by the ranks, where NCCL refuses")
    parser.add_argument("--only", default="", help="run only the configurations whose name "
                        "contains this text (e.g. HSDP)")
    parser.add_argument("--inter-host", default=None, choices=("mpi", "gloo", "ucx", "hoccl"),
                        help="the engine between simulated hosts (HOCCL_LOCAL_SIZE) of the "
                             "default group, when it is hoccl's")
    common.add_placement(parser)
    args = parser.parse_args()
    if args.device == "cuda":
        DEVICE = torch.device("cuda", RANK % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
    MIXED = common.place(args, RANK, WORLD)
    if MIXED:
        DEVICE = common.DEVICE
    REFERENCE_DEVICE = torch.device("cpu") if MIXED else DEVICE
    MESHES = mesh_shapes(args.meshes)
    reference = args.reference or ("nccl" if REFERENCE_DEVICE.type == "cuda" else "gloo")
    default = "hoccl" if args.default_backend == "hoccl" else reference
    options = (hoccl.torch.Options(inter_host=args.inter_host)
               if args.inter_host and default == "hoccl" else None)
    dist.init_process_group(default, rank=RANK, world_size=WORLD, timeout=timedelta(seconds=60),
                            pg_options=options)
    world = dist.distributed_c10d._get_default_group()
    if default == "hoccl":
        HOCCL, REFERENCE = world, dist.new_group(backend=reference)
    else:
        HOCCL, REFERENCE = dist.new_group(backend="hoccl"), world
    if not MIXED:
        PULLED = dist.new_group(backend="hoccl", pg_options=hoccl.torch.Options(
            settings={"pull_bytes": 1 << 30}))
        DIRECT = dist.new_group(backend="hoccl", pg_options=hoccl.torch.Options(
            settings={"kernel_bytes": 1 << 20}))
        CHUNKED = dist.new_group(backend="hoccl", pg_options=hoccl.torch.Options(
            settings={"chunk_bytes": 256, "fuse_sums": True}))
    communicator = hoccl.torch.communicator(HOCCL)
    described = communicator.describe() if hasattr(communicator, "topology") else {}
    if RANK == 0 and "inter_host" in described:
        print(f"across hosts: {described['inter_host']}", flush=True)
    passed = failed = 0
    for name, run, reference_run, tolerance in configurations():
        if args.only not in name or (MIXED and name not in MIXED_RUNS):
            continue
        try:
            compare(name, run(), reference_run(), tolerance)
            passed += 1
        except Exception:
            failed += 1
            print(f"rank {RANK} FAILED {name}\n{traceback.format_exc()}", flush=True)
    totals = torch.tensor([passed, failed], device=REFERENCE_DEVICE)
    dist.all_reduce(totals, group=REFERENCE)
    if RANK == 0:
        print(f"torch training ranks={WORLD} default={default}{' mixed' if MIXED else ''}: "
              f"{totals[0]} passed, "
              f"{totals[1]} failed", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if totals[1] else 0)


if __name__ == "__main__":
    main()
