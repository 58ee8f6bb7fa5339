"""No write lands in memory its owner released: a rank that closes (or raises out of its
``with`` block) and lives on, then exits, while its peers abort on the call it never made;
and the host backend's signal pads, which peers in other processes map and hold
(``hoccl.backends._segments.HeldSegments``) and their owner reuses only once nobody
holds them."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hoccl.backends import host
from hoccl.backends._segments import HeldSegments, held_elsewhere, segment_words
from test_mpi import MPI_ENV, _mpiexec, keep_going_flags

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="memfd segments and cross-memory attach are Linux's")

PROGRAM = Path(__file__).parent / "mpi" / "run_close_then_allocate.py"
RUNS = 20


def _run(ranks, how, *flags):
    mpiexec = _mpiexec()
    command = [mpiexec, *keep_going_flags(mpiexec), "-n", str(ranks), sys.executable,
               str(PROGRAM), how, "--seconds", "1.0", *flags]
    env = {**os.environ, **MPI_ENV, "HOCCL_HOST_CHECK_SIGNALS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    return result.returncode, result.stdout + result.stderr


def _reports(output, ranks):
    """rank -> (verdict, released pad writes) from the program's lines (their prints may
    share a line with another rank's log)."""
    found = {}
    for rank in range(ranks):
        head = f"rank {rank}: "
        for line in output.splitlines():
            at = line.find(head)
            if at >= 0 and "released pad writes " in line[at:]:
                verdict, writes = line[at + len(head):].rsplit("; released pad writes ", 1)
                found[rank] = (verdict, int(writes.split()[0]))
    return found


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["close", "raise"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_that_lets_go_and_lives_on_is_never_written_into(ranks, how):
    """20 runs: every rank reports OK, the job ends with status 0 (a write into the last
    rank's freed heap ended it with "malloc(): unsorted double linked list corrupted"),
    and no word of any pad changed after its owner released it."""
    failures = []
    for run in range(RUNS):
        status, output = _run(ranks, how)
        reports = _reports(output, ranks)
        good = (status == 0 and len(reports) == ranks
                and all(verdict.startswith("OK") and writes == 0
                        for verdict, writes in reports.values())
                and "could not release peer" not in output)
        if not good:
            failures.append(f"run {run}: status {status}: {output[-1500:]}")
    assert not failures, f"{len(failures)} of {RUNS} runs failed:\n" + "\n".join(failures[:3])


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_direct_kernels_of_a_call_the_closed_rank_never_made_write_only_into_held_pads(ranks):
    """The peers' call goes without a message (a direct kernel whose peer's ring is
    known), so its signals may reach the closed rank's pad after its owner let go: they
    land in the peers' own held mappings of it, and the last rank lives on and exits."""
    for run in range(5):
        status, output = _run(ranks, "close", "--kernel-bytes", str(1 << 20))
        reports = _reports(output, ranks)
        assert status == 0 and len(reports) == ranks, f"run {run}: {output[-3000:]}"
        assert all(verdict.startswith("OK") for verdict, _ in reports.values()), output[-3000:]


def _pad_array(address, slots):
    return np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * slots).from_address(address))


def test_a_write_into_a_released_pad_is_counted(monkeypatch):
    """The check itself, on a planted fault: a word written into a pad after its owner
    gave it back is found when the pad is checked, and only then."""
    monkeypatch.setenv("HOCCL_HOST_CHECK_SIGNALS", "1")
    device = host.open_device(max_sms=1, copy_sms=1)
    try:
        before = host.released_pad_writes()
        slots = 97  # a size no other test's pads have
        address = device.alloc_pad(slots)
        _pad_array(address, slots)[5] = 12  # the owner's own use: not counted
        device.free_pad(address)
        assert host.released_pad_writes() == before
        _pad_array(address, slots)[7] = 1 << 62  # a late poison
        assert host.released_pad_writes() == before + 1
        again = device.alloc_pad(slots)  # reused, zeroed
        assert again == address and not _pad_array(again, slots).any()
        device.free_pad(again)
        assert host.released_pad_writes() == before + 1
    finally:
        device.close()


def test_a_pad_held_by_a_peers_mapping_is_reused_only_once_it_is_dropped():
    """This process stands for the peer (it maps its own pad through ``/proc/self``): a
    pad given back while the peer's mapping holds it is not handed out again, the
    peer's late write lands in its mapping, and once the peer drops it the pad is
    reused; the counts of pads go back to where they were."""
    device = host.open_device(max_sms=1, copy_sms=1)
    peer = HeldSegments()
    try:
        slots = 89
        before = host.pad_counts()
        address = device.alloc_pad(slots)
        pad = _pad_array(address, slots)
        words = segment_words(pad)
        mapped = peer.hold(os.getpid(), words, address)
        assert mapped != address and held_elsewhere(pad)
        device.free_pad(address)
        other = device.alloc_pad(slots)
        assert other != address  # still held: not reused
        _pad_array(mapped + 8, 1)[0] = 1 << 62  # the peer's late poison, in its mapping
        peer.drop(os.getpid(), words)
        assert not held_elsewhere(pad) and len(peer) == 0
        device.free_pad(other)
        reused = {device.alloc_pad(slots), device.alloc_pad(slots)}
        assert reused == {address, other}
        for one in reused:
            assert not _pad_array(one, slots).any()
            device.free_pad(one)
        assert host.pad_counts()[0] == before[0]
    finally:
        peer.clear()
        device.close()
