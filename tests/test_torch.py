"""PyTorch on hoccl, on the host backend: the torch.distributed backend under mpiexec
(-n 2 and -n 3), FSDP2 and DDP training against gloo, the training example and the
training benchmark's smoke run.  Skipped when torch is not installed."""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).parent / "torch"


def _mpiexec():
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        if os.environ.get("HOCCL_REQUIRE_MPI"):
            pytest.fail("mpiexec not found, and HOCCL_REQUIRE_MPI is set")
        pytest.skip("mpiexec not found")
    return found


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(ranks, *args, timeout=600):
    """``mpiexec -n ranks python args...`` with torch's env:// rendezvous set up."""
    env = {**os.environ, "HOCCL_VERIFY": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "PYTHONPATH": os.pathsep.join([str(PROGRAMS), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    command = [_mpiexec(), "-n", str(ranks), sys.executable, *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_every_torch_distributed_op_on_the_hoccl_backend(ranks):
    code, output = launch(ranks, PROGRAMS / "run_backend.py")
    assert code == 0, output[-6000:]
    assert re.search(rf"torch ranks={ranks} backend=hoccl: \d+ passed, 0 failed", output), \
        output[-6000:]
