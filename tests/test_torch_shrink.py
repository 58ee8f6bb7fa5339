"""``dist.shrink_group`` on the hoccl backend (host): workers started through torch's
env:// rendezvous on a store this test hosts (torchrun's agent store), no MPI; a worker
exits or is killed (SIGKILL, during a large all_reduce), first, last or in the middle,
once or twice; the survivors shrink the default group or a subgroup (SHRINK_DEFAULT and
SHRINK_ABORT) and go on exactly: 20 all_reduces and a DDP step."""

import os
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = Path(__file__).parent / "torch_programs" / "run_shrink.py"


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _job(ranks, *args):
    """``ranks`` workers of run_shrink.py on a store hosted here; each one's output."""
    if not hasattr(dist, "shrink_group"):
        pytest.skip("this torch has no dist.shrink_group")
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    outputs = []
    with tempfile.TemporaryDirectory() as stamps:
        workers = []
        for rank in range(ranks):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks),
                   "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            workers.append(subprocess.Popen(
                [sys.executable, str(PROGRAM), *args, "--stamps", stamps], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        try:
            for worker in workers:
                outputs.append(worker.communicate(timeout=300)[0])
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
    del store
    return outputs


@pytest.mark.parametrize("ranks,victims,flags", [
    (3, [2], []),                              # the last worker, the default group
    (4, [0], []),                              # the first (the store outlives it)
    (4, [1], ["--subgroup"]),                  # one in the middle, a subgroup
    (4, [2], ["--how", "kill", "--abort"]),    # SIGKILL during a 32 MiB all_reduce
    (4, [3, 1], []),                           # two failures, one after the other
    (3, [0, 2], ["--subgroup", "--abort"]),
])
def test_shrink_group_goes_on_exactly_after_lost_workers(ranks, victims, flags):
    outputs = _job(ranks, "--victims", ",".join(map(str, victims)), *flags)
    joined = "\n".join(f"--- worker {rank}:\n{output[-3000:]}"
                       for rank, output in enumerate(outputs))
    assert "FAILED" not in joined, joined
    for rank in range(ranks):
        if rank == victims[0]:
            continue
        assert f"rank {rank}: OK detect" in outputs[rank], joined
        if len(victims) > 1 and rank != victims[1]:
            assert f"rank {rank}: second OK detect" in outputs[rank], joined
