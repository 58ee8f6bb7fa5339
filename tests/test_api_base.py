"""``CommunicatorApi`` holds every collective's argument checks: ``Communicator`` and
``HierarchicalCommunicator`` both derive from it and only run the checked calls."""

import numpy as np
import pytest

import hoccl
from hoccl._api import CommunicatorApi
from hoccl._hierarchy import HierarchicalCommunicator

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
               "reduce", "gather", "scatter", "send", "recv", "barrier", "explain")


class Recording(CommunicatorApi):
    """A communicator whose hook records the checked calls."""
    rank, world_size, backend, device = 1, 3, "host", None
    device_handle = options = timeout = max_sms = copy_sms = None
    aborted = closed = False
    abort_reason = ""

    def __init__(self):
        self.ran = []

    def _usable(self, name):
        pass

    def _run(self, name, shape, buffers, stream):
        self.ran.append((name, shape, buffers, stream))

    def _explain(self, shape):
        return {"shape": shape}

    synchronize = abort = close = split = register = deregister = set_options = None


@pytest.mark.parametrize("kind", [hoccl.Communicator, HierarchicalCommunicator])
def test_both_communicators_take_the_collectives_from_the_base(kind):
    assert issubclass(kind, CommunicatorApi)
    for name in COLLECTIVES:
        assert getattr(kind, name) is getattr(CommunicatorApi, name), name


def test_a_checked_call_reaches_the_hook_with_its_shape_and_buffers():
    comm = Recording()
    send = np.random.default_rng().standard_normal(4).astype(np.float32)
    recv = np.full(12, np.nan, np.float32)
    comm.all_gather(send, recv, stream="s")
    (name, shape, buffers, stream), = comm.ran
    assert (name, stream) == ("all_gather", "s")
    assert (shape.collective, shape.world_size, shape.count, shape.dtype) == (
        "all_gather", 3, 4, "float32")
    assert buffers["send"].address == send.ctypes.data
    assert buffers["recv"].address == recv.ctypes.data
    assert comm.explain("all_reduce", 64)["shape"].count == 16


def test_a_bad_argument_is_refused_before_the_hook():
    comm = Recording()
    with pytest.raises(hoccl.InvalidArgumentError, match=r"^all_gather: .*"):
        comm.all_gather(np.zeros(4, np.float32), np.zeros(11, np.float32))
    with pytest.raises(hoccl.InvalidArgumentError, match=r"^send: peer"):
        comm.send(np.zeros(4, np.float32), peer=1)  # itself
    with pytest.raises(hoccl.InvalidArgumentError, match=r"^explain: nbytes"):
        comm.explain("all_gather", 7)
    assert comm.ran == []
