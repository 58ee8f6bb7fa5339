"""Collectives across simulated hosts under mpiexec on the host backend: every
collective, both forms, odd counts, several dtypes, ops and roots, bit for bit against
numpy reducing as the hosts do (``tests/mpi/run_hierarchical.py``), on 2 hosts x 2,
3 x 1 and 2 x 3 ranks with hoccl itself between the hosts, on 2 x 2 with MPI between
them, and one simulated host (the plain Communicator); hosts whose inside engines
differ (hoccl's host backend on some, a torch gloo group standing for a vendor library
on others) with MPI, gloo or hoccl between them, every dtype and op; a step across
hosts whose peer never comes ends in a timeout.  Plus the grouping of ranks into hosts,
in one process."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hoccl
from hoccl._hierarchy import SubBootstrap, host_topology
from hoccl.sched.hierarchical import Topology

from test_mpi import MPI_ENV, _mpiexec

SCRIPT = Path(__file__).parent / "mpi" / "run_hierarchical.py"

ALL_DTYPES = "float16,bfloat16,float32,float64,int8,uint8,int32,int64"
ALL_OPS = "sum,prod,max,min,avg"
RUNS = {  # (ranks, local size, inter-host engine, torch hosts): (dtypes, counts, ops)
    (4, 2, "hoccl", ""): ("float32,bfloat16,int32,uint8", "0,5,17", "sum,max,avg"),
    (4, 2, "mpi", ""): ("float32,bfloat16", "17", "sum,avg"),
    (3, 1, "hoccl", ""): ("float32,uint8", "1,17", "sum,avg"),
    (6, 3, "hoccl", ""): ("int32,bfloat16", "0,17", "sum,avg"),
    (2, 2, "hoccl", ""): ("int32", "5", "sum"),
    # hosts of different kinds: a torch gloo group inside some, hoccl's backend in others
    (4, 2, "mpi", "1"): (ALL_DTYPES, "0,5,17", ALL_OPS),
    (4, 2, "gloo", "0"): ("float16,bfloat16,int8", "0,17", "sum,prod,avg"),
    (6, 2, "hoccl", "1"): ("float16,bfloat16,float32", "17", "sum,min,avg"),
    (3, 1, "mpi", "1"): ("bfloat16,int64", "5", "sum,max,avg"),
    # UCX between the hosts (shared memory and TCP here): every dtype and op
    (4, 2, "ucx", ""): (ALL_DTYPES, "0,5,17", ALL_OPS),
    (3, 1, "ucx", "1"): ("float16,bfloat16,float32,int64", "1,17", "sum,max,avg"),
}
#: runs whose phases are pipelined in chunks of this many bytes
PIPELINED_RUNS = {(4, 2, "mpi", "1"): 16, (6, 2, "hoccl", "1"): 8, (4, 2, "ucx", ""): 16}
#: MPI runs whose steps move through MPI's own path (``HOCCL_CROSS_MEMORY=0``); the others'
#: ranks share this machine, so their receivers read the senders' memory
POINT_TO_POINT_RUNS = {(4, 2, "mpi", "")}


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,local_size,inter_host,torch_hosts", list(RUNS))
def test_collectives_across_simulated_hosts_match_numpy(ranks, local_size, inter_host,
                                                        torch_hosts):
    dtypes, counts, ops = RUNS[ranks, local_size, inter_host, torch_hosts]
    command = [_mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT), "--backend", "host",
               "--inter-host", inter_host, "--dtypes", dtypes, "--counts", counts, "--ops", ops,
               "--torch-hosts", torch_hosts]
    if (ranks, local_size, inter_host, torch_hosts) in PIPELINED_RUNS:
        command += ["--phases", "pipelined", "--phase-bytes",
                    str(PIPELINED_RUNS[ranks, local_size, inter_host, torch_hosts])]
    env = {**os.environ, **MPI_ENV, "HOCCL_VERIFY": "1", "HOCCL_LOCAL_SIZE": str(local_size)}
    point_to_point = (ranks, local_size, inter_host, torch_hosts) in POINT_TO_POINT_RUNS
    if point_to_point:
        env["HOCCL_CROSS_MEMORY"] = "0"
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    hosts = ranks // local_size
    assert f"ranks={ranks} hosts={hosts}x{local_size} backend=host" in output, output[-4000:]
    if inter_host == "mpi":
        label = "mpi (staged)" if point_to_point else "mpi, cross-memory (staged)"
        assert f"'inter_host': '{label}'" in output, output[-4000:]
    if inter_host == "ucx":  # the transports UCX found are named
        assert re.search(r"'inter_host': 'ucx \[[^]]*tcp/[^]]*\] \(staged\)'", output), \
            output[-4000:]
    assert " 0 failed" in output and " 0 passed" not in output, output[-4000:]
    for host in (int(h) for h in torch_hosts.split(",") if h):
        assert f"'host': {host}, 'hostname'" in output, output[-4000:]
        assert "'engine': 'torch (gloo)'" in output, output[-4000:]


@pytest.mark.mpi
def test_a_step_across_hosts_whose_peer_never_comes_times_out_instead_of_hanging():
    """run_hierarchical_absent.py: MPI between two simulated hosts, rank 1 never calls;
    rank 0's all_reduce raises HocclTimeoutError within its timeout, output untouched,
    and its next call AbortedError at once."""
    command = [_mpiexec(), "-n", "2", sys.executable,
               str(SCRIPT.parent / "run_hierarchical_absent.py")]
    env = {**os.environ, **MPI_ENV, "HOCCL_VERIFY": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    output = result.stdout + result.stderr
    assert "absent across hosts: rank 0 OK" in output, output[-4000:]


class NamedRanks:
    """A bootstrap whose ranks report the given hostnames (``allgather`` of a hostname
    answers with them; anything else with every rank's value)."""

    def __init__(self, names, rank=0):
        self.names, self.rank, self.world_size = list(names), rank, len(names)

    def allgather(self, value):
        return list(self.names)

    def barrier(self):
        pass

    def close(self):
        pass


def test_ranks_are_grouped_by_hostname_in_blocks():
    topology, names, grouping = host_topology("init", NamedRanks(["a", "a", "b", "b"]), None)
    assert topology == Topology(2, 2) and grouping == "hostname"


def test_local_size_makes_simulated_hosts_on_one_machine():
    topology, _, grouping = host_topology("init", NamedRanks(["a"] * 6), 3)
    assert topology == Topology(2, 3) and grouping == "local_size=3"


def test_the_environment_gives_the_local_size(monkeypatch):
    monkeypatch.setenv("HOCCL_LOCAL_SIZE", "2")
    topology, _, grouping = host_topology("init", NamedRanks(["a"] * 4), None)
    assert topology == Topology(2, 2) and grouping == "HOCCL_LOCAL_SIZE=2"


@pytest.mark.parametrize("names,local_size,message", [
    (["a", "b", "a", "b"], None, "blocks of equal size per host"),
    (["a", "a", "a", "b"], None, "blocks of equal size per host"),
    (["a"] * 4, 3, "divides the world size 4"),
    (["a"] * 4, 0, "positive int"),
    (["a", "a", "b", "b"], 4, "run on"),
])
def test_groupings_that_cannot_be_hosts_are_refused(names, local_size, message):
    with pytest.raises(hoccl.InvalidArgumentError, match=message):
        host_topology("init", NamedRanks(names), local_size)


def test_a_sub_bootstrap_keeps_its_members_values():
    class Everyone(NamedRanks):
        def allgather(self, value):
            return [f"{value}{rank}" for rank in range(self.world_size)]
    sub = SubBootstrap(Everyone(["a"] * 6, rank=4), [1, 4, 5])
    assert (sub.rank, sub.world_size) == (1, 3)
    assert sub.allgather("x") == ["x1", "x4", "x5"]


CROSS_MEMORY = r"""
import os, sys
from mpi4py import MPI
world = MPI.COMM_WORLD
os.environ["HOCCL_CROSS_MEMORY"] = sys.argv[1 + world.rank]
from hoccl._errors import InvalidArgumentError
from hoccl._hierarchy.cma import CmaTransport
try:
    told = CmaTransport.connect(world.Dup()).label
except InvalidArgumentError as error:
    told = f"refused: {error}"
for rank, line in enumerate(world.gather(told, root=0) or []):
    print(f"rank {rank}: {line}", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("values,told", [
    (("1", "1"), "mpi, cross-memory"), (("1", "0"), "mpi"), (("on", "maybe"), "refused")])
def test_the_cross_memory_switch_is_agreed_by_every_member(values, told):
    """``HOCCL_CROSS_MEMORY`` per member: on where every member says 1, MPI's own path
    where one says 0, and a value that is neither refused on every member (none hangs
    in the connection's collectives)."""
    command = [_mpiexec(), "-n", "2", sys.executable, "-c", CROSS_MEMORY, *values]
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": str(SCRIPT.parents[2])}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for rank in range(2):
        line = re.search(rf"^rank {rank}: (.*)$", output, re.M)
        assert line is not None, output[-4000:]
        if told == "refused":
            assert line.group(1).startswith("refused: member 1: ") and "'maybe'" in line.group(
                1) and "HOCCL_CROSS_MEMORY must be 1 or 0" in line.group(1), output[-4000:]
        else:
            assert line.group(1) == told, output[-4000:]


def test_an_unknown_inter_host_engine_is_refused():
    with pytest.raises(hoccl.InvalidArgumentError, match="inter_host must be one of"):
        hoccl.init(backend="host", bootstrap=NamedRanks(["a"]), inter_host="rdma")


@pytest.mark.mpi
def test_the_mixed_job_program_runs_on_cpus_alone(tmp_path):
    """run_mixed_job.py (the one-GPU mixed job) with every rank on the host backend: each
    rank checks every collective, sequential and pipelined, batched sends and receives
    across the hosts, the sendrecv bandwidth's results beside gloo's, and GPipe and 1F1B
    against the reference and gloo, and reports OK; rank 0 writes the JSON."""
    out = tmp_path / "mixed_job.json"
    command = [_mpiexec(), "-n", "4", sys.executable, str(SCRIPT.parent / "run_mixed_job.py"),
               "--cpu-only", "--counts", "0,17", "--dtypes", "bfloat16,int32", "--ops", "sum,avg",
               "--pair-counts", "0,1,65537", "--p2p-sizes", "64K", "--json", str(out)]
    env = {**os.environ, **MPI_ENV, "HOCCL_VERIFY": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for rank in range(4):
        assert re.search(rf"rank {rank}: OK (\d+)/\1(?!\d)", output), output[-4000:]
    result = json.loads(out.read_text())
    assert result["failed"] == 0 and result["pairs"]["passed"] == 18, result
    assert {(r["library"], r["wrong"]) for r in result["p2p"]} == {("hoccl", 0), ("gloo", 0)}
    assert [r["schedule"] for r in result["pipelining"]] == ["GPipe", "1F1B"], result


@pytest.mark.mpi
@pytest.mark.parametrize("transport", ["mpi", "cma"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_mpi_transport_steps_between_members_handing_arrays_and_lists(ranks, transport):
    """The staged engine's MPI transports (MPI's own path; receivers reading the senders'
    memory) on every step, every root: a member in host memory hands its own arrays'
    blocks as a list, a staged member a block-major slot; both get numpy's bytes."""
    command = [_mpiexec(), "-n", str(ranks), sys.executable,
               str(SCRIPT.parent / "run_transport_pieces.py"), "--transport", transport]
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": str(SCRIPT.parents[2])}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for rank in range(ranks):
        assert re.search(rf"rank {rank}: OK (\d+)/\1(?!\d)", output), output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("host_member,plant,mapped", [(0, False, True), (1, False, True),
                                                      (1, False, False), (1, True, True)])
def test_a_host_member_folds_its_staged_peers_slots_as_it_reads_them(host_member, plant,
                                                                     mapped):
    """The staged engine's all_reduce between a staged member and a member in host memory
    (``run_fold_as_read.py``): the host member folds as it reads, in place too, every
    dtype, op and chunking bit for bit against numpy, each peer's segment mapped (or every
    piece read by cross-memory attach); a flipped bit in each of its outputs is caught."""
    command = [_mpiexec(), "-n", "2", sys.executable, str(SCRIPT.parent / "run_fold_as_read.py"),
               "--host-member", str(host_member)] + (["--plant"] if plant else []) + (
                   [] if mapped else ["--no-map"])
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": str(SCRIPT.parents[2])}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    found = re.search(r"fold as read, host member \d: (\d+) passed, (\d+) failed \((\d+) faults "
                      r"planted\); (\d+) pieces read where mapped", output)
    assert found, output[-4000:]
    passed, failed, planted, read_mapped = map(int, found.groups())
    assert passed + failed == 512 and failed == planted == (192 if plant else 0), output[-4000:]
    assert (read_mapped > 0) == mapped, output[-4000:]
