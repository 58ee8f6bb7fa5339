"""Ranks that disagree, on the GPUs in one process (init_local over 2 to 4 visible GPUs):
nothing is written in or around any device buffer, every rank raises
MismatchError, and the communicators work again afterwards (the checks of
``hostile.check_disagreement``, which tests/test_hostile_inputs.py runs on the host
backend)."""

import os
import sys

import numpy as np
import pytest

import hoccl
from hoccl.backends import cuda_device_count

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hostile import check_disagreement, scenarios  # noqa: E402

pytestmark = pytest.mark.gpu
WORLD = max(2, min(4, cuda_device_count()))


@pytest.fixture(scope="module")
def comms():
    if cuda_device_count() < 2:
        pytest.skip("needs 2 GPUs")
    comms = hoccl.init_local(WORLD, backend="cuda", timeout=60)
    yield comms
    for comm in comms:
        comm.close()


@pytest.mark.parametrize("name,collective,change,deviants", scenarios(WORLD),
                         ids=[s[0] for s in scenarios(WORLD)])
def test_disagreeing_ranks_write_nothing_on_the_gpus(comms, name, collective, change, deviants):
    rng = np.random.default_rng(len(name) * 7919 + WORLD)
    check_disagreement(comms, rng, name, collective, change, deviants)


def test_a_grouped_ring_of_send_recv_completes_on_the_gpus(comms):
    import cupy
    n = len(comms)
    data, out = [], []
    for rank, comm in enumerate(comms):
        with cupy.cuda.Device(comm.device):
            data.append(cupy.arange(1 << 16, dtype=cupy.int64) + (rank << 20))
            out.append(cupy.full(1 << 16, -1, dtype=cupy.int64))
    with hoccl.group():
        for rank, comm in enumerate(comms):
            comm.send(data[rank], (rank + 1) % n)
            comm.recv(out[rank], (rank - 1) % n)
    for comm in comms:
        comm.synchronize()
    for rank, comm in enumerate(comms):
        got = cupy.asnumpy(out[rank])
        want = np.arange(1 << 16, dtype=np.int64) + (((rank - 1) % n) << 20)
        assert np.array_equal(got, want), f"rank {rank} received the wrong data"
