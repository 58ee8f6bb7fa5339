"""The examples stay runnable: the main job on the host backend, and the torch sharded
training loop where torch is installed."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_main_job_checks_every_collective_on_four_host_ranks():
    result = _run(EXAMPLES / "run_all.py", "--backend", "host", "--ranks", "4")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    passed, failed = (int(part.split()[0]) for part in last.split(", "))
    assert failed == 0 and passed >= 100, last


def test_the_notebook_walkthrough_runs_without_a_gpu_on_the_host_backend():
    """The README sends users without a GPU to this walkthrough: every cell runs (each
    checks its result), on GPUs where two are visible, else on the host backend."""
    from hoccl.backends import cuda_device_count
    result = _run(EXAMPLES / "jupyter_quickstart.py", timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    where = "2 GPUs" if cuda_device_count() >= 2 else "the host backend"
    assert lines[-1] == f"walkthrough finished on {where}", lines[-5:]
    assert any(line.startswith("HocclTimeoutError: synchronize: rank 0's all_reduce")
               and "ranks [1] have not made the matching call" in line for line in lines)
    assert "rank 1 received [0 1 2 3 4 5 6 7]" in lines


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_sharded_training_matches_one_device():
    result = _run(EXAMPLES / "torch_fsdp_style.py", "--backend", "host")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "losses match the single-device run" in result.stdout


@pytest.mark.parametrize("program", ["-m hoccl.bench", "-m hoccl.bench.overlap",
                                     "-m hoccl.bench.tp", "benchmarks/levers.py"])
def test_benchmarks_say_in_one_line_what_they_miss(program):
    """Without a GPU or the bench extra a benchmark exits with one line naming what is
    missing and how to install it, not a traceback."""
    root = EXAMPLES.parent
    result = subprocess.run([sys.executable, *program.split()], capture_output=True, text=True,
                            timeout=120, cwd=root)
    from hoccl.backends import cuda_device_count
    if cuda_device_count():
        pytest.skip("GPUs are visible: the benchmark would run")
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"python {program}: needs") and "pip install" in lines[0]


def test_the_old_name_of_the_lever_study_still_runs_it_with_a_deprecation_warning():
    result = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-m",
                             "hoccl.bench.levers"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "benchmarks/levers.py" in result.stderr, result.stderr
    assert "DeprecationWarning" in result.stderr
    result = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-m",
                             "hoccl.bench.levers", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "python benchmarks/levers.py" in result.stdout, \
        result.stderr


@pytest.mark.mpi
def test_registered_buffers_example_runs_under_mpiexec_on_the_host_backend():
    import os
    sys.path.insert(0, str(Path(__file__).parent))
    from test_mpi import MPI_ENV, _mpiexec
    command = [_mpiexec(), "-n", "2", sys.executable, str(EXAMPLES / "registered_and_graphs.py"),
               "--backend", "host"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, **MPI_ENV})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "eager: 20 steps checked; 39 of 40 calls went without a descriptor exchange" \
        in output, output[-3000:]
