import os
import tempfile

import pytest

import hoccl
from hoccl.backends import cuda_device_count

GPUS = cuda_device_count()

# Tuning tables: init loads one from the user's cache (hoccl.tuning.cache_dir) when it
# names this machine, and a table changes the paths calls take.  The suite and the MPI
# programs it launches look in a cache of their own, so a table tuned on this machine
# never changes what the tests see; a test that wants a table names it.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="hoccl-tests-cache-")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no CUDA GPU visible")
    for item in items:
        if "gpu" in item.keywords and GPUS == 0:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _verify_plans(monkeypatch):
    """Every plan a test runs is verified first (hoccl.sched.verify), and on the host
    backend every signal and completion word is checked never to be lowered as it lands
    (``HOCCL_HOST_CHECK_SIGNALS``; the MPI programs inherit both)."""
    monkeypatch.setenv("HOCCL_VERIFY", os.environ.get("HOCCL_VERIFY", "1"))
    monkeypatch.setenv("HOCCL_HOST_CHECK_SIGNALS",
                       os.environ.get("HOCCL_HOST_CHECK_SIGNALS", "1"))


@pytest.fixture
def init_local():
    """``hoccl.init_local`` for one test: every communicator it returns is closed (again,
    harmlessly, where the test closed it itself) when the test ends, passed or failed."""
    opened = []

    def open_local(*args, **kwargs):
        comms = hoccl.init_local(*args, **kwargs)
        opened.extend(comms)
        return comms
    yield open_local
    for comm in opened:
        comm.close()
