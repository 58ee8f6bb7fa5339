"""The seeded differential fuzzer (``hoccl.testing.fuzz``): random calls of every kind,
identical on every rank, checked bit for bit against numpy on poisoned outputs, on 3 and
4 ranks in one process (``init_local``) and under ``mpiexec``.

Each run prints its seed and the command that replays it.  ``HOCCL_FUZZ_SEED=N``
replays a seed (each run adds its rank count to it); ``HOCCL_FUZZ_CALLS=N`` sets the
calls per rank of each run (default 1000: 4000 per rank over the four runs); a long run
on demand: ``HOCCL_FUZZ_CALLS=100000 python -m pytest -q tests/test_fuzz.py``, or
``python -m hoccl.testing.fuzz --ranks 4 --calls 100000 --seed N``.  A fifth as many
calls run across two simulated hosts of two ranks (``HOCCL_LOCAL_SIZE=2``).

Programs hold groups of several collectives beside send/recv rings;
``HOCCL_FUZZ_GROUPED_COLLECTIVES=0`` leaves them out (groups then hold rings only).
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from hoccl.testing import fuzz

from test_mpi import MPI_ENV, _mpiexec

SEED = int(os.environ.get("HOCCL_FUZZ_SEED") or np.random.default_rng().integers(1 << 31))
CALLS = int(os.environ.get("HOCCL_FUZZ_CALLS") or 1000)
SETTINGS = fuzz.Settings(
    grouped_collectives=os.environ.get("HOCCL_FUZZ_GROUPED_COLLECTIVES", "1") != "0")
#: seconds a wait lasts before a run reports a hang as an error
TIMEOUT = 60.0


def _replay(seed, ranks, mpi):
    return (f"replay: {fuzz.replay_command(seed, ranks, CALLS, SETTINGS, mpi)} "
            f"(or HOCCL_FUZZ_SEED={seed - ranks} HOCCL_FUZZ_CALLS={CALLS} pytest "
            f"tests/test_fuzz.py)")


@pytest.mark.parametrize("ranks", [3, 4])
def test_random_calls_in_one_process_equal_numpy(ranks):
    seed = SEED + ranks
    print(f"hoccl fuzz seed {seed}; {_replay(seed, ranks, mpi=False)}")
    report = fuzz.run_local(ranks, seed, CALLS, SETTINGS, timeout=TIMEOUT)
    lines = fuzz.summary(report, f"{ranks} ranks") + [_replay(seed, ranks, mpi=False)]
    print("\n".join(lines))
    assert report.ok, "\n".join(lines)
    assert report.calls >= CALLS and report.outputs > report.calls, "\n".join(lines)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [3, 4])
def test_random_calls_under_mpiexec_equal_numpy(ranks):
    seed = SEED + ranks
    print(f"hoccl fuzz seed {seed}; {_replay(seed, ranks, mpi=True)}")
    command = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "hoccl.testing.fuzz",
               "--calls", str(CALLS), "--seed", str(seed), "--timeout", str(TIMEOUT),
               *" ".join(SETTINGS.flags()).split()]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                            env={**os.environ, **MPI_ENV})
    output = result.stdout + result.stderr
    print(output[-3000:])
    context = f"{output[-4000:]}\n{_replay(seed, ranks, mpi=True)}"
    assert result.returncode == 0, context
    for rank in range(ranks):
        found = re.search(rf"hoccl fuzz rank {rank} of {ranks}: seed {seed}, (\d+) calls per "
                          rf"rank, (\d+) outputs checked, (\d+) wrong, (\d+) errors", output)
        assert found is not None, context
        calls, outputs, wrong, errors = map(int, found.groups())
        assert (wrong, errors) == (0, 0) and calls >= CALLS and outputs > 0, context


@pytest.mark.mpi
def test_random_calls_across_two_hosts_of_two_ranks_equal_numpy():
    """A ``HierarchicalCommunicator`` (``HOCCL_LOCAL_SIZE=2``, ``mpiexec -n 4``): what it
    takes (no groups, rings, splits, registered buffers, streams or scales), reductions
    folded host by host as ``expected(..., local_size=2)`` computes."""
    seed, calls = SEED + 22, max(1, CALLS // 5)
    hierarchical = fuzz.Settings(registered=False, splits=False, rings=False, streams=False,
                                 scales=False, grouped_collectives=False)
    replay = f"HOCCL_LOCAL_SIZE=2 {fuzz.replay_command(seed, 4, calls, hierarchical, True)}"
    print(f"hoccl fuzz seed {seed}; replay: {replay}")
    command = [_mpiexec(), "-n", "4", sys.executable, "-m", "hoccl.testing.fuzz", "--calls",
               str(calls), "--seed", str(seed), "--timeout", str(TIMEOUT), "--hierarchical"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800,
                            env={**os.environ, **MPI_ENV, "HOCCL_LOCAL_SIZE": "2"})
    output = result.stdout + result.stderr
    context = f"{output[-4000:]}\nreplay: {replay}"
    assert result.returncode == 0, context
    for rank in range(4):
        found = re.search(rf"hoccl fuzz rank {rank} of 4: seed {seed}, (\d+) calls per "
                          rf"rank, (\d+) outputs checked, (\d+) wrong, (\d+) errors", output)
        assert found is not None, context
        made, outputs, wrong, errors = map(int, found.groups())
        assert (wrong, errors) == (0, 0) and made >= calls and outputs > 0, context


def test_the_checker_fails_every_output_with_a_flipped_bit():
    """Every non-empty output corrupted before it is compared must count as wrong, and
    the run goes on (a wrong output is not an error)."""
    report = fuzz.run_local(3, SEED, 150, timeout=TIMEOUT, fault="flip")
    assert not report.errors, report.errors
    assert report.outputs - report.empty > 100
    assert report.wrong == report.outputs - report.empty
    assert report.failures and "1 of " in report.failures[0] and "elements wrong" in \
        report.failures[0]


def test_a_program_depends_on_its_seed_alone():
    for ranks in (3, 4):
        assert fuzz.program(SEED, ranks, 300) == fuzz.program(SEED, ranks, 300)
        assert fuzz.program(SEED, ranks, 300) != fuzz.program(SEED + 1, ranks, 300)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ranks", [3, 4])
def test_a_program_of_1000_calls_holds_every_kind_of_call(seed, ranks):
    steps = fuzz.program(seed, ranks, 1000)
    found = fuzz.coverage(steps)
    kinds = (list(fuzz.COLLECTIVES) + ["ring", "barrier"]
             + [f"dtype {dtype}" for dtype in fuzz.Settings().dtypes]
             + [f"op {op}" for op in fuzz.OPS]
             + ["in place", "out of place", "registered", "scale", "grouped", "split",
                "count 0", "count > 16384", "own stream"])
    assert [kind for kind in kinds if not found[kind]] == []
    assert found["grouped collective"] > 20
    roots = {call.root for step in steps for call in step.calls if call.collective == "gather"}
    assert roots == set(range(ranks))
    assert {"bfloat16", "float16", "int8", "uint8", "int32", "int64", "float32",
            "float64"} <= set(fuzz.Settings().dtypes)


def test_groups_mix_collectives_and_rings_unless_switched_off():
    steps = fuzz.program(SEED, 4, 1000)
    mixed = [step for step in steps if step.grouped
             and sum(call.collective != "ring" for call in step.calls) >= 2]
    assert len(mixed) > 10
    assert any(any(call.collective == "ring" for call in step.calls) for step in mixed)
    rings_only = fuzz.program(SEED, 4, 1000, fuzz.Settings(grouped_collectives=False))
    assert fuzz.coverage(rings_only)["grouped collective"] == 0
    assert fuzz.coverage(rings_only)["ring"] > 0
