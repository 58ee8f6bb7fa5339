"""Correct programs of many small calls under mpiexec on the host backend are never
aborted: the direct kernels' cross-call protocol (no rank two calls ahead of any other,
``plan.RING``) and zero-size calls; and calls whose counts differ (0 against 10) are told
apart at once, not after the timeout."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_mpi import MPI_ENV, _mpiexec

PROGRAM = Path(__file__).parent / "mpi" / "run_small_calls.py"
RUNS = 20


def _run(ranks, *args, timeout=120):
    command = [_mpiexec(), "-n", str(ranks), sys.executable, str(PROGRAM), "--backend", "host",
               *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **MPI_ENV})
    return result.returncode, result.stdout + result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [3, 4])
@pytest.mark.parametrize("sequence, calls, kernel_bytes", [
    ("mixed", 250, 4096),   # every kind of direct kernel, a broadcast's root cycling
    ("zero", 150, 4096),    # zero elements on the direct path
    ("zero", 60, 0),        # zero elements with the direct path off
])
def test_sequences_of_small_calls_are_never_aborted(ranks, sequence, calls, kernel_bytes):
    """Every rank makes the same calls, checked call by call (the output poisoned, one
    element past it too); RUNS runs, none may raise or crash."""
    failures = []
    for run in range(RUNS):
        returncode, output = _run(ranks, sequence, "--calls", str(calls),
                                  "--kernel-bytes", str(kernel_bytes))
        oks = output.count(f"OK {calls} {sequence} calls, every output exact")
        if returncode != 0 or oks != ranks:
            failures.append(f"run {run}: exit {returncode}, {oks} ranks OK:\n{output[-1500:]}")
    assert not failures, f"{len(failures)} of {RUNS} runs failed; first:\n{failures[0]}"


COUNTS_DIFFER = r"""
import sys, time
import numpy as np
import hoccl
from hoccl.testing import poison
kernel_bytes, warm = int(sys.argv[1]), sys.argv[2] == "warm"
comm = hoccl.init(backend="host", timeout=10, kernel_bytes=kernel_bytes)
if warm:  # an earlier direct call: the ranks know each other's rings
    first = np.ones(8, np.float32)
    comm.all_reduce(first, first)
    comm.synchronize()
count = 0 if comm.rank == 0 else 10
send, out = np.ones(count, np.float32), poison(count, "float32")
started = time.monotonic()
try:
    comm.all_reduce(send, out)
    comm.synchronize()
    print(f"rank {comm.rank}: no error")
except hoccl.HocclError as error:
    kept = out.view(np.uint32).tolist() == poison(count, "float32").view(np.uint32).tolist()
    print(f"rank {comm.rank}: {type(error).__name__} after {time.monotonic() - started:.2f} s, "
          f"output kept: {kept}: {error}")
comm.close()
"""


@pytest.mark.mpi
def test_a_direct_broadcast_first_then_other_direct_calls():
    """The first direct call is a broadcast, whose root needs no ring: every rank still
    describes its ring, so every rank learns every peer's and the next calls go without a
    message on every rank alike (before, the receivers waited for the root's message
    until the timeout)."""
    returncode, output = _run(3, "mixed", "--calls", "10", "--start", "3", "--timeout", "10")
    assert returncode == 0 and output.count("OK 10 mixed calls") == 3, output[-3000:]


@pytest.mark.mpi
@pytest.mark.parametrize("kernel_bytes, warm, error", [
    (0, "cold", "MismatchError"),        # no direct path: the descriptions disagree
    (4096, "cold", "MismatchError"),     # the first direct call: descriptions exchanged
    (4096, "warm", "DivergedError"),     # later ones go without: the kernels compare
])
def test_a_count_of_zero_against_ten_is_reported_at_once(tmp_path, kernel_bytes, warm, error):
    program = tmp_path / "counts_differ.py"
    program.write_text(COUNTS_DIFFER)
    command = [_mpiexec(), "-n", "3", sys.executable, str(program), str(kernel_bytes), warm]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**os.environ, **MPI_ENV})
    output = result.stdout + result.stderr
    # the ranks' lines may run together in the captured output: find each verdict
    verdicts = re.findall(r"rank (\d): (\w+) after ([\d.]+) s, output kept: (\w+): ([^\n]*?)"
                          r"(?=rank \d: |\n|$)", output)
    assert sorted(rank for rank, *_ in verdicts) == ["0", "1", "2"], output[-3000:]
    for rank, kind, seconds, kept, text in verdicts:
        assert kind == error and float(seconds) < 2.0 and kept == "True", (rank, kind, text)
        assert error == "DivergedError" or ("count=0" in text and "count=10" in text), text
