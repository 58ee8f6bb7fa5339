import dataclasses

import pytest

import hoccl
from hoccl.backends import cuda_device_count
from hoccl.sched import Options


@pytest.fixture(scope="session")
def gpu_comms():
    """Every visible GPU (at most 8) as ranks of one process, with the default options."""
    count = min(cuda_device_count(), 8)
    comms = hoccl.init_local(list(range(count)), backend="cuda", timeout=120)
    yield comms
    for comm in comms:
        comm.close()


@pytest.fixture
def gpu_options(gpu_comms):
    """``set_options`` on every communicator of ``gpu_comms`` for one test; the default
    options come back when the test ends, passed or failed, so no test sees another's."""
    def set_options(**changes):
        for comm in gpu_comms:
            comm.set_options(**changes)
    yield set_options
    set_options(**dataclasses.asdict(Options()))
