"""The "hoccl" torch backend on a job whose hosts differ (hoccl.torch._mixed): under
mpiexec, simulated hosts whose engines inside differ (hoccl's host backend on one, a torch
gloo group standing for a vendor library on the other) train DDP and FSDP2 to gloo's
losses and run every collective of torch.distributed against numpy; without a second
process, the pieces: where CPU tensors go, the errors' host and engine, the deferred
connection and the device library's groups.  Skipped when torch is not installed."""

import re
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

from test_torch import PROGRAMS, launch  # noqa: E402

import hoccl  # noqa: E402
from hoccl._hierarchy import HierarchicalCommunicator  # noqa: E402

#: two simulated hosts of two ranks: hoccl's host backend inside the first, a torch gloo
#: group (standing for a vendor library) inside the second
MIXED = ["--devices", "cpu", "--local-size", "2", "--intra-host", "host,host,torch,torch"]


@pytest.mark.mpi
def test_ddp_and_fsdp2_on_hosts_with_different_engines_train_to_gloos_losses():
    """Four ranks: within 1e-6 of gloo (gloo's ring sums four ranks in another order than
    hoccl's rule: hosts first, then between them)."""
    code, output = launch(4, PROGRAMS / "run_training.py", *MIXED, timeout=900)
    assert code == 0, output[-6000:]
    found = re.search(r"torch training ranks=4 default=hoccl mixed: (\d+) passed, 0 failed",
                      output)
    assert found and int(found.group(1)) == 4 * 6, output[-6000:]
    for name in ("DDP", "FSDP2 on hoccl, fp32", "FSDP2 on hoccl, bf16, prefetch"):
        assert re.search(rf"^{re.escape(name)}: largest relative difference", output, re.M), \
            output[-6000:]


@pytest.mark.mpi
def test_on_two_hosts_of_one_rank_training_matches_gloo_bit_for_bit():
    """Two ranks, one per host (hoccl's host backend, a gloo group): a sum of two is the
    same in either order, so every configuration ends identical to gloo's."""
    code, output = launch(2, PROGRAMS / "run_training.py", "--devices", "cpu", "--local-size",
                          "1", "--intra-host", "host,torch", timeout=600)
    assert code == 0, output[-6000:]
    lines = re.findall(r"^(.+): largest relative difference .*\((.+)\)$", output, re.M)
    assert len(lines) == 6 and all(verdict == "identical" for _, verdict in lines), lines


@pytest.mark.mpi
def test_every_collective_on_hosts_with_different_engines_matches_numpy():
    code, output = launch(4, PROGRAMS / "run_backend.py", *MIXED, timeout=900)
    assert code == 0, output[-6000:]
    assert re.search(r"torch ranks=4 backend=hoccl cpu mixed: \d+ passed, 0 failed", output), \
        output[-6000:]


class _Across(HierarchicalCommunicator):
    """A stand-in rank of a job across hosts: what the process group asks of it."""

    def __init__(self, backend, device, kinds):
        self.rank, self.world_size, self.backend, self.device = 2, 4, backend, device
        self.kinds = kinds

    def describe(self):
        return {"host": 1, "intra_host": f"hoccl ({self.backend})",
                "inter_host": "staged (mpi)",
                "host_engines": [{"host": index, "device": kind}
                                 for index, kind in enumerate(self.kinds)]}


def test_a_gpu_rank_of_a_mixed_job_takes_cpu_tensors_through_its_gpu():
    from hoccl.torch import ProcessGroupHoccl
    mixed = ProcessGroupHoccl(_Across("cuda", 0, ["cuda", "cpu"]))
    alike = ProcessGroupHoccl(_Across("cuda", 0, ["cuda", "cuda"]))
    cpu = [torch.ones(3), torch.zeros(3)]
    assert mixed.mixed and mixed.stages(cpu) and mixed.cpu_group is None
    assert not alike.mixed and not alike.stages(cpu)
    assert not mixed.stages([])


def test_an_error_across_hosts_names_the_rank_its_host_and_the_engines():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from hoccl.torch import ProcessGroupHoccl
    group = ProcessGroupHoccl(_Across("host", None, ["cuda", "cpu"]))
    with FakeTensorMode():
        tensor = torch.empty(3, device="cuda")
    with pytest.raises(hoccl.InvalidArgumentError,
                       match=r"^all_reduce: this hoccl process group runs on the host backend "
                             r"and takes CPU tensors; got \['cuda'\] tensors \(rank 2 on host 1, "
                             r"whose engine is hoccl \(host\), with staged \(mpi\) between "
                             r"hosts\)$"):
        group.allreduce([tensor])
    with pytest.raises(hoccl.InvalidArgumentError, match=r"^send: takes GPU tensors"):
        ProcessGroupHoccl(_Across("cuda", 0, ["cuda", "cpu"])).send([torch.ones(2)], 0)


def test_the_default_group_defers_its_communicator_when_a_host_runs_on_torch_groups():
    from hoccl.torch._mixed import needs_torch_groups
    store = torch.distributed.HashStore()
    assert needs_torch_groups(store, 0, 1, "torch", None)
    assert needs_torch_groups(store, 0, 1, None, "gloo")
    assert not needs_torch_groups(store, 0, 1, "host", "mpi")


def test_a_group_made_while_hoccl_makes_its_engines_is_the_device_librarys():
    import torch.distributed as dist
    from hoccl.torch import _create
    from hoccl.torch._mixed import library_groups

    class Made:
        store, group_rank, group_size = dist.HashStore(), 0, 1
        timeout = timedelta(seconds=30)
    with library_groups():
        group = _create(Made(), None)
    assert isinstance(group, dist.ProcessGroupGloo)
    tensor = torch.arange(4.0)
    group.allreduce([tensor]).wait()
    assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_options_check_the_engine_between_hosts():
    from hoccl.torch import Options
    assert Options(inter_host="mpi").inter_host == "mpi"
    with pytest.raises(hoccl.InvalidArgumentError, match=r"^Options: inter_host must be one of"):
        Options(inter_host="carrier pigeon")
