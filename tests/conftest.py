import os

import pytest

from hoccl.backends import cuda_device_count

GPUS = cuda_device_count()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no CUDA GPU visible")
    for item in items:
        if "gpu" in item.keywords and GPUS == 0:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _verify_plans(monkeypatch):
    """Every plan a test runs is verified first (hoccl.sched.verify)."""
    monkeypatch.setenv("HOCCL_VERIFY", os.environ.get("HOCCL_VERIFY", "1"))
