import pytest

import hoccl
from hoccl.backends import cuda_device_count


@pytest.fixture(scope="session")
def gpu_comms():
    """Every visible GPU (at most 8) as ranks of one process."""
    count = min(cuda_device_count(), 8)
    comms = hoccl.init_local(list(range(count)), backend="cuda", timeout=120)
    yield comms
    for comm in comms:
        comm.close()
