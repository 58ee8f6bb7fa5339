"""torch.distributed.pipelining on the "hoccl" backend, unchanged, across (simulated)
hosts, under mpiexec::

    HOCCL_LOCAL_SIZE=1 mpiexec -n 2 python tests/torch_programs/run_pipeline.py
    HOCCL_LOCAL_SIZE=2 mpiexec -n 4 python tests/torch_programs/run_pipeline.py --mesh

Every schedule of torch's (``SCHEDULES``: one stage per rank, two per rank in loops, or
in a V) runs one step of a model of small Linear+Tanh stages, 4 microbatches (one per
stage where there are more), on the hoccl process group and again on a gloo group: each
rank's gradients of its stages and
the last stage's losses must equal a single-process reference (the same stages, one
microbatch after another, gradients summed and divided by the microbatches as the
schedules scale them) within ``TOLERANCE``, and gloo's bit for bit.  A gradient the
step did not write reads as NaN, so a stage that was skipped shows.

``--pp rails``: the schedules run on the groups of ranks with one local rank (one rank
per host, so every stage's neighbours are on other hosts), each group a pipeline.

``--mesh``: pipeline × data parallel on a 2-D DeviceMesh ("pp", "dp") of the world
(pp across hosts, dp inside them: ranks [[0, 1], [2, 3]]): 3 training steps of 1F1B,
each dp rank on its own data, gradients summed over "dp" and divided; the losses and
parameters must equal the same run's on gloo groups bit for bit.

``--devices cpu,cuda,...`` places each rank (a job whose hosts differ: stages alternate
device kinds); the reference and gloo then run on CPU copies.  ``--inter-host`` picks the
engine between hosts (``hoccl.torch.Options``).  ``--json PATH`` writes each check's
largest relative difference from the reference.  Rank 0 prints ``pipeline ranks=N ...:
P passed, F failed``; the exit status is non-zero when any failed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

import hoccl.torch  # noqa: F401  (registers the "hoccl" backend)
import common
from common import rank_and_world

RANK, WORLD = rank_and_world()
WIDTH, BATCH, MICROBATCHES = 16, 8, 4


def microbatches(stages: int) -> int:
    """A step's microbatches: ``MICROBATCHES``, or one per stage where there are more
    stages (DualPipeV takes no fewer; ``BATCH`` rows hold up to 8)."""
    return max(MICROBATCHES, stages)
#: gradients and losses against the single-process reference: the stages compute what it
#: computes, in the same order, except where a schedule splits a backward in two
TOLERANCE = 1e-5

#: name: (schedule class, stages per rank, placement: "loop" (stage r + k·pp) or "v")
SCHEDULES = {
    "GPipe": ("ScheduleGPipe", 1, "loop"),
    "1F1B": ("Schedule1F1B", 1, "loop"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2, "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", 2, "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2, "v"),
    "DualPipeV": ("ScheduleDualPipeV", 2, "v"),
}


def stage_indices(rank: int, pp: int, per_rank: int, placement: str) -> list:
    if placement == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_rank)]


def build_stages(count: int, seed: int) -> list:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(count)]


def inputs(seed: int) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, WIDTH, generator=generator),
            torch.randn(BATCH, WIDTH, generator=generator))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def reference(stages: list, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """The schedules' step in one process: each microbatch through every stage, its loss
    backward; gradients summed, then divided by the microbatches."""
    stages = copy.deepcopy(stages)
    losses = []
    count = microbatches(len(stages))
    for xm, ym in zip(x.chunk(count), y.chunk(count)):
        out = xm
        for stage in stages:
            out = stage(out)
        loss = loss_fn(out, ym)
        loss.backward()
        losses.append(loss.detach())
    grads = [[p.grad / count for p in stage.parameters()] for stage in stages]
    return losses, grads


def run_schedule(name: str, group, device: torch.device, seed: int) -> tuple:
    """One step of ``name`` on ``group`` (the whole world): (losses on the last stage's
    rank, {stage index: its gradients}), on the CPU."""
    class_name, per_rank, placement = SCHEDULES[name]
    pp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    count = pp * per_rank
    modules = build_stages(count, seed)
    mine = stage_indices(rank, pp, per_rank, placement)
    stages = []
    for index in mine:
        module = modules[index].to(device)
        stages.append(pipelining.PipelineStage(module, index, count, device, group=group))
    schedule_class = getattr(pipelining, class_name)
    schedule = schedule_class(stages if per_rank > 1 else stages[0],
                              n_microbatches=microbatches(count), loss_fn=loss_fn)
    x, y = inputs(seed)
    args = (x.to(device),) if 0 in mine else ()
    last = count - 1 in mine
    losses: list = []
    schedule.step(*args, target=y.to(device) if last else None,
                  losses=losses if last else None)
    grads = {index: [p.grad.detach().cpu() if p.grad is not None else
                     torch.full_like(p, float("nan")).cpu()
                     for p in modules[index].parameters()] for index in mine}
    return [loss.detach().cpu() for loss in losses], grads


def largest_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item() or 1.0
    return (got - want).abs().max().item() / scale


def check_schedule(name: str, hoccl_group, gloo_group, device: torch.device,
                   seed: int, exact: bool = True) -> dict:
    """``name`` on hoccl and on gloo against the reference; ``exact``: every rank computes
    on the CPU, so hoccl's results are gloo's bit for bit (else within ``TOLERANCE``: a
    GPU stage's arithmetic is its own)."""
    losses, grads = run_schedule(name, hoccl_group, device, seed)
    gloo_losses, gloo_grads = run_schedule(name, gloo_group, torch.device("cpu"), seed)
    class_name, per_rank, _ = SCHEDULES[name]
    pp = dist.get_world_size(hoccl_group)
    want_losses, want_grads = reference(build_stages(pp * per_rank, seed), *inputs(seed))
    worst = 0.0
    for index, stage_grads in grads.items():
        for k, (got, gloo, want) in enumerate(zip(stage_grads, gloo_grads[index],
                                                  want_grads[index])):
            what = f"{name}: stage {index} gradient {k}"
            assert not torch.isnan(got).any(), f"{what}: not written (NaN)"
            assert (torch.equal(got.view(torch.int32), gloo.view(torch.int32)) if exact else
                    largest_difference(got, gloo) <= TOLERANCE), \
                f"{what}: differs from gloo's by {largest_difference(got, gloo):.3g}"
            difference = largest_difference(got, want)
            assert difference <= TOLERANCE, f"{what}: {difference:.3g} from the reference"
            worst = max(worst, difference)
    if losses or want_losses and gloo_losses:
        assert len(losses) == microbatches(pp * per_rank) == len(gloo_losses), \
            f"{name}: {len(losses)} losses on hoccl, {len(gloo_losses)} on gloo"
        for k, (got, gloo, want) in enumerate(zip(losses, gloo_losses, want_losses)):
            assert (torch.equal(got, gloo) if exact else
                    largest_difference(got, gloo) <= TOLERANCE), \
                f"{name}: loss {k} {got} on hoccl, {gloo} on gloo"
            difference = largest_difference(got, want)
            assert difference <= TOLERANCE, f"{name}: loss {k} {difference:.3g} off"
            worst = max(worst, difference)
    return {"schedule": name, "stages_per_rank": per_rank, "pp": pp,
            "largest_relative_difference": worst}


def train_mesh(mesh, device: torch.device, steps: int = 3) -> tuple:
    """1F1B over the mesh's "pp" groups, each "dp" rank on its own data, gradients summed
    over "dp" and divided: (losses of the last stage, every parameter after the steps)."""
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    pp, dp = dist.get_world_size(pp_group), dist.get_world_size(dp_group)
    pp_rank, dp_rank = dist.get_rank(pp_group), dist.get_rank(dp_group)
    modules = build_stages(pp, 5)
    module = modules[pp_rank].to(device)
    stage = pipelining.PipelineStage(module, pp_rank, pp, device, group=pp_group)
    schedule = pipelining.Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x, y = inputs(1000 + 10 * step + dp_rank)
        mine: list = []
        schedule.step(*((x.to(device),) if pp_rank == 0 else ()),
                      target=y.to(device) if pp_rank == pp - 1 else None,
                      losses=mine if pp_rank == pp - 1 else None)
        for parameter in module.parameters():
            dist.all_reduce(parameter.grad, group=dp_group)
            parameter.grad /= dp
        optimizer.step()
        losses += [loss.detach().cpu() for loss in mine]
    return losses, [p.detach().cpu().clone() for p in module.parameters()]


def check_mesh(device: torch.device) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    shape = (2, WORLD // 2) if WORLD > 2 else (WORLD, 1)
    kind = device.type
    mesh = init_device_mesh(kind, shape, mesh_dim_names=("pp", "dp"))
    gloo_mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp"),
                                 backend_override={"pp": "gloo", "dp": "gloo"})
    pp_comm = hoccl.torch.communicator(mesh.get_group("pp"))
    # pp joins the halves of the world: across hosts unless one host holds every rank
    across = int(os.environ.get("HOCCL_LOCAL_SIZE", WORLD)) < WORLD
    assert isinstance(pp_comm, hoccl.HierarchicalCommunicator) == across, \
        f"mesh: the pp group {pp_comm!r} {'is not' if across else 'is'} across hosts"
    losses, parameters = train_mesh(mesh, device)
    gloo_losses, gloo_parameters = train_mesh(gloo_mesh, torch.device("cpu"))
    assert len(losses) == len(gloo_losses), f"mesh: {len(losses)} losses, gloo {len(gloo_losses)}"
    for k, (got, want) in enumerate(zip(losses, gloo_losses)):
        assert torch.equal(got, want), f"mesh {shape}: loss {k} {got}, gloo's {want}"
    for k, (got, want) in enumerate(zip(parameters, gloo_parameters)):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
            f"mesh {shape}: parameter {k} differs from gloo's by {largest_difference(got, want)}"
    return {"mesh": list(shape), "pp_group": repr(pp_comm),
            "losses": [float(loss) for loss in losses]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--pp", choices=("world", "rails"), default="world",
                        help="the schedules' groups: the world, or the ranks of one local "
                             "rank (one per host: every stage's neighbour on another host)")
    parser.add_argument("--mesh", action="store_true", help="also pp x dp on a 2-D DeviceMesh")
    parser.add_argument("--inter-host", default=None, choices=("mpi", "gloo", "ucx", "hoccl", "nccl"))
    parser.add_argument("--json", default="", help="write the results here (rank 0)")
    common.add_placement(parser)
    args = parser.parse_args()
    mixed = common.place(args, RANK, WORLD)
    device = common.DEVICE
    options = hoccl.torch.Options(inter_host=args.inter_host) if args.inter_host else None
    dist.init_process_group("hoccl", rank=RANK, world_size=WORLD,
                            timeout=timedelta(seconds=30), pg_options=options)
    world_group = dist.distributed_c10d._get_default_group()
    gloo_world = dist.new_group(backend="gloo")
    hoccl_group, gloo_group = world_group, gloo_world
    if args.pp == "rails":
        local_size = int(os.environ.get("HOCCL_LOCAL_SIZE", WORLD))
        rails = [list(range(local, WORLD, local_size)) for local in range(local_size)]
        hoccl_group, _ = dist.new_subgroups_by_enumeration(rails, backend="hoccl",
                                                           pg_options=options)
        gloo_group, _ = dist.new_subgroups_by_enumeration(rails, backend="gloo")
    passed = failed = 0
    results = []
    exact = "cuda" not in args.devices  # every rank computes on the CPU
    checks = [(name, lambda name=name, seed=seed: check_schedule(
        name, hoccl_group, gloo_group, device, seed, exact))
        for seed, name in enumerate(args.schedules.split(","), start=1)]
    if args.mesh:
        checks.append(("pp x dp mesh", lambda: check_mesh(device)))
    for name, check in checks:
        try:
            result = check()
            results.append(result)
            passed += 1
            if RANK == 0:
                print(f"{name}: OK {result}", flush=True)
        except Exception:
            failed += 1
            print(f"rank {RANK} FAILED {name}\n{traceback.format_exc()}", flush=True)
    totals = torch.tensor([passed, failed])
    dist.all_reduce(totals, group=gloo_world)
    comm = hoccl.torch.communicator(hoccl_group)
    described = comm.describe() if hasattr(comm, "describe") else {}
    if RANK == 0:
        print(f"pipeline ranks={WORLD} pp={args.pp} inter={described.get('inter_host', 'none')}"
              f"{' mixed' if mixed else ''}: {int(totals[0])} passed, {int(totals[1])} failed",
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": WORLD, "describe": described, "results": results,
                           "passed": int(totals[0]), "failed": int(totals[1])}, f, indent=1,
                          default=str)
    dist.destroy_process_group()
    sys.exit(1 if totals[1] else 0)


if __name__ == "__main__":
    main()
