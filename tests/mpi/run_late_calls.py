"""Repeated calls with ranks late to them, under mpirun:
``mpiexec -n N python run_late_calls.py --seed S [--steps K] [--backend B]``.

A program of ``--steps`` steps, the same on every rank (drawn from ``--seed``): calls of
all_gather, all_reduce and reduce_scatter (out of place, int32) repeated on a few sets of
buffers, registered (``hoccl.empty``: repeats issued without asking, folded into digests)
or plain (exchanged), alone or two in a ``hoccl.group()``; ``synchronize``, after which
every output is checked against numpy and poisoned again; and ``synchronize`` followed by
an MPI barrier (no message of hoccl's comes while a rank waits there).  Every 20 steps
one rank is made late to each call, the others a little at random, so that
peers' digests come before a rank has made the calls they cover.

Rank 0 prints ``late calls ranks=N seed=S: C checks passed, F failed``; the exit status
is non-zero when a check failed; a call that raises ends the job (``MPI.Abort``).
"""

import argparse
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import array_module_for, assert_exact, poison

COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter")
SETS = 3   # buffer sets of each kind (registered, plain)
COUNT = 48  # elements of each rank's block


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backend", default="host")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = hoccl.init(backend=args.backend, timeout=20)
    n, r = comm.world_size, comm.rank
    arrays = array_module_for(comm.backend, "int32")
    program = np.random.default_rng(args.seed)               # the same on every rank
    delays = np.random.default_rng([args.seed, r])           # this rank's own
    inputs = [np.random.default_rng([args.seed, 1 << 20, k]).integers(
        -1000, 1000, (n, n * COUNT)).astype(np.int32) for k in range(SETS)]
    sets = {}
    for registered in (True, False):
        for k in range(SETS):
            if registered:
                send = hoccl.empty(n * COUNT, "int32", comm)
                recv = hoccl.empty(n * COUNT, "int32", comm)
            else:
                send = arrays.asarray(np.zeros(n * COUNT, np.int32), comm.device)
                recv = arrays.asarray(np.zeros(n * COUNT, np.int32), comm.device)
            send[...] = arrays.asarray(inputs[k][r], comm.device)
            recv[...] = arrays.asarray(poison(n * COUNT, "int32"), comm.device)
            sets[registered, k] = (send, recv)

    def expected(collective, k):
        data = inputs[k]
        if collective == "all_gather":
            return np.concatenate([data[peer][:COUNT] for peer in range(n)])
        total = data.sum(axis=0, dtype=np.int32)
        return total if collective == "all_reduce" else total[r * COUNT:(r + 1) * COUNT]

    def call(collective, registered, k):
        send, recv = sets[registered, k]
        if collective == "all_gather":
            comm.all_gather(send[:COUNT], recv)
        elif collective == "all_reduce":
            comm.all_reduce(send, recv)
        else:
            comm.reduce_scatter(send, recv[:COUNT])

    made = {}  # a set of buffers -> the collective made on it since the last check
    passed = failed = 0
    late, step = n, -1
    try:
        for step in range(args.steps):
            what = program.choice(["call"] * 8 + ["synchronize", "barrier", "barrier", "group"])
            if step % 20 == 0:
                late = int(program.integers(n))
            if r == late:
                time.sleep(0.01 + delays.random() * 0.01)
            elif delays.random() < 0.2:
                time.sleep(delays.random() * 0.002)
            if what in ("call", "group"):
                calls = []
                for _ in range(2 if what == "group" else 1):
                    collective = str(program.choice(COLLECTIVES))
                    key = (bool(program.random() < 0.7), int(program.integers(SETS)))
                    if made.setdefault(key, collective) == collective and key not in [
                            theirs for _, theirs in calls]:
                        calls.append((collective, key))
                if what == "group":
                    with hoccl.group():
                        for collective, key in calls:
                            call(collective, *key)
                else:
                    for collective, key in calls:
                        call(collective, *key)
                continue
            comm.synchronize()
            for (registered, k), collective in made.items():
                recv = sets[registered, k][1]
                got = arrays.to_numpy(recv, "int32")
                if collective == "reduce_scatter":
                    got = got[:COUNT]
                try:
                    assert_exact(f"step {step}: {collective} on "
                                 f"{'registered' if registered else 'plain'} set {k}",
                                 expected(collective, k), got)
                    passed += 1
                except AssertionError:
                    failed += 1
                    print(f"rank {r} FAILED\n{traceback.format_exc()}", flush=True)
                recv[...] = arrays.asarray(poison(n * COUNT, "int32"), comm.device)
            made.clear()
            if what == "barrier":
                world.Barrier()
        comm.synchronize()
    except Exception:  # the ranks' MPI calls no longer line up: end the job at once
        print(f"rank {r} FAILED at step {step}\n{traceback.format_exc()}", flush=True)
        world.Abort(1)
    passed, failed = world.allreduce(passed), world.allreduce(failed)
    if r == 0:
        print(f"late calls ranks={n} seed={args.seed}: {passed} checks passed, {failed} failed",
              flush=True)
    comm.close()
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main())
