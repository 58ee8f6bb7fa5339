"""Read-only memory is never written: every collective refuses a read-only receive buffer
(numpy writeable=False, np.frombuffer of bytes, a __cuda_array_interface__ exported
read-only, a torch tensor that requires grad) with InvalidArgumentError before anything
is enqueued, while read-only send buffers are fine.  Every rank makes each refused call,
as a program does: a refused call takes its place in every rank's sequence of calls."""

import numpy as np
import pytest

import hoccl


@pytest.fixture(scope="module")
def comms():
    comms = hoccl.init_local(2, backend="host")
    yield comms
    for comm in comms:
        comm.close()


def _read_only(array):
    array = array.copy()
    array.flags.writeable = False
    return array


CALLS = {
    "all_gather": lambda c, s, r: c.all_gather(s, r),
    "all_reduce": lambda c, s, r: c.all_reduce(s, r),
    "broadcast": lambda c, s, r: c.broadcast(s, r, 0),
    "recv": lambda c, s, r: c.recv(r, 1 - c.rank),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("kind", ["writeable=False", "frombuffer"])
def test_read_only_receive_buffers_are_refused_and_nothing_is_enqueued(comms, call, kind):
    size = 8 if call == "all_gather" else 4
    if kind == "frombuffer":
        recv = np.frombuffer(bytes(4 * size), dtype=np.float32)
    else:
        recv = _read_only(np.zeros(size, np.float32))
    before = [comm._engine.calls for comm in comms]
    for comm in comms:
        with pytest.raises(hoccl.InvalidArgumentError, match="read-only") as info:
            CALLS[call](comm, np.ones(4, np.float32), recv)
        assert str(info.value).startswith(f"{call}: ")
    assert [comm._engine.calls for comm in comms] == before
    assert not recv.any()


def test_read_only_send_buffers_are_fine(comms):
    sends = [_read_only(np.full(4, rank + 1.0, np.float32)) for rank in range(2)]
    outs = [np.full(8, np.nan, np.float32) for _ in range(2)]
    for comm in comms:
        comm.all_gather(sends[comm.rank], outs[comm.rank])
    for comm in comms:
        comm.synchronize()
    want = np.array([1.0] * 4 + [2.0] * 4, np.float32)
    assert all(np.array_equal(out.view(np.uint32), want.view(np.uint32)) for out in outs)


def test_a_tensor_that_requires_grad_is_refused_as_an_output(comms):
    torch = pytest.importorskip("torch")
    leaf = torch.zeros(4, requires_grad=True)
    for comm in comms:
        with pytest.raises(hoccl.InvalidArgumentError, match="requires grad"):
            comm.all_reduce(torch.ones(4), leaf)
    assert not leaf.detach().any()
