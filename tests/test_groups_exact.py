"""Any mix of calls in one ``hoccl.group()`` equals the same calls made one by one: random
groups of collectives (every kind, size, dtype, op and root) and send/recv rings, at 3
and 4 ranks, in one process (``init_local``) and under ``mpiexec``, outputs poisoned
first and compared exactly with numpy (``tests/mpi/run_groups.py``).

Grouped collectives of one communicator share its signal slots and scratch: run side by
side, a later call's signals released an earlier call's waits on the peers, and its
copies overwrote scratch the earlier call still read (wrong results from 3 ranks on),
or a broadcast or scatter followed by another collective hung until the timeout.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_mpi import MPI_ENV, _mpiexec

SCRIPT = Path(__file__).parent / "mpi" / "run_groups.py"
ROOT = str(Path(__file__).resolve().parents[1])


def _run(command, timeout=300):
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": ROOT}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return result.returncode, result.stdout + result.stderr


def _assert_ok(returncode, output, ranks, groups):
    assert returncode == 0, output[-4000:]
    assert "FAILED" not in output and "Error" not in output, output[-4000:]
    # mpiexec may interleave the ranks' lines: count the reports, not the lines
    assert output.count(f": OK {groups} groups,") == ranks, output[-4000:]


@pytest.mark.parametrize("mix", ["random", "sums", "broadcast", "scatter"])
@pytest.mark.parametrize("ranks", [3, 4])
def test_groups_in_one_process(ranks, mix):
    groups = 120 if mix == "random" else 40
    returncode, output = _run([sys.executable, str(SCRIPT), "--local", str(ranks), "--mix", mix,
                               "--groups", str(groups), "--seed", str(ranks), "--timeout", "20"])
    assert returncode == 0, output[-4000:]
    assert f"rank {','.join(map(str, range(ranks)))}: OK {groups} groups," in output, \
        output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [3, 4])
def test_groups_under_mpiexec(ranks):
    returncode, output = _run([_mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT),
                               "--groups", "120", "--seed", str(10 + ranks), "--timeout", "20"])
    _assert_ok(returncode, output, ranks, 120)


@pytest.mark.mpi
@pytest.mark.parametrize("mix,ranks,runs", [("broadcast", 3, 20), ("scatter", 3, 10),
                                            ("scatter", 4, 10)])
def test_grouped_rooted_calls_never_hang(mix, ranks, runs):
    """The case that hung (a broadcast, or a scatter, then another collective in one
    group), in many short jobs: each must finish, exact, well inside its timeout."""
    for run in range(runs):
        returncode, output = _run([_mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT),
                                   "--mix", mix, "--groups", "8", "--seed", str(run),
                                   "--timeout", "15"], timeout=120)
        _assert_ok(returncode, output, ranks, 8)
