"""Communicators split and closed many times leave nothing behind: signal pads are given
back and reused once no peer holds them, a child's scratch, ring and host words are
freed when it closes, and the peers' pads it mapped are let go.  Counted, not timed:
pads in use and free, the device's live allocations, mapped pads and segments, open
files and threads."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hoccl
from hoccl.backends import host
from test_mpi import MPI_ENV, _mpiexec

PROGRAM = Path(__file__).parent / "mpi" / "run_split_cycles.py"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,cycles", [(2, 10000), (3, 2500)])
def test_split_close_cycles_across_processes_keep_every_count_flat(ranks, cycles):
    command = [_mpiexec(), "-n", str(ranks), sys.executable, str(PROGRAM), "--cycles",
               str(cycles), "--every", "500"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900,
                            env={**os.environ, **MPI_ENV})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for rank in range(ranks):
        found = re.search(rf"rank {rank}: (FLAT|GREW) after {cycles} split/close cycles: counts "
                          rf"before (\{{.*?\}}) after (\{{.*?\}}); (\d+) wrong", output)
        assert found is not None, output[-4000:]
        assert found.group(1) == "FLAT" and found.group(4) == "0", found.group(0)
        # the parent's peers' pads only
        assert f"'held_pads': {ranks - 1}" in found.group(3), found.group(0)


def _census(comm):
    device = comm.device_handle
    return host.pad_counts(), device.allocations, device.held_pads


def test_split_local_close_cycles_keep_pads_and_allocations_flat(init_local):
    """2,000 split_local/close cycles of three host ranks, an exact all_reduce on the
    children every 250: the pads and the parents' devices' allocations are where they were
    after the warm-up."""
    parents = init_local(3, backend="host")

    def cycle(index):
        children = hoccl.split_local(parents, [0, 0, 0])
        if index % 250 == 0:
            rng = np.random.default_rng(index)
            data = [rng.integers(-1000, 1000, 33) for _ in children]
            outs = [np.full(33, -(1 << 62)) for _ in children]
            with hoccl.group():
                for child, send, out in zip(children, data, outs):
                    child.all_reduce(send, out)
            for child in children:
                child.synchronize()
            want = data[0] + data[1] + data[2]
            for out in outs:
                assert np.array_equal(out, want), (index, out, want)
        for child in children:
            child.close()
    for index in range(1, 21):
        cycle(index)
    before = [_census(comm) for comm in parents]
    for index in range(1, 2001):
        cycle(index)
    assert [_census(comm) for comm in parents] == before
