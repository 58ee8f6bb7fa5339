"""The public API under mpirun, one rank per process: run with ``mpiexec -n N python run_checks.py [--backend B]``.

Every rank draws the same inputs from the same seeds, runs each collective through
``hoccl.init()`` and checks its own output against numpy.  Prints one line per
failure and ``N passed, M failed`` at the end (rank 0), and exits non-zero when any
rank saw a failure.
"""

import argparse
import sys
import traceback

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import IN_PLACE_FORMS, array_module_for, check_collective, poison, random_array

ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("reduce_scatter", "all_reduce", "reduce")


def cases(world_size, dtypes, counts):
    seed = 0
    for collective in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
                       "reduce", "gather", "scatter"):
        for dtype in dtypes:
            for count in counts:
                for in_place in ([False, True] if collective in IN_PLACE_FORMS else [False]):
                    roots = sorted({0, world_size - 1}) if collective in ROOTED else [0]
                    ops = ["sum", "max", "avg"] if collective in REDUCING else ["sum"]
                    for root in roots:
                        for op in ops:
                            seed += 1
                            yield dict(collective=collective, dtype=dtype, count=count,
                                       in_place=in_place, root=root, op=op, seed=seed)


def check_send_recv(comm, arrays, seed):
    """Ring: every rank sends to rank+1 and receives from rank-1, twice, both orders."""
    n, r = comm.world_size, comm.rank
    if n == 1:
        return
    rng = np.random.default_rng(seed)
    data = [random_array(rng, 37, "int32") for _ in range(n)]
    out = arrays.asarray(poison(37, "int32"), comm.device)
    source = arrays.asarray(data[r], comm.device)
    if r % 2 == 0:
        comm.send(source, (r + 1) % n)
        comm.recv(out, (r - 1) % n)
    else:
        comm.recv(out, (r - 1) % n)
        comm.send(source, (r + 1) % n)
    comm.synchronize()
    got = arrays.to_numpy(out, "int32")
    assert np.array_equal(got, data[(r - 1) % n]), f"send/recv: rank {r} got {got[:4]}"


def check_reallocated_buffers(comm, seed):
    """Free a received-into buffer and allocate a new one (often at the same address, as a
    new allocation): the peers must write into the new one, never through a stale mapping
    of the old one."""
    arrays = array_module_for(comm.backend, "int32")
    n = comm.world_size
    for round_ in range(3):
        rng = np.random.default_rng(seed + round_)
        data = [random_array(rng, 1 << 16, "int32") for _ in range(n)]
        send = arrays.asarray(data[comm.rank], comm.device)
        recv = arrays.asarray(poison(n << 16, "int32"), comm.device)
        comm.all_gather(send, recv)
        comm.synchronize()
        got = arrays.to_numpy(recv, "int32")
        assert np.array_equal(got, np.concatenate(data)), f"round {round_}: stale mapping?"
        del send, recv
        if comm.backend == "cuda":
            import cupy
            cupy.get_default_memory_pool().free_all_blocks()  # the next round allocates anew


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16,int32,uint8")
    parser.add_argument("--counts", default="0,1,17,1000")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = hoccl.init(backend=args.backend, timeout=120)
    dtypes = args.dtypes.split(",")
    counts = [int(c) for c in args.counts.split(",")]
    passed = failed = 0
    for case in cases(comm.world_size, dtypes, counts):
        try:
            arrays = array_module_for(comm.backend, case["dtype"])
            check_collective([comm], arrays=arrays, **case)
            passed += 1
        except Exception:
            failed += 1
            print(f"rank {comm.rank} FAILED {case}\n{traceback.format_exc()}", flush=True)
    for name, action in (("send_recv", lambda: check_send_recv(comm, array_module_for(
            comm.backend, "int32"), 7)), ("barrier", lambda: (comm.barrier(), comm.synchronize())),
            ("reallocated buffers", lambda: check_reallocated_buffers(comm, 11))):
        try:
            action()
            passed += 1
        except Exception:
            failed += 1
            print(f"rank {comm.rank} FAILED {name}\n{traceback.format_exc()}", flush=True)
    comm.close()
    totals = world.allreduce(np.array([passed, failed]), op=MPI.SUM)
    if world.rank == 0:
        print(f"mpi ranks={world.size} backend={comm.backend}: "
              f"{totals[0]} passed, {totals[1]} failed", flush=True)
    sys.exit(1 if totals[1] else 0)


if __name__ == "__main__":
    main()
