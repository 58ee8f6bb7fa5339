"""Sends and receives across simulated hosts under mpiexec on the host backend
(``tests/mpi/run_pairs.py``): single and batched in ``hoccl.group()`` (rings in either
direction, an exchange with every peer, two pairs of one peer and direction), every
dtype, counts 0, 1 and odd, and 64 MiB + 4 bytes once per engine family, bit for bit
into poisoned arrays, on every engine between hosts CI runs (MPI with cross-memory
reads and without, gloo, hoccl) and with a torch gloo group inside a host; a send whose
receive never comes times out naming both ranks and their hosts; the checker fails on a
planted bit flip.  Plus, in one process, the simulated hosts of a sub-group's ranks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import hoccl
from hoccl._hierarchy.topology import simulated_local_size
from test_mpi import MPI_ENV, _mpiexec

SCRIPT = Path(__file__).parent / "mpi" / "run_pairs.py"
ROOT = Path(__file__).resolve().parent.parent

ALL_DTYPES = "float16,bfloat16,float32,float64,int8,uint8,int32,int64"
LARGE = 64 << 20
RUNS = {  # (ranks, local size, inter-host engine, torch hosts, cross-memory): (dtypes, large)
    (2, 1, "mpi", "", "1"): (ALL_DTYPES, 0),
    (4, 2, "mpi", "", "1"): (ALL_DTYPES, LARGE),
    (4, 2, "mpi", "", "0"): ("bfloat16,int64", 0),
    (2, 1, "gloo", "", "1"): (ALL_DTYPES, LARGE),
    (4, 2, "gloo", "", "1"): ("float16,uint8", 0),
    (2, 1, "hoccl", "", "1"): ("float64,int8", 0),
    (4, 2, "hoccl", "", "1"): (ALL_DTYPES, 0),
    (4, 2, "mpi", "1", "1"): (ALL_DTYPES, 0),
    (2, 1, "ucx", "", "1"): (ALL_DTYPES, LARGE),
    (4, 2, "ucx", "1", "1"): ("float16,int32", 0),
}


def _run(ranks, local_size, *args, cross_memory="1", timeout=600):
    env = {**os.environ, **MPI_ENV, "HOCCL_VERIFY": "1", "HOCCL_LOCAL_SIZE": str(local_size),
           "HOCCL_CROSS_MEMORY": cross_memory, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [_mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,local_size,inter_host,torch_hosts,cross_memory", list(RUNS))
def test_sends_and_batches_across_hosts_match_numpy(ranks, local_size, inter_host,
                                                     torch_hosts, cross_memory):
    dtypes, large = RUNS[ranks, local_size, inter_host, torch_hosts, cross_memory]
    code, output = _run(ranks, local_size, "--inter-host", inter_host, "--dtypes", dtypes,
                        "--counts", "0,1,17,65537", "--large", str(large),
                        "--torch-hosts", torch_hosts, cross_memory=cross_memory)
    assert code == 0, output[-4000:]
    checks = 4 * 4 * len(dtypes.split(",")) + (1 if large else 0)
    assert (f"pairs across hosts ranks={ranks} inter={inter_host}: {checks * ranks} passed, "
            f"0 failed") in output, output[-4000:]
    if inter_host == "mpi":
        label = "mpi, cross-memory (staged)" if cross_memory == "1" else "mpi (staged)"
        assert f"'inter_host': '{label}'" in output, output[-4000:]
    if torch_hosts:
        assert "'engine': 'torch (gloo)'" in output, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("inter_host,how", [("mpi", "single"), ("mpi", "group"),
                                            ("gloo", "group"), ("hoccl", "group"),
                                            ("ucx", "single"), ("ucx", "group")])
def test_a_send_whose_receive_never_comes_times_out_naming_both_ranks(inter_host, how):
    """Rank 1 (the other host) never receives: rank 0's send raises HocclTimeoutError
    within its timeout naming rank 0 on host 0 and rank 1 on host 1, the next call is
    refused, and bad arguments (a peer that is the rank itself or out of range, a
    read-only receive, a collective inside a group, a stream on the host backend) raise
    at once."""
    code, output = _run(2, 1, "--inter-host", inter_host, "--unmatched", how, timeout=120)
    assert code == 0 and "unmatched across hosts: rank 0 OK" in output, output[-4000:]
    assert "rank 0 (host 0, " in output and "rank 1 (host 1, " in output, output[-4000:]


@pytest.mark.mpi
def test_the_checker_fails_on_a_flipped_bit():
    """Rank 1 flips one bit of what it received before checking: each of its four checks
    (single, both rings, everyone) fails, rank 0's pass."""
    code, output = _run(2, 1, "--inter-host", "mpi", "--dtypes", "int32", "--counts", "17",
                        "--fault", "1", timeout=120)
    assert code != 0, output[-4000:]
    assert "pairs rank 1: 0 passed, 4 failed" in output, output[-4000:]
    assert "pairs rank 0: 4 passed, 0 failed" in output, output[-4000:]


@pytest.mark.parametrize("ranks,told", [([0, 2], 1), ([1, 3], 1), ([0, 1], 2), ([2, 3], 2),
                                        ([0, 1, 2, 3], 2), ([3], 1), ([], None)])
def test_a_sub_group_takes_the_simulated_hosts_of_its_ranks(monkeypatch, ranks, told):
    monkeypatch.setenv("HOCCL_LOCAL_SIZE", "2")
    assert simulated_local_size("new_group", ranks) == told


def test_a_sub_group_whose_ranks_fill_hosts_unevenly_is_refused(monkeypatch):
    monkeypatch.setenv("HOCCL_LOCAL_SIZE", "2")
    with pytest.raises(hoccl.InvalidArgumentError, match=r"blocks of equal size per host"):
        simulated_local_size("new_group", [0, 1, 2])
    monkeypatch.delenv("HOCCL_LOCAL_SIZE")
    assert simulated_local_size("new_group", [0, 2]) is None
