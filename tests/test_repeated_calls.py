"""A call repeated on arguments that resolve alike skips the argument checks
(``hoccl._repeats``) and stays exact; its mismatches still raise on every rank
(``tests/mpi/run_repeated_arguments.py``, in one process and under mpiexec).  Under
mpiexec, repeats on registered buffers send no message from the call (``folds``), and a
diverged repeat still raises DivergedError on every rank."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hoccl
import hoccl._api
from hoccl import _buffers
from hoccl.testing import poison, random_array
from test_mpi import MPI_ENV, _mpiexec

SCRIPT = Path(__file__).parent / "mpi" / "run_repeated_arguments.py"
ROOT = str(Path(__file__).resolve().parents[1])


def _run(command):
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": ROOT}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("case", ["exact", "mismatch"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_repeated_calls_in_one_process(case, ranks):
    returncode, output = _run([sys.executable, str(SCRIPT), case, "--local", str(ranks)])
    assert returncode == 0 and output.count(f"{case} ok") == ranks, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["exact", "mismatch", "folds"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_repeated_calls_under_mpiexec(case, ranks):
    returncode, output = _run([_mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT), case])
    assert returncode == 0 and output.count(f"{case} ok") == ranks, output[-4000:]


def test_torch_tensors_at_the_same_memory_are_repeats(monkeypatch):
    torch = pytest.importorskip("torch")
    resolved = []
    original = hoccl._api.as_buffer
    monkeypatch.setattr(hoccl._api, "as_buffer",
                        lambda *args, **kwargs: resolved.append(args[1]) or original(*args,
                                                                                   **kwargs))
    comms = hoccl.init_local(2, backend="host")
    rng = np.random.default_rng(3)
    try:
        sends = [torch.empty(257) for _ in comms]
        recvs = [torch.empty(257) for _ in comms]
        for repeat in range(4):
            data = [random_array(rng, 257, "float32") for _ in comms]
            for rank, comm in enumerate(comms):
                sends[rank].copy_(torch.from_numpy(data[rank]))
                recvs[rank].copy_(torch.from_numpy(poison(257, "float32")))
                # new tensor objects over the same memory, as the caching allocator gives
                comm.all_reduce(sends[rank].view(-1), recvs[rank][:])
            for comm in comms:
                comm.synchronize()
            for rank in range(len(comms)):
                np.testing.assert_allclose(recvs[rank].numpy(), data[0] + data[1], rtol=1e-6)
        assert resolved == ["sendbuf", "recvbuf"] * len(comms), resolved
        # a tensor that requires grad is checked every time (grad mode decides its verdict)
        wanting = torch.zeros(257, requires_grad=True)
        for comm in comms:
            with pytest.raises(hoccl.InvalidArgumentError, match="all_reduce: recvbuf requires"):
                comm.all_reduce(sends[comm.rank], wanting)
    finally:
        for comm in comms:
            comm.close()


def test_changed_arguments_are_checked_again():
    (comm,) = hoccl.init_local(1, backend="host")
    try:
        send, recv = np.ones(16, np.float32), np.zeros(16, np.float32)
        comm.all_reduce(send, recv)
        comm.all_reduce(send, recv)
        recv.flags.writeable = False  # the same memory, now read-only: refused
        with pytest.raises(hoccl.InvalidArgumentError, match="all_reduce: recvbuf"):
            comm.all_reduce(send, recv)
        with pytest.raises(hoccl.InvalidArgumentError, match="all_reduce: .*op"):
            comm.all_reduce(send, np.zeros(16, np.float32), "nonsense")
        comm.synchronize()
        assert comm._repeats.hits == 1
    finally:
        comm.close()


def test_a_kept_argument_list_holds_no_array():
    import gc
    import weakref
    (comm,) = hoccl.init_local(1, backend="host")
    try:
        send, recv = np.ones(16, np.float32), np.zeros(16, np.float32)
        comm.all_reduce(send, recv)
        comm.synchronize()
        gone = weakref.ref(send)
        del send
        gc.collect()
        assert gone() is None, "the repeat cache keeps the call's array alive"
    finally:
        comm.close()


def test_an_array_given_twice_in_a_row_is_keyed_once(monkeypatch):
    """In place (the same array as send and recv) the key reads the array once, and equals
    the key of two arrays with the same answers; an argument between them keys both."""
    from hoccl import _repeats
    read = []
    monkeypatch.setattr(_repeats, "repeat_key",
                        lambda array: read.append(id(array)) or _buffers.repeat_key(array))
    x = np.zeros(17, np.float32)
    twice = _repeats.Repeats.key("all_reduce", (x, x), {"op": "sum"})
    assert read == [id(x)]
    alias = x[:]  # another object with the same answers
    assert _repeats.Repeats.key("all_reduce", (x, alias), {"op": "sum"}) == twice
    read.clear()
    apart = _repeats.Repeats.key("broadcast", (x, 0, x), {})
    assert read == [id(x), id(x)] and apart[1] == apart[3] and apart[2] == (int, 0)
