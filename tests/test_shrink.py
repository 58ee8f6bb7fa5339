"""Going on without lost ranks: ``Communicator.shrink`` under mpiexec (a rank that died
between calls, was killed mid-call, closed, or is left out while alive; twice in a row;
a rank or a whole host of simulated hosts) and ``hoccl.shrink_local``: the survivors'
new communicator is exact, the parent is left aborted, and bad requests raise naming
the call."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import hoccl
from test_mpi import MPI_ENV, _mpiexec, keep_going_flags

PROGRAM = Path(__file__).parent / "mpi" / "run_shrink.py"
# A rank killed by a signal makes MPICH's mpiexec end the job, and a rank's failure makes
# it send SIGUSR1 to the others: each rank runs under a shell that ignores SIGUSR1 (so
# does the program) and outlives it.
SURVIVE = ["sh", "-c", 'trap "" USR1; "$@"; exit 0', "sh"]


def _shrink_job(ranks, scenario, victims, *flags, env=None):
    mpiexec = _mpiexec()
    with tempfile.TemporaryDirectory() as stamps:
        command = [mpiexec, *keep_going_flags(mpiexec), "-n", str(ranks), *SURVIVE,
                   sys.executable, str(PROGRAM), scenario, "--victims",
                   ",".join(map(str, victims)), "--stamps", stamps, *flags]
        result = subprocess.run(command, capture_output=True, text=True, timeout=240,
                                env={**os.environ, **MPI_ENV, **(env or {})},
                                start_new_session=True)
    return result.stdout + result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,scenario,victims,flags", [
    (3, "dead", [2], []),            # the last rank
    (3, "dead", [0], []),            # the first
    (4, "dead", [1], []),            # one in the middle
    (4, "killed", [2], ["--no-wait"]),  # SIGKILL during a 64 MiB all_reduce, SHRINK_ABORT
    (3, "killed", [0], []),
    (4, "closed", [0], []),
    (3, "excluded", [1], []),
    (4, "dead", [3, 1], []),         # two failures, one after the other
])
def test_survivors_shrink_and_go_on_exactly(ranks, scenario, victims, flags):
    output = _shrink_job(ranks, scenario, victims, *flags)
    assert "FAILED" not in output, output[-4000:]
    survivors = [rank for rank in range(ranks) if rank != victims[0]]
    for rank in survivors:
        assert f"rank {rank}: OK detect" in output, output[-4000:]
    for rank in [rank for rank in survivors if rank not in victims[1:]]:
        if len(victims) > 1:
            assert f"rank {rank}: second OK detect" in output, output[-4000:]
    if scenario in ("closed", "excluded"):
        assert f"rank {victims[0]}: OK" in output, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("scenario,victims,hosts", [
    ("dead", ["0"], [3]),          # the first rank: the hosts keep 1 and 2 ranks, 3 hosts of 1
    ("dead", ["3"], [3]),          # the last
    ("dead", ["1"], [3]),          # one in the middle
    ("dead", ["2+3"], [1]),        # a whole host: one host is left, a flat communicator
    ("dead", ["0+1"], [1]),        # the first host
    ("closed", ["2"], [3]),
    ("excluded", ["2"], [3]),      # alive, left out: its call ends with AbortedError
    ("dead", ["3", "1"], [3, 2]),  # two failures, one after the other, across hosts
    ("dead", ["2+3", "1"], [1, 1]),
])
def test_survivors_of_simulated_hosts_shrink_across_hosts_and_go_on_exactly(scenario, victims,
                                                                           hosts):
    """4 ranks on 2 simulated hosts (inter_host 'hoccl'): after a lost rank or host the
    survivors' 20 all_reduces and a broadcast are exact, across the hosts that are left
    (a flat communicator when one is), and so after a second failure."""
    _check_simulated_hosts(scenario, victims, hosts)


@pytest.mark.mpi
@pytest.mark.parametrize("scenario,victims,hosts", [
    ("dead", ["3"], [3]),          # a rank of the second host
    ("dead", ["2+3"], [1]),        # a whole host: one host is left
    ("dead", ["0"], [3]),          # the first rank
    ("closed", ["2"], [3]),
    ("excluded", ["2"], [3]),
    ("dead", ["3", "1"], [3, 2]),  # two failures, one after the other, across hosts
])
def test_survivors_shrink_across_hosts_joined_by_ucx(scenario, victims, hosts):
    """The same with UCX between the hosts (as between real hosts): the survivors meet
    over UCX's endpoints to each other, never waiting for a lost rank."""
    pytest.importorskip("ucxx")
    _check_simulated_hosts(scenario, victims, hosts, "--inter-host", "ucx")


def _check_simulated_hosts(scenario, victims, hosts, *flags):
    output = _shrink_job(4, scenario, victims, *flags, env={"HOCCL_LOCAL_SIZE": "2"})
    assert "FAILED" not in output, output[-4000:]
    gone = [int(rank) for rank in victims[0].split("+")]
    for rank in [rank for rank in range(4) if rank not in gone]:
        assert f"rank {rank}: OK detect" in output, output[-4000:]
        assert f"on {hosts[0]} hosts)" in output.split(f"rank {rank}: OK detect")[1].split(
            "\n")[0], output[-4000:]
        if len(victims) > 1 and rank != int(victims[1]):
            assert f"rank {rank}: second OK detect" in output, output[-4000:]
            assert f"on {hosts[1]} hosts)" in output.split(
                f"rank {rank}: second OK detect")[1].split("\n")[0], output[-4000:]


def test_the_survivors_hosts_keep_their_ranks_or_each_survivor_is_a_host():
    from hoccl._hierarchy.shrinking import survivors_topology
    from hoccl.sched.hierarchical import Topology
    two_by_two = Topology(2, 2)
    assert survivors_topology(two_by_two, [0, 1]) == Topology(1, 2)
    assert survivors_topology(two_by_two, [0, 1, 2]) == Topology(3, 1)
    assert survivors_topology(Topology(3, 2), [0, 1, 4, 5]) == Topology(2, 2)
    assert survivors_topology(Topology(3, 2), [0, 2, 4]) == Topology(3, 1)


def _all_reduce_is_exact(comms, seed):
    rng = np.random.default_rng(seed)
    data = [rng.integers(-1 << 40, 1 << 40, 513) for _ in comms]
    outs = [np.full(513, np.iinfo(np.int64).min) for _ in comms]
    with hoccl.group():
        for comm, send, out in zip(comms, data, outs):
            comm.all_reduce(send, out)
    for comm in comms:
        comm.synchronize()
    want = sum(data)
    return all(np.array_equal(out, want) for out in outs)


def test_shrink_local_after_a_close_renumbers_the_survivors_and_aborts_the_parents(init_local):
    comms = init_local(4, backend="host")
    assert _all_reduce_is_exact(comms, 1)
    comms[1].close()
    children = hoccl.shrink_local([comms[0], comms[2], comms[3]], [1])
    try:
        assert [(child.rank, child.world_size) for child in children] == [(0, 3), (1, 3), (2, 3)]
        assert all(comm.aborted for comm in (comms[0], comms[2], comms[3]))
        with pytest.raises(hoccl.AbortedError, match="all_reduce.*shrink_local"):
            comms[0].all_reduce(np.ones(4), np.zeros(4))
        assert all(_all_reduce_is_exact(children, seed) for seed in range(2, 22))
        assert children[0].timeout == comms[0].timeout
        assert children[0].device_handle is not comms[0].device_handle  # pads of its own
        # and again: the shrunk communicator shrinks too
        grandchildren = hoccl.shrink_local(children[:2], [2])
        assert [(child.rank, child.world_size) for child in grandchildren] == [(0, 2), (1, 2)]
        assert all(_all_reduce_is_exact(grandchildren, seed) for seed in range(30, 35))
        for child in grandchildren:
            child.close()
    finally:
        for child in children:
            child.close()


def test_shrink_local_leaves_out_a_live_rank_whose_held_call_then_fails(init_local):
    """Rank 2 made a call the others never made (it waits for them); the others shrink
    without waiting: rank 2's call fails instead of hanging."""
    comms = init_local(3, backend="host", timeout=30)
    comms[2].all_reduce(np.ones(8), np.zeros(8))
    children = hoccl.shrink_local(comms[:2], [2], wait=False)
    try:
        with pytest.raises(hoccl.AbortedError):
            comms[2].synchronize()
        assert _all_reduce_is_exact(children, 7)
    finally:
        for child in children:
            child.close()


def test_shrink_settings_given_override_the_parents(init_local):
    comms = init_local(3, backend="host", timeout=40)
    children = hoccl.shrink_local(comms[1:], [0], timeout=12)
    try:
        assert [child.timeout for child in children] == [12, 12]
        assert _all_reduce_is_exact(children, 3)
    finally:
        for child in children:
            child.close()


@pytest.mark.parametrize("exclude,match", [
    ([], r"shrink_local: exclude must name at least one rank.*got \[\]"),
    ([3], r"shrink_local: exclude must name at least one rank, each in \[0, 3\).*got \[3\]"),
    ([-1], r"got \[-1\]"),
    ([0, 1, 2], r"leave at least one; got \[0, 1, 2\]"),
    ("0", r"shrink_local: exclude must be a sequence of ranks \(ints\); got '0'"),
    ([0.5], r"got \[0.5\]"),
])
def test_shrink_local_refuses_a_bad_exclude_naming_it(init_local, exclude, match):
    comms = init_local(3, backend="host")
    with pytest.raises(hoccl.InvalidArgumentError, match=match):
        hoccl.shrink_local(comms[1:], exclude)
    assert not any(comm.aborted for comm in comms)  # nothing was done


def test_shrink_local_refuses_comms_that_are_not_the_survivors(init_local):
    comms = init_local(3, backend="host")
    with pytest.raises(hoccl.InvalidArgumentError,
                       match=r"shrink_local: comms must be the communicators of ranks \[1, 2\].*"
                             r"got ranks \[0, 2\]"):
        hoccl.shrink_local([comms[0], comms[2]], [np.int64(0)])
    other = init_local(2, backend="host")
    with pytest.raises(hoccl.InvalidArgumentError, match="shrink_local: comms must be "
                                                         "communicators of one"):
        hoccl.shrink_local([comms[0], other[1]], [1])
    with pytest.raises(hoccl.InvalidArgumentError, match="shrink_local: wait must be True "
                                                         "or False; got 'yes'"):
        hoccl.shrink_local(comms[1:], [0], wait="yes")
    assert not any(comm.aborted for comm in comms)


def test_shrink_of_an_init_local_rank_points_to_shrink_local(init_local):
    comms = init_local(2, backend="host")
    with pytest.raises(hoccl.InvalidArgumentError, match=r"shrink: the ranks of init_local .*"
                                                         r"hoccl.shrink_local\(comms, exclude\)"):
        comms[0].shrink([1])
    comms[0].close()
    with pytest.raises(hoccl.InvalidArgumentError, match="shrink: the communicator is closed"):
        comms[0].shrink([1])


def test_a_communicator_across_real_hosts_refuses_to_shrink_saying_so():
    from hoccl._hierarchy import HierarchicalCommunicator
    across = object.__new__(HierarchicalCommunicator)  # no hosts needed: nothing is touched
    across._closed, across.rank, across.world_size = False, 0, 4
    across.topology, across.inter_host, across._hosts = None, "mpi", []
    across._levels = {"world": object()}
    with pytest.raises(hoccl.InvalidArgumentError,
                       match=r"^shrink: not supported across hosts that meet through 'mpi'.*"
                             r"inter_host='ucx', or 'hoccl'"):
        across.shrink([1])
    with pytest.raises(hoccl.InvalidArgumentError, match=r"^shrink: exclude must name"):
        across.shrink([4])
