"""The public API under mpiexec (-n 2 and -n 4) on the host backend: real rendezvous,
descriptor exchange, cross-process copies and signals."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "mpi" / "run_checks.py"


def _mpiexec():
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        if os.environ.get("HOCCL_REQUIRE_MPI"):
            pytest.fail("mpiexec not found, and HOCCL_REQUIRE_MPI is set")
        pytest.skip("mpiexec not found")
    return found


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_api_under_mpiexec_on_the_host_backend(ranks):
    command = [_mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT), "--backend", "host"]
    # Open MPI refuses root and more ranks than cores unless told; MPICH ignores these.
    env = {**os.environ, "HOCCL_VERIFY": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert f"mpi ranks={ranks} backend=host:" in output and " 0 failed" in output, output[-4000:]
