"""Communicators split and closed many times under mpirun (host backend): run with
``mpiexec -n N python run_split_cycles.py [--cycles 10000] [--every 1000]``.

Each cycle splits ``hoccl.init()``'s communicator (every rank, one color), checks an
all_reduce on the child against numpy every ``--every`` cycles (and in the first), and
closes the child.  After 20 warm-up cycles each rank counts what a cycle could leave
behind: signal pads in use (or held by a peer) and free for reuse, its device's live
allocations (scratch, rings, host words), the peers' pads and segments it has mapped,
its open files and threads; and its resident set.  Every ``--every`` cycles it prints
``rank R cycle C counts {...} rss_kib K``; at the end ``rank R: FLAT ...`` when every
count is what it was after the warm-up, else ``rank R: GREW ...``.
"""

import argparse
import os
import threading

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.backends import host


def counts(comm) -> dict:
    device = comm.device_handle
    in_use, free = host.pad_counts()
    return dict(pads_in_use=in_use, pads_free=free, allocations=device.allocations,
                held_pads=device.held_pads, mapped_segments=device.mapped_segments,
                open_files=len(os.listdir("/proc/self/fd")),
                threads=threading.active_count())


def resident_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=10000)
    parser.add_argument("--every", type=int, default=1000)
    args = parser.parse_args()
    parent = hoccl.init(backend="host")
    rank = parent.rank
    wrong = 0

    def cycle(index: int) -> None:
        nonlocal wrong
        child = parent.split(0)
        if index % args.every == 0 or index == 1:
            rng = np.random.default_rng([index, rank])
            data = rng.integers(-1000, 1000, 1000 + index % 7).astype(np.int64)
            want = sum(np.random.default_rng([index, peer]).integers(
                -1000, 1000, data.size).astype(np.int64) for peer in range(child.world_size))
            out = np.full_like(data, -(1 << 62))
            child.all_reduce(data, out)
            child.synchronize()
            wrong += int(not np.array_equal(out, want))
        child.close()
    for index in range(1, 21):
        cycle(index)
    MPI.COMM_WORLD.Barrier()
    before, rss = counts(parent), resident_kib()
    for index in range(21, 21 + args.cycles):
        cycle(index)
        done = index - 20
        if done % args.every == 0 or done == args.cycles:
            print(f"rank {rank} cycle {done} counts {counts(parent)} rss_kib {resident_kib()}",
                  flush=True)
    MPI.COMM_WORLD.Barrier()
    after = counts(parent)
    verdict = "FLAT" if after == before and not wrong else "GREW"
    print(f"rank {rank}: {verdict} after {args.cycles} split/close cycles: counts before "
          f"{before} after {after}; {wrong} wrong all_reduces; RSS {rss} -> "
          f"{resident_kib()} KiB", flush=True)
    parent.close()


if __name__ == "__main__":
    main()
