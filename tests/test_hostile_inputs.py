"""Ranks that disagree, in one process (init_local): nothing is written anywhere, every
rank involved raises MismatchError naming the call, the ranks and both values, and the
communicator works again afterwards.  The same scenarios run under mpiexec -n 3 in
tests/test_mpi.py (tests/mpi/run_hostile.py)."""

import numpy as np
import pytest

import hoccl
from hoccl.testing import assert_exact, check_collective, expected, is_poison, poison

from hostile import Guarded, check_disagreement, scenarios

WORLD = 3


@pytest.fixture(scope="module")
def comms():
    comms = hoccl.init_local(WORLD, backend="host")
    yield comms
    for comm in comms:
        comm.close()


@pytest.mark.parametrize("name,collective,change,deviants", scenarios(WORLD),
                         ids=[s[0] for s in scenarios(WORLD)])
def test_disagreeing_ranks_write_nothing_and_all_raise(comms, name, collective, change, deviants):
    rng = np.random.default_rng(abs(hash(name)) % (1 << 32))
    check_disagreement(comms, rng, name, collective, change, deviants)


def test_pair_calls_that_disagree_on_size_write_nothing(init_local):
    comms = init_local(2, backend="host")
    rng = np.random.default_rng(1)
    small = Guarded(rng, 4, np.float32, fill=np.nan)
    large = Guarded(rng, 1000, np.float32, fill=1.0)
    comms[0].send(large.view, 1)
    with pytest.raises(hoccl.MismatchError, match=r"count=4.*count=1000|count=1000.*count=4"):
        comms[1].recv(small.view, 0)
    with pytest.raises(hoccl.MismatchError):
        comms[0].synchronize()
    comms[1].synchronize()
    assert small.untouched() and large.untouched()
    check_collective(comms, "broadcast", count=3, dtype="int32", root=1, seed=2)


def test_a_cycle_of_ungrouped_sends_is_refused_at_once_and_grouped_it_runs(init_local):
    comms = init_local(3, backend="host", timeout=30)
    data = [np.arange(4, dtype=np.int64) + 10 * rank for rank in range(3)]
    out = [np.full(4, -1, np.int64) for _ in range(3)]
    refused = []
    for rank, comm in enumerate(comms):
        for call in (lambda: comm.send(data[rank], (rank + 1) % 3),
                     lambda: comm.recv(out[rank], (rank - 1) % 3)):
            try:
                call()
            except hoccl.MismatchError as error:
                refused.append(str(error))
    assert refused and "can never all run" in refused[0] and "hoccl.group()" in refused[0]
    for comm in comms:
        try:
            comm.synchronize()
        except hoccl.MismatchError:
            pass
    # the same ring inside a group completes
    with hoccl.group():
        for rank, comm in enumerate(comms):
            comm.send(data[rank], (rank + 1) % 3)
            comm.recv(out[rank], (rank - 1) % 3)
    for comm in comms:
        comm.synchronize()
    for rank in range(3):
        assert_exact(f"grouped recv: rank {rank}", data[(rank - 1) % 3], out[rank])


def test_group_mixes_collectives_and_pairs_across_ranks(init_local):
    comms = init_local(2, backend="host")
    rng = np.random.default_rng(7)
    a = [rng.standard_normal(6).astype(np.float32) for _ in range(2)]
    gathered = [poison(12, "float32") for _ in range(2)]
    swapped = [poison(6, "float32") for _ in range(2)]
    with hoccl.group():
        for rank, comm in enumerate(comms):
            comm.recv(swapped[rank], 1 - rank)
            comm.all_gather(a[rank], gathered[rank])
            comm.send(a[rank], 1 - rank)
    for comm in comms:
        comm.synchronize()
    for rank in range(2):
        assert_exact(f"grouped all_gather: rank {rank}", np.concatenate(a), gathered[rank])
        assert_exact(f"grouped recv: rank {rank}", a[1 - rank], swapped[rank])


@pytest.mark.parametrize("registered", [False, True])
def test_a_group_every_rank_abandons_runs_on_no_rank(init_local, registered):
    """One thread drives every rank's calls in one ``hoccl.group()`` (collectives and a
    send/recv ring), and the body raises: the abandoned calls match each other, and no
    rank runs them (outputs still poisoned, synchronize quiet); the next group is exact."""
    comms = init_local(3, backend="host")
    n, count = len(comms), 5

    def buffers(rng):
        sends, gathers, sums, rings = [], [], [], []
        for comm in comms:
            def new(values):
                if not registered:
                    return values
                array = hoccl.empty(values.size, "float32", comm)
                array[:] = values
                return array
            sends.append(new(rng.standard_normal(count).astype(np.float32)))
            gathers.append(new(poison(n * count, "float32")))
            sums.append(new(poison(count, "float32")))
            rings.append(new(poison(count, "float32")))
        return sends, gathers, sums, rings

    def grouped(sends, gathers, sums, rings, fail):
        with hoccl.group():
            for comm in comms:
                r = comm.rank
                comm.all_gather(sends[r], gathers[r])
                comm.all_reduce(sends[r], sums[r])
                comm.send(sends[r], (r + 1) % n)
                comm.recv(rings[r], (r - 1) % n)
            if fail:
                raise RuntimeError("body")

    rng = np.random.default_rng()
    sends, gathers, sums, rings = buffers(rng)
    with pytest.raises(RuntimeError, match="body"):
        grouped(sends, gathers, sums, rings, fail=True)
    for comm in comms:
        comm.synchronize()
        for output in (gathers, sums, rings):
            assert is_poison(output[comm.rank]).all(), f"rank {comm.rank} ran an abandoned call"
    grouped(sends, gathers, sums, rings, fail=False)
    for comm in comms:
        comm.synchronize()
        r = comm.rank
        assert_exact(f"all_gather: rank {r}", np.concatenate(sends), gathers[r])
        assert_exact(f"all_reduce: rank {r}", expected("all_reduce", sends)[r], sums[r])
        assert_exact(f"ring: rank {r}", sends[(r - 1) % n], rings[r])


def test_a_group_whose_body_raises_runs_none_of_its_calls(init_local):
    comms = init_local(2, backend="host")
    out = [poison(4, "float32") for _ in range(2)]
    with pytest.raises(RuntimeError, match="body"):
        with hoccl.group():
            comms[0].all_reduce(np.ones(4, np.float32), out[0])
            raise RuntimeError("body")
    assert is_poison(out[0]).all()
    with pytest.raises(hoccl.MismatchError, match="abandoned"):  # rank 1's matching call
        comms[1].all_reduce(np.ones(4, np.float32), np.zeros(4, np.float32))
    with pytest.raises(hoccl.MismatchError, match="abandoned"):
        comms[0].synchronize()
    assert is_poison(out[0]).all()
    check_collective(comms, "all_reduce", count=4, dtype="float32", seed=4)
