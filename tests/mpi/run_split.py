"""Communicator.split under mpirun, one rank per process: run with
``mpiexec -n N python run_split.py [--backend B]``.

Each check splits ``hoccl.init()``'s communicator and checks the children's collectives
bit for bit (``hoccl.testing``), with calls on parent and child in flight together.
A check fails when it failed on any rank; every rank prints its failures, rank 0 prints
``split ranks=N backend=B: P passed, F failed``; the exit status is non-zero on a failure.
"""

import argparse
import sys
import traceback

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import array_module_for, check_collective, check_interleaved

CHILD_CALLS = [("all_gather", "sum"), ("reduce_scatter", "sum"), ("all_reduce", "sum"),
               ("all_reduce", "avg"), ("send_recv", "sum")]


def collectives_on(child, seed):
    for index, (collective, op) in enumerate(CHILD_CALLS):
        for dtype in ("float32", "int32"):
            check_collective([child], collective, count=29, dtype=dtype, op=op,
                             seed=seed + 10 * index + (dtype == "int32"))


def even_and_odd(parent):
    child = parent.split(parent.rank % 2)
    assert (child.rank, child.world_size) == (
        parent.rank // 2, len(range(parent.rank % 2, parent.world_size, 2))), child
    assert child.device_handle is parent.device_handle
    collectives_on(child, seed=100)
    child.close()
    check_collective([parent], "all_reduce", count=13, dtype="float32", seed=1)


def nocolor(parent):
    child = parent.split(None if parent.rank == 0 else 3)
    if parent.rank == 0:
        assert child is None
        return
    assert (child.rank, child.world_size) == (parent.rank - 1, parent.world_size - 1)
    collectives_on(child, seed=200)
    child.close()


def interleaved(parent):
    child = parent.split(parent.rank % 2)
    even = [child] if parent.rank % 2 == 0 else []
    odd = [child] if parent.rank % 2 else []
    steps = [([parent], "all_reduce", "sum"), (even, "all_gather", "sum"),
             ([parent], "reduce_scatter", "sum"), (odd, "all_reduce", "avg"),
             (even, "reduce_scatter", "sum"), ([parent], "all_gather", "sum"),
             (odd, "send_recv", "sum"), ([parent], "all_reduce", "avg")]
    for dtype in ("float32", "int64"):
        check_interleaved(steps, count=33, dtype=dtype, seed=7)
    child.close()


def keys_reorder(parent):
    n = parent.world_size
    child = parent.split(0, key=-parent.rank)
    assert child.rank == n - 1 - parent.rank, child
    arrays = array_module_for(parent.backend, "int32")
    recv = arrays.asarray(np.zeros(2 * n, dtype=np.int32), parent.device)
    child.all_gather(arrays.asarray(np.full(2, parent.rank, dtype=np.int32), parent.device),
                     recv)
    child.synchronize()
    got = arrays.to_numpy(recv, "int32")
    assert got.tolist() == [rank for rank in reversed(range(n)) for _ in range(2)], got
    collectives_on(child, seed=300)
    child.close()


def settings_and_closing(parent):
    child = parent.split(0, max_sms=3, chunk_bytes=1 << 16)
    assert (child.max_sms, parent.max_sms) == (3, 8)
    assert child.options.chunk_bytes == 1 << 16 != parent.options.chunk_bytes
    assert child.timeout == parent.timeout
    grandchild = child.split(parent.rank % 2)
    check_collective([grandchild], "all_reduce", count=7, dtype="float32", seed=9)
    child.close()  # before its own child: the device stays open for the grandchild
    check_collective([grandchild], "all_gather", count=7, dtype="float32", seed=10)
    check_collective([parent], "all_reduce", count=11, dtype="float32", seed=11)
    grandchild.close()
    check_collective([parent], "reduce_scatter", count=11, dtype="float32", seed=12)


def bad_argument_raises_everywhere(parent):
    try:
        parent.split("blue" if parent.rank == 1 else 0)
    except hoccl.InvalidArgumentError as error:
        expected = ("split: color must be an int" if parent.rank == 1
                    else "split: rank 1 was refused: split: color must be an int")
        assert str(error).startswith(expected), error
    else:
        raise AssertionError("split with a bad color on rank 1 did not raise")
    child = parent.split(0)  # the ranks are still in step
    check_collective([child], "all_reduce", count=5, dtype="float32", seed=13)
    child.close()


def a_rank_that_makes_another_call_raises_everywhere(parent):
    """Rank 0 calls split while the others call all_reduce: every rank raises
    MismatchError, none waits for the others for ever.  (The ranks' call counts then
    differ: the parent is not used again; the checks after this one make their own.)"""
    arrays = array_module_for(parent.backend, "float32")
    data = arrays.asarray(np.ones(4, np.float32), parent.device)
    try:
        if parent.rank == 0:
            parent.split(0)
        else:
            parent.all_reduce(data, arrays.asarray(np.zeros(4, np.float32), parent.device))
            parent.synchronize()
    except hoccl.MismatchError as error:
        assert "split" in str(error), error
    else:
        raise AssertionError(f"rank {parent.rank}: a split beside an all_reduce did not raise")


def across_hosts_refused(parent):
    """Two simulated hosts (local_size): a HierarchicalCommunicator, which cannot split."""
    if parent.world_size % 2:
        return
    world = hoccl.init(backend=parent.backend, local_size=parent.world_size // 2,
                       inter_host="mpi")
    try:
        world.split(0)
    except hoccl.InvalidArgumentError as error:
        assert str(error).startswith("split: not supported across hosts yet"), error
    else:
        raise AssertionError("split of a HierarchicalCommunicator did not raise")
    finally:
        world.close()


CHECKS = [even_and_odd, nocolor, interleaved, keys_reorder, settings_and_closing,
          bad_argument_raises_everywhere, a_rank_that_makes_another_call_raises_everywhere,
          across_hosts_refused]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="host")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    parent = hoccl.init(backend=args.backend, timeout=60)
    passed = failed = 0
    for check in CHECKS:
        outcome = 0
        try:
            check(parent)
        except Exception:
            outcome = 1
            print(f"rank {parent.rank} {check.__name__} FAILED:\n{traceback.format_exc()}",
                  flush=True)
        if world.allreduce(outcome, op=MPI.MAX):
            failed += 1
        else:
            passed += 1
    parent.close()
    if world.rank == 0:
        print(f"split ranks={world.size} backend={args.backend}: {passed} passed, "
              f"{failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
