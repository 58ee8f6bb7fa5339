"""Bad and unusual arguments across processes (tests/mpi/run_arguments.py under mpiexec):
``synchronize()`` inside a group gives the group's advice (and its call, abandoned on every
rank, runs on none; a repeated call one rank abandons raises MismatchError on the others),
integer scalars are roots, a bad stream names the public call."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_mpi import MPI_ENV, _mpiexec

SCRIPT = Path(__file__).parent / "mpi" / "run_arguments.py"


@pytest.mark.mpi
def test_arguments_under_mpiexec_get_the_errors_and_results_of_one_process():
    command = [_mpiexec(), "-n", "2", sys.executable, str(SCRIPT)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, **MPI_ENV})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for rank in range(2):
        assert f"rank {rank}: arguments: 10 passed, 0 failed" in output, output[-4000:]
