"""torch calls that valid programs make, on hoccl's backend against gloo's
(tests/torch_programs/run_calls.py under mpiexec): all_gather_coalesced, writes into
tensors that require grad (DDP with ``backward(create_graph=True)``), and recv with no
source; and the error a recv with no source gets on the cuda backend.  Skipped when
torch is not installed."""

import re

import pytest

torch = pytest.importorskip("torch")

from test_torch import PROGRAMS, launch  # noqa: E402


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_calls_valid_programs_make_give_gloos_answers_on_hoccl(ranks):
    code, output = launch(ranks, PROGRAMS / "run_calls.py",
                          env={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    assert code == 0, output[-6000:]
    assert re.search(rf"torch calls ranks={ranks}: \d+ passed, 0 failed", output), \
        output[-6000:]


def test_a_recv_from_any_source_on_the_cuda_backend_says_it_needs_the_host_backend():
    """No GPU needed: a fake CUDA tensor reaches the check, and a communicator stand-in
    says the group runs on the cuda backend."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    import hoccl
    from hoccl.torch import ProcessGroupHoccl

    class OnAGPU:
        rank, world_size, backend, device = 0, 2, "cuda", 0

    group = ProcessGroupHoccl(OnAGPU())
    with FakeTensorMode():
        tensor = torch.empty(3, device="cuda")
    with pytest.raises(hoccl.InvalidArgumentError,
                       match=r"^recv: src=None \(a recv from any source\) needs hoccl's host "
                             r"backend.*cuda backend \(device 0\).*pass src="):
        group.recv_anysource([tensor])


def test_the_plain_api_still_refuses_to_write_into_a_tensor_that_requires_grad(init_local):
    """The torch backend turns grad mode off around its calls; hoccl's own API keeps its
    check (autograd would not see the write)."""
    import hoccl
    comms = init_local(2, backend="host")
    leaf = torch.zeros(4, requires_grad=True)
    with pytest.raises(hoccl.InvalidArgumentError, match=r"^all_reduce: recvbuf requires grad"):
        comms[0].all_reduce(torch.ones(4), leaf)
