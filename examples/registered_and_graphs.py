#!/usr/bin/env python3
"""Registered buffers and CUDA graphs: small calls with no host work per call.

  mpirun -np 2 python examples/registered_and_graphs.py          # GPUs: eager, then a graph
  mpiexec -n 2 python examples/registered_and_graphs.py --backend host   # no GPU: eager only

Every rank registers one array (``hoccl.empty``: collective) and carves its buffers from
it at the same offsets as every other rank.  Calls on such buffers need no descriptor
exchange: they are issued at once.  On GPUs the same calls are then captured into a
``torch.cuda.graph`` and replayed, which takes no host work of hoccl's at all.  Each
step's result is checked against numpy; rank 0 prints one line per phase.

The host run is part of the test suite; the GPU run is ``bash tools/gpu_run.sh validate``.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

import hoccl


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("cuda", "host"), default=None)
    parser.add_argument("--count", type=int, default=1 << 16, help="elements per rank")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    comm = hoccl.init(backend=args.backend)
    n, rank, count = comm.world_size, comm.rank, args.count
    gpu = comm.backend == "cuda"
    if gpu:
        import torch
        torch.cuda.set_device(comm.device)

    # one registered array per rank; every view below sits at the same offset on every rank
    slab = hoccl.empty(3 * n * count, "float32", comm, framework="torch" if gpu else "numpy")
    gathered = slab[:n * count]                      # all_gather in place: own block inside
    mine = gathered[rank * count:(rank + 1) * count]
    summed = slab[n * count:2 * n * count]           # all_reduce in place

    def load(step):
        values = np.full(count, step * n + rank, np.float32)
        totals = np.arange(n * count, dtype=np.float32) * (rank + 1)
        if gpu:
            mine.copy_(torch.from_numpy(values))
            summed.copy_(torch.from_numpy(totals))
        else:
            mine[:] = values
            summed[:] = totals

    def expected(step):
        gather = np.concatenate([np.full(count, step * n + r, np.float32) for r in range(n)])
        return gather, np.arange(n * count, dtype=np.float32) * (n * (n + 1) // 2)

    def read(array):
        return array.cpu().numpy() if gpu else np.asarray(array)

    def issue():
        comm.all_gather(mine, gathered)
        comm.all_reduce(summed, summed, "sum")

    def check(step, phase):
        if gpu:
            torch.cuda.synchronize()
        comm.synchronize()
        want_gather, want_sum = expected(step)
        if not (np.array_equal(read(gathered), want_gather)
                and np.array_equal(read(summed), want_sum)):
            raise SystemExit(f"rank {rank}: {phase} step {step}: wrong result")

    before = comm._engine.issued_fast
    for step in range(args.steps):
        load(step)
        issue()
        check(step, "eager")
    fast = comm._engine.issued_fast - before
    if rank == 0:
        print(f"eager: {args.steps} steps checked; {fast} of {2 * args.steps} calls went "
              f"without a descriptor exchange (the first all_reduce learns the peers' scratch)")

    if gpu:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            issue()
        for step in range(args.steps):
            load(1000 + step)
            graph.replay()
            check(1000 + step, "graph")
        del graph
        if rank == 0:
            print(f"graph: {args.steps} replays checked")
    elif rank == 0:
        print("graph: skipped (CUDA graphs need the cuda backend)")

    comm.deregister(slab)
    comm.close()
    MPI.COMM_WORLD.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
