"""Where a small call's time goes: host µs per call (no sync), then a cProfile of the
same loop on rank 0.  Run: mpirun -np 2 python3 tools/profile_call.py [--size 1M]
"""
import argparse
import cProfile
import io
import pstats
import time

import torch
from mpi4py import MPI

import hoccl
from hoccl.bench._harness import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="1M")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--collective", default="all_gather")
    args = parser.parse_args()
    comm = hoccl.init(backend="cuda")
    torch.cuda.set_device(comm.device)
    n, rank = comm.world_size, comm.rank
    nbytes = parse_size(args.size)
    recv = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    block = recv.numel() // n
    send = recv[rank * block:(rank + 1) * block]
    stream = torch.cuda.Stream()
    run = lambda: comm.all_gather(send, recv, stream=stream)  # noqa: E731
    for _ in range(100):
        run()
    comm.synchronize()
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        run()
    host = (time.perf_counter() - start) / args.iters * 1e6
    comm.synchronize()
    total = (time.perf_counter() - start) / args.iters * 1e6
    print(f"rank {rank}: {args.collective} {args.size} in place: host {host:.1f} µs/call, "
          f"with GPU {total:.1f} µs/call", flush=True)
    profile = cProfile.Profile()
    MPI.COMM_WORLD.Barrier()
    profile.enable()
    for _ in range(args.iters):
        run()
    comm.synchronize()
    profile.disable()
    if rank == 0:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue())
    comm.close()


if __name__ == "__main__":
    main()
