"""Replayed repeats (``hoccl._engine.replay``; CUDA graphs' replays are ``test_replay``'s):
exact on fresh data at world 1 and under mpiexec, counted as replayed where they may be,
and taken the full path again after a change of caller stream, options or windows, and
inside ``hoccl.group()``
(``tests/mpi/run_replay.py``)."""

import sys
from pathlib import Path

import pytest

from test_mpi import _mpiexec
from test_repeated_calls import _run

SCRIPT = Path(__file__).parent / "mpi" / "run_replay.py"


def test_replays_at_world_one():
    returncode, output = _run([sys.executable, str(SCRIPT)])
    assert returncode == 0 and "rank 0: replay ok" in output, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_replays_under_mpiexec(ranks):
    returncode, output = _run([_mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT)])
    assert returncode == 0 and output.count("replay ok") == ranks, output[-4000:]
