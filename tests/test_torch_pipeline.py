"""torch.distributed.pipelining on the "hoccl" backend under mpiexec
(``tests/torch_programs/run_pipeline.py``), on one host and across simulated hosts: every
schedule of the installed torch, one stage per rank and two (in loops and in a V), gives
each rank's gradients and the losses of a single-process reference and gloo's bit for
bit; pipeline × data parallel on a 2-D DeviceMesh ("pp" joining the halves of the world,
"dp" inside them) trains to gloo's losses and parameters.  hoccl's own engine links the
ranks of one host (a flat communicator, or inside a simulated host) and, with no
``inter_host``, the simulated hosts too: there a group matches its sends and receives call
by call, so the schedules whose ranks batch them differently (interleaved, looped,
zero-bubble, V) do not wait in a cycle.  Skipped when torch is not installed."""

import re

import pytest

torch = pytest.importorskip("torch")

from test_torch import PROGRAMS, launch  # noqa: E402

ALL = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
       "ZBVZeroBubble", "DualPipeV")
RUNS = [  # (ranks, local size, inter-host engine or "", the schedules' groups, mesh)
    # one host: a flat hoccl communicator links every stage
    (2, 2, "", "world", True),
    (4, 4, "", "world", True),
    # simulated hosts: hoccl's engine inside them and between them
    (2, 1, "", "world", True),
    (4, 2, "", "world", True),
    # MPI or gloo between hosts
    (2, 1, "mpi", "world", False),
    (2, 1, "gloo", "world", False),
    (4, 2, "mpi", "rails", True),
    # UCX between hosts
    (2, 1, "ucx", "world", False),
    (4, 2, "ucx", "rails", True),
]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,local_size,inter_host,pp,mesh", RUNS)
def test_pipeline_schedules_match_the_reference_and_gloo(ranks, local_size, inter_host, pp,
                                                         mesh):
    args = ["--schedules", ",".join(ALL), "--pp", pp]
    if inter_host:
        args += ["--inter-host", inter_host]
    if mesh:
        args.append("--mesh")
    code, output = launch(ranks, PROGRAMS / "run_pipeline.py", *args,
                          env={"HOCCL_LOCAL_SIZE": str(local_size)}, timeout=600)
    assert code == 0, output[-6000:]
    found = re.search(rf"pipeline ranks={ranks} pp={pp} inter=(.+): (\d+) passed, 0 failed",
                      output)
    checks = len(ALL) + (1 if mesh else 0)
    assert found and int(found.group(2)) == checks * ranks, output[-6000:]
    hosts = ranks // local_size
    if inter_host:
        assert found.group(1).startswith(inter_host), output[-6000:]
    else:
        assert found.group(1) == ("hoccl (host)" if hosts > 1 else "none"), output[-6000:]
    for schedule in ALL:
        assert re.search(rf"^{schedule}: OK ", output, re.M), output[-6000:]
    if mesh:
        pp_group = (r"HierarchicalCommunicator rank 0/2 \(2 hosts x 1\)" if hosts > 1 else
                    r"hoccl\.Communicator rank 0/2 ")
        assert re.search(rf"^pp x dp mesh: OK .*{pp_group}", output, re.M), output[-6000:]
