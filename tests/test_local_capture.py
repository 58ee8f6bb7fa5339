"""Calls captured into CUDA graphs by one process driving several ranks (init_local), on
the host backend: ``capturing`` is forced on for the ranks' devices, so every call is
issued the way a captured one is (graph slots put back after their last wait, no signal
base, lanes of its own joined back to the caller) and issued again for each "replay",
as tests/mpi/run_capture.py does across processes.  Outputs are poisoned before every
replay and compared with numpy on fresh random data; a capture that ends before every
rank made the call, and a capture on some ranks only, are refused on every rank with
nothing written, and the communicators stay usable."""

import contextlib

import numpy as np
import pytest

import hoccl
from hoccl.testing import assert_exact

COUNT = 96


@contextlib.contextmanager
def capturing(*comms):
    """The streams of ``comms``' ranks report an open capture until the block ends."""
    devices = [comm._engine.device for comm in comms]
    for device in devices:
        device.capturing = lambda stream: True
    try:
        yield
    finally:
        for device in devices:
            del device.capturing


def synchronize(comms):
    """A captured call is no call the communicator counts: wait for the caller's stream
    (where its lanes join back), then for the communicator's own calls."""
    for comm in comms:
        device = comm._engine.device
        device.synchronize_stream(device.default_stream, 30)
        comm.synchronize()


class Scene:
    """Each rank's buffers (``registered``: from hoccl.empty) and calls: an all_gather, an
    in-place all_reduce, a reduce_scatter, an all_to_all, a broadcast from the last rank
    and a ring of send/recv (inside ``hoccl.group()``)."""

    def __init__(self, comms, registered):
        self.comms, self.n = comms, len(comms)
        n = self.n
        make = ((lambda comm, count: hoccl.empty(count, "float32", comm)) if registered
                else (lambda comm, count: np.empty(count, np.float32)))
        self.buffers = [{name: make(comm, size) for name, size in (
            ("gather_in", COUNT), ("gather_out", n * COUNT), ("reduce", n * COUNT),
            ("scatter_in", n * COUNT), ("scatter_out", COUNT), ("a2a_in", n * COUNT),
            ("a2a_out", n * COUNT), ("bcast", COUNT), ("send", COUNT), ("recv", COUNT))}
            for comm in comms]

    def load(self, rng):
        """Fresh inputs (small integers: sums exact in any order), outputs poisoned."""
        data = {name: [rng.integers(-50, 50, size).astype(np.float32) for _ in self.comms]
                for name, size in (("gather", COUNT), ("reduce", self.n * COUNT),
                                   ("scatter", self.n * COUNT), ("a2a", self.n * COUNT),
                                   ("bcast", COUNT), ("ring", COUNT))}
        for rank, b in enumerate(self.buffers):
            b["gather_in"][:] = data["gather"][rank]
            b["reduce"][:] = data["reduce"][rank]
            b["scatter_in"][:] = data["scatter"][rank]
            b["a2a_in"][:] = data["a2a"][rank]
            b["bcast"][:] = data["bcast"][rank] if rank == self.n - 1 else np.nan
            b["send"][:] = data["ring"][rank]
            for name in ("gather_out", "scatter_out", "a2a_out", "recv"):
                b[name][:] = np.nan
        return data

    def issue(self, order, grouped=False):
        """Every call on every rank, the ranks in ``order`` for each call (``grouped``: the
        collectives too inside one ``hoccl.group()``), then the ring in a group."""
        last = self.n - 1
        with hoccl.group() if grouped else contextlib.nullcontext():
            self._collectives(order, last)
        with hoccl.group():
            for rank in order:
                comm, b = self.comms[rank], self.buffers[rank]
                comm.send(b["send"], (rank + 1) % self.n)
                comm.recv(b["recv"], (rank - 1) % self.n)

    def _collectives(self, order, last):
        for call in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast"):
            for rank in order:
                comm, b = self.comms[rank], self.buffers[rank]
                if call == "all_gather":
                    comm.all_gather(b["gather_in"], b["gather_out"])
                elif call == "all_reduce":
                    comm.all_reduce(b["reduce"], b["reduce"], "sum")
                elif call == "reduce_scatter":
                    comm.reduce_scatter(b["scatter_in"], b["scatter_out"], "sum")
                elif call == "all_to_all":
                    comm.all_to_all(b["a2a_in"], b["a2a_out"])
                else:
                    comm.broadcast(b["bcast"], b["bcast"], last)

    def check(self, data, what):
        n = self.n
        for rank, b in enumerate(self.buffers):
            where = f"{what}, rank {rank}"
            assert_exact(f"{where} all_gather", np.concatenate(data["gather"]), b["gather_out"])
            assert_exact(f"{where} all_reduce", np.sum(data["reduce"], axis=0), b["reduce"])
            assert_exact(f"{where} reduce_scatter", np.sum(data["scatter"], axis=0)[
                rank * COUNT:(rank + 1) * COUNT], b["scatter_out"])
            assert_exact(f"{where} all_to_all", np.concatenate(
                [theirs[rank * COUNT:(rank + 1) * COUNT] for theirs in data["a2a"]]),
                b["a2a_out"])
            assert_exact(f"{where} broadcast", data["bcast"][n - 1], b["bcast"])
            assert_exact(f"{where} recv", data["ring"][(rank - 1) % n], b["recv"])


@pytest.fixture
def comms():
    made = hoccl.init_local(3, backend="host", timeout=30)
    yield made
    for comm in made:
        comm.close()


@pytest.mark.parametrize("registered,grouped", [(False, False), (True, False), (False, True)])
def test_captured_calls_of_one_process_replay_exactly(comms, registered, grouped):
    rng = np.random.default_rng()
    captured, eager = Scene(comms, registered), Scene(comms, False)
    orders = [[0, 1, 2], [2, 0, 1], [1, 2, 0]]
    for replay in range(12):  # the first is the capture
        data = captured.load(rng)
        with capturing(*comms):
            captured.issue(orders[replay % 3], grouped)
        synchronize(comms)
        captured.check(data, f"replay {replay}")
        if replay % 4 == 1:  # eager calls between replays, on the same communicators
            data = eager.load(rng)
            eager.issue(orders[(replay + 1) % 3], grouped)
            synchronize(comms)
            eager.check(data, f"eager calls after replay {replay}")


def test_capture_ended_before_the_last_rank_is_refused_on_every_rank(comms):
    rng = np.random.default_rng()
    scene = Scene(comms, False)
    scene.load(rng)
    b = scene.buffers
    with capturing(comms[0], comms[1]):
        comms[0].all_gather(b[0]["gather_in"], b[0]["gather_out"])
        comms[1].all_gather(b[1]["gather_in"], b[1]["gather_out"])
    # ranks 0's and 1's captures have ended: the call cannot go into them any more
    with capturing(comms[2]):
        with pytest.raises(hoccl.MismatchError,
                           match=r"all_gather: rank 0's call .* capture ended before every "
                                 r"rank had made the call"):
            comms[2].all_gather(b[2]["gather_in"], b[2]["gather_out"])
    for comm in comms[:2]:
        with pytest.raises(hoccl.MismatchError, match="capture ended"):
            comm.synchronize()
    for rank in range(3):  # refused, not run: the outputs still hold their poison
        assert np.isnan(b[rank]["gather_out"]).all()
    data = scene.load(rng)  # and the communicators go on
    scene.issue([1, 0, 2])
    synchronize(comms)
    scene.check(data, "eager calls after a refused capture")


def test_capture_on_some_ranks_only_raises_on_every_rank(comms):
    rng = np.random.default_rng()
    scene = Scene(comms, True)
    scene.load(rng)
    b = scene.buffers
    with capturing(comms[0]):
        comms[0].all_reduce(b[0]["reduce"], b[0]["reduce"], "sum")
    with pytest.raises(hoccl.MismatchError, match="captured"):
        comms[1].all_reduce(b[1]["reduce"], b[1]["reduce"], "sum")
    with pytest.raises(hoccl.MismatchError, match="refused"):
        comms[2].all_reduce(b[2]["reduce"], b[2]["reduce"], "sum")
    with pytest.raises(hoccl.MismatchError):
        comms[0].synchronize()
    data = scene.load(rng)
    scene.issue([2, 1, 0])
    synchronize(comms)
    scene.check(data, "eager calls after a capture on one rank")


def test_a_group_of_captured_and_eager_calls_is_refused(comms):
    rng = np.random.default_rng()
    scene = Scene(comms, False)
    scene.load(rng)
    b = scene.buffers
    with pytest.raises(hoccl.InvalidArgumentError,
                       match=r"all_reduce: calls of one hoccl.group\(\) are all captured .* "
                             r"this one is eager, the group's first is captured"):
        with hoccl.group():
            with capturing(comms[0]):
                comms[0].all_gather(b[0]["gather_in"], b[0]["gather_out"])
            comms[0].all_reduce(b[0]["reduce"], b[0]["reduce"], "sum")
    for rank in (1, 2):  # the peers' calls are refused too: the sequences stay aligned
        with pytest.raises(hoccl.MismatchError):
            comms[rank].all_gather(b[rank]["gather_in"], b[rank]["gather_out"])
        with pytest.raises(hoccl.MismatchError):
            comms[rank].all_reduce(b[rank]["reduce"], b[rank]["reduce"], "sum")
    with pytest.raises(hoccl.MismatchError, match="abandoned"):  # as for any abandoned group
        comms[0].synchronize()
    assert all(np.isnan(b[rank]["gather_out"]).all() for rank in range(3))
    data = scene.load(rng)
    scene.issue([0, 2, 1])
    synchronize(comms)
    scene.check(data, "eager calls after a refused group")
