"""torch.distributed.pipelining on the "hoccl" backend across simulated hosts under mpiexec
(``tests/torch_programs/run_pipeline.py``): every schedule of the installed torch, one
stage per rank and two (in loops and in a V), gives each rank's gradients and the losses
of a single-process reference and gloo's bit for bit; pipeline × data parallel on a 2-D
DeviceMesh ("pp" across hosts, "dp" inside them) trains to gloo's losses and parameters.
Skipped when torch is not installed."""

import re

import pytest

torch = pytest.importorskip("torch")

from test_torch import PROGRAMS, launch  # noqa: E402

ALL = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
       "ZBVZeroBubble", "DualPipeV")
RUNS = [  # (ranks, local size, inter-host engine or "", the schedules' groups, schedules, mesh)
    (2, 1, "mpi", "world", ALL, False),
    (2, 1, "gloo", "world", ALL, False),
    # hoccl's own engine between simulated hosts, and inside a host: schedules whose ranks
    # batch their sends and recvs alike (hoccl's groups match a batch as a whole)
    (2, 1, "", "world", ALL[:2], False),
    (4, 2, "", "world", ALL[:2], False),
    (4, 2, "mpi", "rails", ALL, True),
]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,local_size,inter_host,pp,schedules,mesh", RUNS)
def test_pipeline_schedules_across_hosts_match_the_reference_and_gloo(ranks, local_size,
                                                                      inter_host, pp,
                                                                      schedules, mesh):
    args = ["--schedules", ",".join(schedules), "--pp", pp]
    if inter_host:
        args += ["--inter-host", inter_host]
    if mesh:
        args.append("--mesh")
    code, output = launch(ranks, PROGRAMS / "run_pipeline.py", *args,
                          env={"HOCCL_LOCAL_SIZE": str(local_size)}, timeout=600)
    assert code == 0, output[-6000:]
    found = re.search(rf"pipeline ranks={ranks} pp={pp} inter=(.+): (\d+) passed, 0 failed",
                      output)
    checks = len(schedules) + (1 if mesh else 0)
    assert found and int(found.group(2)) == checks * ranks, output[-6000:]
    if inter_host:
        assert found.group(1).startswith(inter_host), output[-6000:]
    else:
        assert found.group(1) == "hoccl (host)", output[-6000:]
    for schedule in schedules:
        assert re.search(rf"^{schedule}: OK ", output, re.M), output[-6000:]
    if mesh:
        assert re.search(r"^pp x dp mesh: OK .*HierarchicalCommunicator rank 0/2 \(2 hosts x 1\)",
                         output, re.M), output[-6000:]
