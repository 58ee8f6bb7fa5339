"""Stuck GPU work, the watchdog, abort and teardown on real GPUs (init_local)."""

import time

import numpy as np
import pytest

import hoccl
from hoccl.testing import ArrayModule, check_collective, poison

pytestmark = pytest.mark.gpu

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def _held_stream(device, seconds):
    """A cupy stream of ``device`` held by a one-thread kernel for ``seconds``."""
    import cupy
    with cupy.cuda.Device(device):
        kernel = cupy.RawKernel(SPIN, "spin")
        stream = cupy.cuda.Stream(non_blocking=True)
        rate = cupy.cuda.runtime.getDeviceProperties(device)["clockRate"]
        kernel((1,), (1,), (np.int64(seconds * rate * 1000),), stream=stream)
        return stream


def test_watchdog_aborts_stuck_work_and_the_streams_drain(init_local):
    import cupy
    count = cupy.cuda.runtime.getDeviceCount()
    comms = init_local(list(range(min(count, 2))), backend="cuda", timeout=2)
    if len(comms) < 2:
        pytest.skip("needs two GPUs")
    arrays = ArrayModule("cupy")
    held = _held_stream(1, seconds=8)
    free = []
    with cupy.cuda.Device(0):
        free.append(cupy.cuda.Stream(non_blocking=True))
    data = [arrays.asarray(np.ones(1 << 20, np.float32), c.device) for c in comms]
    out = [arrays.asarray(poison(1 << 20, "float32"), c.device) for c in comms]
    comms[0].all_reduce(data[0], out[0], stream=free[0])
    comms[1].all_reduce(data[1], out[1], stream=held)
    started = time.monotonic()
    while not comms[0].aborted and time.monotonic() - started < 10:
        time.sleep(0.05)
    assert comms[0].aborted, "the watchdog did not abort within 10 s"
    assert "rank 1" in comms[0].abort_reason, comms[0].abort_reason
    with cupy.cuda.Device(0):
        done = cupy.cuda.Event()
        done.record(free[0])
    deadline = time.monotonic() + 3
    while not done.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done.done, "rank 0's stream stayed blocked after the abort"
    with pytest.raises(hoccl.AbortedError):
        comms[0].synchronize()
    for comm in comms:
        comm.close()
    check_collective(init_local([0, 1], backend="cuda"), "all_gather", count=1001,
                     dtype="float32", seed=3)


@pytest.mark.timeout(600)
def test_a_thousand_init_close_cycles_leak_no_device_memory_or_files():
    import os
    import cupy
    gpus = list(range(min(cupy.cuda.runtime.getDeviceCount(), 2)))
    comms = hoccl.init_local(gpus, backend="cuda")
    try:
        check_collective(comms, "all_reduce", count=1 << 16, dtype="float32", seed=1)
    finally:
        for comm in comms:
            comm.close()
    with cupy.cuda.Device(0):
        before = cupy.cuda.runtime.memGetInfo()[0]
    files = len(os.listdir("/proc/self/fd"))
    for cycle in range(1000):
        comms = hoccl.init_local(gpus, backend="cuda")
        try:
            if cycle % 100 == 0:  # and they still work
                check_collective(comms, "all_reduce", count=1 << 16, dtype="float32",
                                 seed=cycle)
        finally:
            for comm in comms:
                comm.close()
    with cupy.cuda.Device(0):
        after = cupy.cuda.runtime.memGetInfo()[0]
    assert before - after < 64 << 20, f"device memory fell by {(before - after) >> 20} MiB"
    assert len(os.listdir("/proc/self/fd")) <= files + 2, (files, os.listdir("/proc/self/fd"))
