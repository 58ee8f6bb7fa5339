"""Streams that share hardware queues: a GPU runs its streams' work through a few in-order
queues (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default), so a stream's wait holds the later
work of every stream that shares its queue.  ``HOCCL_HOST_QUEUES`` makes the host
backend's streams share workers in the same way.

On one H200 with three ranks sharing it, the fuzzer's seed 11 hung at a group of a scatter
of no element, a registered all_reduce and a ring on a stream of the rank's own, and an
all_to_all: the callers' waits for the group's completion were enqueued before the lanes'
steps, which then sat behind them on a shared queue.  The callers now wait after the lanes'
steps are enqueued (``Executor._enqueue``, ``group_end``)."""

import os
import subprocess
import sys
import threading

import pytest

from hoccl.backends.host import HostDevice
from hoccl.testing.fuzz import Settings, run_local
from test_mpi import MPI_ENV, _mpiexec


def test_streams_sharing_a_queue_wait_for_each_other(monkeypatch):
    """The emulation itself: with one queue, a stream's wait holds another stream's later
    work; with a worker each, it does not."""
    for queues, held in (("1", True), ("0", False)):
        monkeypatch.setenv("HOCCL_HOST_QUEUES", queues)
        device = HostDevice(max_sms=1, copy_sms=1)
        try:
            first, second = device.create_stream(), device.create_stream()
            gate = threading.Event()
            ran = threading.Event()
            first.enqueue(lambda: gate.wait(5))
            second.enqueue(ran.set)
            assert ran.wait(0.3) is not held, queues
            gate.set()
            second.synchronize(5)
            assert ran.is_set()
        finally:
            device.close()


def test_a_group_of_many_lanes_on_shared_queues_in_one_process():
    """Seed 11's group (with a call on a stream of each rank's own) on ``init_local(3)``
    with 8 shared queues a rank: no hang, every output exact."""
    os.environ["HOCCL_HOST_QUEUES"] = "8"
    try:
        report = run_local(3, 11, 20, Settings(), timeout=10.0)
    finally:
        del os.environ["HOCCL_HOST_QUEUES"]
    assert report.ok, (report.errors, report.failures)
    assert report.calls >= 20


@pytest.mark.mpi
def test_a_group_of_many_lanes_on_shared_queues_under_mpiexec():
    """The same under mpiexec (three processes), as the ranks sharing one GPU ran it."""
    command = [_mpiexec(), "-n", "3", sys.executable, "-m", "hoccl.testing.fuzz", "--calls",
               "20", "--seed", "11", "--timeout", "10"]
    env = {**os.environ, **MPI_ENV, "HOCCL_HOST_QUEUES": "8"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert output.count("0 wrong, 0 errors") == 3, output[-4000:]
