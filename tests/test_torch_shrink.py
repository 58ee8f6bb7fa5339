"""``dist.shrink_group`` on the hoccl backend (host): workers started through torch's
env:// rendezvous on a store this test hosts (torchrun's agent store), no MPI; a worker
exits or is killed (SIGKILL, during a large all_reduce), first, last or in the middle,
once or twice, of one host or of two simulated ones; the survivors shrink the default
group or a subgroup (SHRINK_DEFAULT and SHRINK_ABORT) and go on exactly: 20 all_reduces,
then DDP and FSDP2 steps equal to a reference."""

import os
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


def _job(ranks, *args, env=None):
    """``ranks`` workers of run_shrink.py on a store hosted here (``env`` added to their
    environment); each one's output."""
    if not hasattr(dist, "shrink_group"):
        pytest.skip("this torch has no dist.shrink_group")
    # the store binds a free port itself (a port probed, then closed, may be taken
    # before the store binds it)
    store = dist.TCPStore("127.0.0.1", 0, ranks, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    port = store.port
    outputs = []
    with tempfile.TemporaryDirectory() as stamps:
        workers = []
        for rank in range(ranks):
            worker_env = {
                **os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(ranks),
                "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            workers.append(subprocess.Popen(
                [sys.executable, str(PROGRAM), *args, "--stamps", stamps],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env))
        try:
            for worker in workers:
                outputs.append(worker.communicate(timeout=300)[0])
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
    del store
    return outputs


@pytest.mark.parametrize("ranks,victims,flags,local_size", [
    (3, [2], [], None),                            # the last worker, the default group
    (4, [0], [], None),                            # the first (the store outlives it)
    (4, [1], ["--subgroup"], None),                # one in the middle, a subgroup
    (4, [2], ["--how", "kill", "--abort"], None),  # SIGKILL during a 32 MiB all_reduce
    (4, [3, 1], [], None),                         # two failures, one after the other
    (3, [0, 2], ["--subgroup", "--abort"], None),
    (4, [0], [], 2),                               # 2 simulated hosts: the first worker
    (4, [2], ["--subgroup", "--abort"], 2),        # the first of the second host
    (4, [3, 1], [], 2),                            # a rank of each host in turn
    (4, [3], ["--inter-host", "ucx"], 2),          # UCX between the hosts
    (4, [0], ["--inter-host", "ucx", "--abort"], 2),
])
def test_shrink_group_goes_on_exactly_after_lost_workers(ranks, victims, flags, local_size):
    """After each loss the survivors' all_reduces are exact, and DDP and FSDP2 steps on
    the shrunk group equal the same steps taken in one process."""
    outputs = _job(ranks, "--victims", ",".join(map(str, victims)), *flags,
                   env={"HOCCL_LOCAL_SIZE": str(local_size)} if local_size else None)
    joined = "\n".join(f"--- worker {rank}:\n{output[-3000:]}"
                       for rank, output in enumerate(outputs))
    assert "FAILED" not in joined, joined
    for rank in range(ranks):
        if rank == victims[0]:
            continue
        assert f"rank {rank}: OK detect" in outputs[rank], joined
        if len(victims) > 1 and rank != victims[1]:
            assert f"rank {rank}: second OK detect" in outputs[rank], joined
