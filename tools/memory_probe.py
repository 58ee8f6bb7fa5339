"""How fast this machine's memory moves bytes when every rank copies at once: the roof
over a job whose hosts share one machine (every phase of a mixed job's CPU side, and the
cross-memory reads between its hosts, are copies and folds in one memory system).

  mpirun -np 4 python tools/memory_probe.py --bytes 256M --threads 1,2,4

For each thread count, every rank at once: a copy of ``--bytes`` within its own memory
(numpy, split over the threads), then a read of its neighbour's (rank + 1) memory with
``process_vm_readv`` (hoccl's ``move``, split the same way), and a two-input sum
(``reduce_into``).  Prints the aggregate GB/s copied (all ranks' bytes over the slowest
rank's time, best of ``--iters``) and that rate's memory traffic (a copy reads and
writes each byte: twice; a sum of two reads two and writes one: three times).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", default="256M")
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    from mpi4py import MPI
    from hoccl._dtypes import reduce_into
    from hoccl._threads import run_parts, split
    from hoccl.backends._cross_memory import RemotePtr, move_piece
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    nbytes = int(args.bytes[:-1]) << {"K": 10, "M": 20, "G": 30}[args.bytes[-1]]
    src, dst, other = (np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8),
                       np.ones(nbytes, np.uint8))
    pids = world.allgather((os.getpid(), src.ctypes.data))
    peer_pid, peer_at = pids[(rank + 1) % size]

    def best(run) -> float:
        times = []
        for _ in range(args.iters):
            world.Barrier()
            start = time.perf_counter()
            run()
            times.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
        return min(times)

    if rank == 0:
        print(f"# {size} ranks at once, {args.bytes} each; GB/s moved by all ranks "
              f"(memory traffic in brackets)")
        print(f"{'threads':>7} {'copy':>18} {'read a peer':>18} {'sum of two':>18}")
    for threads in (int(t) for t in args.threads.split(",")):
        parts = split(nbytes, threads, 64)

        def copy() -> None:
            run_parts(lambda a, b: np.copyto(dst[a:b], src[a:b]), parts)

        def read() -> None:
            run_parts(lambda a, b: move_piece(dst.ctypes.data + a,
                                               RemotePtr(peer_pid, peer_at + a), b - a), parts)

        def fold() -> None:
            reduce_into(dst.view(np.float32), [src.view(np.float32), other.view(np.float32)],
                        "sum", threads=threads)
        rates = [size * nbytes / best(run) / 1e9 for run in (copy, read, fold)]
        if rank == 0:
            traffic = [rates[0] * 2, rates[1] * 2, rates[2] * 3]
            cells = " ".join(f"{r:8.1f} ({t:6.1f})" for r, t in zip(rates, traffic))
            print(f"{threads:7d} {cells}", flush=True)


if __name__ == "__main__":
    main()
