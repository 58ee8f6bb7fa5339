"""Registered buffers in one process (init_local) and the window table, on the host
backend: registration is recorded and calls stay exact (ranks of one process pass
buffers by address, so nothing changes for them); bad registrations raise."""

import numpy as np
import pytest

import hoccl
from hoccl._windows import Windows
from hoccl.testing import assert_exact, poison, random_array


def test_window_table_finds_only_whole_ranges():
    windows = Windows()
    first = windows.add(1000, 100, None, None, None)
    second = windows.add(5000, 50, None, None, None)
    assert windows.find(1000, 100) == (first, 0)
    assert windows.find(1050, 10) == (first, 50)
    assert windows.find(1050, 51) is None           # runs past the end
    assert windows.find(999, 1) is None
    assert windows.find(5049, 1) == (second, 49)
    assert windows.overlapping(1099, 10) is first
    assert windows.overlapping(1100, 3900) is None  # touches neither
    assert windows.overlapping(900, 101) is first
    windows.remove(first)
    assert windows.find(1000, 1) is None and len(windows) == 1
    assert windows.add(1000, 10, None, None, None).index == 2  # indices never reused


def test_init_local_registered_all_gather_is_exact():
    comms = hoccl.init_local(2, backend="host")
    try:
        slabs = [hoccl.empty(64, "float32", comm) for comm in comms]
        assert [len(comm.windows) for comm in comms] == [1, 1]
        rng = np.random.default_rng(5)
        data = [random_array(rng, 16, "float32") for _ in comms]
        for comm, slab in zip(comms, slabs):
            slab[:] = poison(64, "float32")
            slab[comm.rank * 16:(comm.rank + 1) * 16] = data[comm.rank]
        for comm, slab in zip(comms, slabs):
            comm.all_gather(slab[comm.rank * 16:(comm.rank + 1) * 16], slab[:32])
        for comm in comms:
            comm.synchronize()
        for slab in slabs:
            assert_exact("init_local registered all_gather", np.concatenate(data), slab[:32])
        for comm, slab in zip(comms, slabs):
            comm.deregister(slab)
            assert comm.windows == []
    finally:
        for comm in comms:
            comm.close()


def test_bad_registrations_raise_naming_the_call():
    (comm,) = hoccl.init_local(1, backend="host")
    try:
        slab = hoccl.empty(32, "float32", comm)
        with pytest.raises(hoccl.InvalidArgumentError, match="register: .*overlaps"):
            comm.register(slab[4:8])
        with pytest.raises(hoccl.InvalidArgumentError, match="register: .*empty"):
            comm.register(np.empty(0, np.float32))
        with pytest.raises(hoccl.InvalidArgumentError, match="deregister: .*not a window"):
            comm.deregister(np.empty(4, np.float32))
        with pytest.raises(hoccl.InvalidArgumentError, match="empty: expected a dtype"):
            hoccl.empty(4, "complex64", comm)
        with pytest.raises(hoccl.InvalidArgumentError, match="register: not inside"):
            with hoccl.group():
                comm.register(np.empty(4, np.float32))
        comm.deregister(slab)
        comm.register(slab[4:8])  # the range is free again
    finally:
        comm.close()
