"""Registered tensors and CUDA graphs through the hoccl torch.distributed backend, under
``mpiexec -n N python run_registered.py [--device cpu|cuda]``.

``hoccl.torch.empty`` tensors: all_reduce, all_gather_into_tensor and
reduce_scatter_tensor on views at the same offsets on every rank, checked bit for bit
against each rank's own reference, and counted as calls made without a descriptor
exchange.  On cuda, the same three ops captured into a ``torch.cuda.graph`` and replayed
100 times with fresh inputs, every output checked.  Rank 0 prints ``registered torch:
N passed, M failed``.
"""

import argparse
import sys
import traceback

import torch
import torch.distributed as dist

import common
import hoccl.torch
from common import data, expect_bits, rank_and_world, reference


def buffers(world, count):
    slab = hoccl.torch.empty(6 * world * count, dtype=torch.float32)
    views = {"reduce": slab[:world * count], "gather": slab[world * count:2 * world * count],
             "scatter_in": slab[2 * world * count:3 * world * count],
             "scatter_out": slab[3 * world * count:3 * world * count + count]}
    return slab, views


def load(views, rank, world, count, seed):
    inputs = {name: [data(seed + index, r, (world * count,), torch.float32)
                     for r in range(world)] for index, name in enumerate(("reduce", "scatter"))}
    views["reduce"].copy_(inputs["reduce"][rank])
    views["scatter_in"].copy_(inputs["scatter"][rank])
    views["gather"].fill_(float("nan"))
    views["scatter_out"].fill_(float("nan"))
    mine = data(seed + 7, rank, (count,), torch.float32)
    views["gather"][rank * count:(rank + 1) * count].copy_(mine)
    inputs["gather"] = [data(seed + 7, r, (count,), torch.float32) for r in range(world)]
    return inputs


def issue(views, rank, count):
    dist.all_reduce(views["reduce"])
    dist.all_gather_into_tensor(views["gather"], views["gather"][rank * count:(rank + 1) * count])
    dist.reduce_scatter_tensor(views["scatter_out"], views["scatter_in"])


def check(views, inputs, rank, count, what):
    expect_bits(views["reduce"], reference(inputs["reduce"], "sum", None), f"{what} all_reduce")
    expect_bits(views["gather"], torch.cat(inputs["gather"]), f"{what} all_gather")
    expect_bits(views["scatter_out"],
                reference(inputs["scatter"], "sum", None)[rank * count:(rank + 1) * count],
                f"{what} reduce_scatter")


def eager(rank, world):
    count = 1000
    comm = hoccl.torch.communicator()
    slab, views = buffers(world, count)
    before = comm._engine.issued_fast
    for step in range(5):
        inputs = load(views, rank, world, count, 100 * step)
        issue(views, rank, count)
        check(views, inputs, rank, count, f"eager step {step}")
    fast = comm._engine.issued_fast - before
    # the first reduction of a size learns the peers' scratch by an exchange
    assert fast >= 5 * 3 - 2, f"only {fast} of 15 calls went without an exchange"
    comm.deregister(slab)
    return f"{fast} of 15 calls without an exchange"


def graphs(rank, world):
    if common.DEVICE.type != "cuda":
        return "skipped (no graphs on the host backend)"
    count = 1000
    slab, views = buffers(world, count)
    inputs = load(views, rank, world, count, 1)
    issue(views, rank, count)  # eager first: the scratch of this size is known
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        issue(views, rank, count)
    for step in range(100):
        inputs = load(views, rank, world, count, 1000 + 10 * step)
        graph.replay()
        torch.cuda.synchronize()
        check(views, inputs, rank, count, f"replay {step}")
    del graph
    hoccl.torch.communicator().deregister(slab)
    return "100 replays of 3 captured ops"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rank, world = rank_and_world()
    if args.device == "cuda":
        common.use_device(torch.device("cuda", rank % torch.cuda.device_count()))
    dist.init_process_group("hoccl", rank=rank, world_size=world)
    results = []
    for name, check_ in (("eager on registered tensors", eager), ("graphs", graphs)):
        try:
            outcome, ok = check_(rank, world), True
        except Exception:
            outcome, ok = None, False
            print(f"rank {rank} FAILED {name}\n{traceback.format_exc()}", flush=True)
        flags = torch.tensor([int(ok)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # the gloo group beside a GPU group
        results.append(bool(flags.item()))
        if rank == 0:
            print(f"{'ok    ' if results[-1] else 'FAILED'} {name}: {outcome}", flush=True)
    failed = results.count(False)
    if rank == 0:
        print(f"registered torch: {len(results) - failed} passed, {failed} failed", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
