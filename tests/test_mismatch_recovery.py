"""After a mismatch every rank is in the same state (``tests/mpi/run_mismatch_recovery.py``):
a call refused on one rank (wrong arguments) takes its place in that rank's sequence of
calls and its peers' matching calls end with ``MismatchError``, after which calls whose
data differs from call to call are exact on every rank (no rank's calls shifted against
the others'); a rank whose next call is another call than its peer's (a skipped
registration, an ungrouped cycle) aborts every rank within the timeout.

Before, a refused call took no place: the ranks' calls were matched one off from then on
(silently, where the shapes agreed), or each later call raised ``MismatchError`` on two
ranks while a third timed out, with ``aborted`` False.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_mpi import MPI_ENV, _mpiexec

SCRIPT = Path(__file__).parent / "mpi" / "run_mismatch_recovery.py"
ROOT = str(Path(__file__).resolve().parents[1])
USABLE = ("refused_recv", "refused_coll", "all_refused", "refused_send")


def _run(command):
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": ROOT}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("case", USABLE)
@pytest.mark.parametrize("ranks", [3, 4])
def test_a_refused_call_leaves_every_rank_usable_in_one_process(ranks, case):
    returncode, output = _run([sys.executable, str(SCRIPT), case, "--local", str(ranks),
                               "--timeout", "10"])
    assert returncode == 0 and "FAILED" not in output, output[-4000:]
    assert output.count(f"{case} usable") == ranks, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("case", USABLE + ("refused_group",))
@pytest.mark.parametrize("ranks", [3, 4])
def test_a_refused_call_leaves_every_rank_usable_under_mpiexec(ranks, case):
    returncode, output = _run([_mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT), case,
                               "--timeout", "10"])
    assert returncode == 0 and "FAILED" not in output, output[-4000:]
    assert output.count(f"{case} usable") == ranks, output[-4000:]
    if case != "all_refused":  # the peers' error names the refused call and why
        assert "refused its matching" in output or "abandoned" in output, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("case,ranks", [("skipped_register", 3), ("skipped_register", 4),
                                        ("ungrouped_cycle", 2), ("ungrouped_cycle", 3)])
def test_calls_that_differ_in_kind_abort_every_rank(case, ranks):
    returncode, output = _run([_mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT), case,
                               "--timeout", "4"])
    assert returncode == 0 and "FAILED" not in output, output[-4000:]
    assert output.count(f"{case} aborted in") == ranks, output[-4000:]
    if case == "skipped_register" or ranks == 2:
        assert "DivergedError" in output and "register" in output or "send/recv" in output, \
            output[-4000:]
