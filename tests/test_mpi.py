"""The public API under mpiexec (-n 2 and -n 4) on the host backend: real rendezvous,
descriptor exchange, cross-process copies and signals; the same checks failing on every
planted fault; failures across processes."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hoccl.testing import FAULTS

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce",
               "gather", "scatter", "send_recv")
SCRIPT = Path(__file__).parent / "mpi" / "run_checks.py"


#: Open MPI refuses root and more ranks than cores unless told; MPICH ignores these.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}


def _mpiexec():
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        if os.environ.get("HOCCL_REQUIRE_MPI"):
            pytest.fail("mpiexec not found, and HOCCL_REQUIRE_MPI is set")
        pytest.skip("mpiexec not found")
    return found


def _run_program(ranks, script, *args, env=None):
    """``script`` (in tests/mpi) under mpiexec with ``args``; its exit status and output."""
    command = [_mpiexec(), "-n", str(ranks), sys.executable,
               str(Path(__file__).parent / "mpi" / script), *args]
    env = {**os.environ, **MPI_ENV, "HOCCL_VERIFY": "1", **(env or {})}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    return result.returncode, result.stdout + result.stderr


def _run_checks(ranks, *args, env=None):
    """run_checks.py under mpiexec on the host backend; its exit status and output."""
    command = [_mpiexec(), "-n", str(ranks), sys.executable, str(SCRIPT), "--backend", "host",
               *args]
    env = {**os.environ, **MPI_ENV, "HOCCL_VERIFY": "1", **(env or {})}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_api_under_mpiexec_on_the_host_backend(ranks):
    returncode, output = _run_checks(ranks)
    assert returncode == 0, output[-4000:]
    assert f"mpi ranks={ranks} backend=host:" in output and " 0 failed" in output, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("fault", FAULTS)
def test_every_check_under_mpiexec_fails_on_a_planted_fault(fault):
    """Every output corrupted before it is read: every case of every collective and dtype
    must fail, and none by an error other than the wrong output."""
    returncode, output = _run_checks(2, "--plant-fault", fault, "--counts", "17", "--dtypes",
                                     "float16,bfloat16,float32,float64,int8,uint8,int32,int64")
    assert returncode == 0, output[-4000:]
    label = f"mpi ranks=2 backend=host fault={fault}"
    for collective in COLLECTIVES:
        line = next((line for line in output.splitlines()
                     if line.startswith(f"{label} {collective}: ")), None)
        assert line is not None, output[-4000:]
        passed, failed = (int(part.split()[0]) for part in line.split(": ")[1].split(", "))
        assert passed == 0 and failed >= 8, line
    total = next(line for line in output.splitlines() if line.startswith(f"{label}: "))
    assert total.startswith(f"{label}: 0 passed, ") and "error" not in total, total
    assert ("unwritten (still poison)" in output) == (fault == "unwritten")


FAILURES = Path(__file__).parent / "mpi" / "run_failures.py"


def keep_going_flags(mpiexec: str):
    """Let the other ranks run on when one process dies (to see them raise)."""
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
    if "HYDRA" in version.upper() or "MPICH" in version.upper():
        return ["-disable-auto-cleanup"]
    return ["--mca", "orte_abort_on_non_zero_status", "0"]


# A rank killed by a signal makes mpiexec (MPICH's, even told to keep going) kill the others:
# a rank that is to be killed runs under a shell that outlives it and exits normally.
SURVIVE_KILL = ["sh", "-c", '"$@"; exit 0', "sh"]


@pytest.mark.mpi
@pytest.mark.parametrize("scenario,survivors", [("mismatch", [0, 1]), ("dead", [0]),
                                                ("absent", [0]), ("killed", [0]), ("early", [0]),
                                                ("closed", [0]), ("abort", [0, 1])])
def test_failures_across_processes_raise_instead_of_hanging(scenario, survivors):
    _run_failure(scenario, survivors)


def _run_failure(scenario, survivors, *flags):
    """run_failures.py SCENARIO under mpiexec on the host backend: every survivor reports
    OK and no rank FAILED."""
    mpiexec = _mpiexec()
    command = [mpiexec, *keep_going_flags(mpiexec), "-n", "2",
               *(SURVIVE_KILL if scenario in ("killed", "early") else []), sys.executable,
               str(FAILURES), scenario, "--backend", "host", *flags]
    env = {**os.environ, **MPI_ENV}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    output = result.stdout + result.stderr
    for rank in survivors:
        assert f"rank {rank}: OK" in output, output[-4000:]
    assert "FAILED" not in output, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("scenario,survivors", [("mismatch", [0, 1]), ("dead", [0]),
                                                ("absent", [0]), ("closed", [0]),
                                                ("abort", [0, 1])])
def test_failures_of_direct_kernel_calls_raise_instead_of_hanging(scenario, survivors):
    """The same with every call a direct kernel (``kernel_bytes``): an abort's values in
    the pads' kernel slots release a kernel waiting for a peer that never comes."""
    _run_failure(scenario, survivors, "--kernel-bytes", str(1 << 20))


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_program_that_loses_a_peer_and_ends_exits_promptly_with_an_error_status(how):
    """run_lost_peer_exit.py: rank 1 dies, rank 0 catches PeerDeadError and falls off the
    end of its script with its communicator open.  MPI_Finalize would wait for the dead
    rank for ever (MPICH, then a crash in libmpi when killed): hoccl aborts the MPI job at
    exit, so the job ends within seconds, with a non-zero status."""
    mpiexec = _mpiexec()
    command = [mpiexec, *keep_going_flags(mpiexec), "-n", "2",
               *(SURVIVE_KILL if how == "kill" else []), sys.executable,
               str(Path(__file__).parent / "mpi" / "run_lost_peer_exit.py"), how,
               "--backend", "host"]
    started = time.monotonic()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60,
                                env={**os.environ, **MPI_ENV}, start_new_session=True)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the job did not end within 60 s: {expired.stdout}{expired.stderr}")
    took = time.monotonic() - started
    output = result.stdout + result.stderr
    assert "rank 0: caught PeerDeadError: all_reduce:" in output, output[-4000:]
    assert result.returncode != 0 and took < 30, (result.returncode, took, output[-4000:])
    assert "aborting the MPI job at exit" in output, output[-4000:]


@pytest.mark.mpi
def test_an_abort_ends_a_launch_that_waits_for_chunks():
    """abort with a reduce_scatter of 64 chunks: rank 1's sums are one launch waiting on
    the device for rank 0's copies (``fuse_sums``); rank 0 aborts before copying; the
    abort's value ends the launch, rank 1 raises AbortedError and its lanes drain."""
    _run_failure("abort", [0, 1], "--chunk-bytes", "4096")


HOSTILE = Path(__file__).parent / "mpi" / "run_hostile.py"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_disagreeing_ranks_under_mpiexec_write_nothing_and_all_raise(ranks):
    command = [_mpiexec(), "-n", str(ranks), sys.executable, str(HOSTILE), "--backend", "host"]
    env = {**os.environ, **MPI_ENV}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for rank in range(ranks):
        assert f"rank {rank}: hostile {ranks} ranks:" in output and " 0 failed" in output, \
            output[-4000:]


SPLIT = Path(__file__).parent / "mpi" / "run_split.py"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [3, 4])
def test_split_children_under_mpiexec_run_collectives_beside_their_parent(ranks):
    """Even/odd and NOCOLOR splits, key order, interleaved parent and child calls,
    overridden settings, closing in either order, a bad color on one rank raising on all,
    a rank calling all_reduce beside the others' split (every rank raises), and a world
    across (simulated) hosts refusing to split."""
    returncode, output = _run_program(ranks, SPLIT.name, "--backend", "host")
    assert returncode == 0, output[-4000:]
    assert f"split ranks={ranks} backend=host: 8 passed, 0 failed" in output, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,fuse", [(2, True), (3, True), (2, False)])
def test_reductions_of_many_chunks_across_processes(ranks, fuse):
    """run_checks.py with 64-byte chunks: a reduction's sums wait for dozens of chunks'
    copies from the peers' processes, as one launch per rank (``fuse_sums``, whose waits
    the launch keeps) or a stream wait and a launch per chunk; every stream sleeps up to
    2 ms before each item (``HOCCL_HOST_JITTER``) and between a launch's chunks, so
    copies land late and in many orders; exact against numpy."""
    returncode, output = _run_checks(ranks, "--chunk-bytes", "64", "--counts", "0,17,1000",
                                     "--dtypes", "float32,bfloat16,int32",
                                     "--fuse-sums", "on" if fuse else "off",
                                     env={"HOCCL_HOST_JITTER": "0.002",
                                          "HOCCL_HOST_CHECK_SIGNALS": "1"})
    assert returncode == 0, output[-4000:]
    assert output.rstrip().endswith(" 0 failed"), output[-4000:]
    found = re.search(r"fuse_sums=(\w+): (\d+) or more one-launch", output)
    assert found and found.group(1) == str(fuse), output[-4000:]
    assert (int(found.group(2)) > 0) == fuse, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_pulled_reductions_across_processes(ranks):
    """run_checks.py with ``pull_bytes``: every reduction at the tested sizes reads the
    peers' inputs in their processes (no scratch), exact against numpy."""
    returncode, output = _run_checks(ranks, "--pull-bytes", str(1 << 20), "--dtypes",
                                     "float32,bfloat16")
    assert returncode == 0, output[-4000:]
    assert f"mpi ranks={ranks} backend=host pull_bytes=1048576:" in output, output[-4000:]
    assert output.rstrip().endswith(" 0 failed"), output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_every_collective_on_registered_buffers(ranks):
    """run_checks.py with every buffer carved from a registered array at the same offsets
    on every rank: the symmetric collectives go without a descriptor exchange (counted),
    the rooted ones exchange window references; all exact against numpy."""
    returncode, output = _run_checks(ranks, "--registered")
    assert returncode == 0, output[-4000:]
    line = next((line for line in output.splitlines()
                 if line.startswith(f"mpi ranks={ranks} backend=host registered (")), None)
    assert line is not None and line.endswith(" 0 failed"), output[-4000:]
    fast = int(line.split("registered (")[1].split()[0])
    assert fast >= 100, line


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_every_collective_on_shared_host_memory(ranks):
    """run_checks.py with every array from ``hoccl.host_empty``: the peers map each other's
    arrays (counted) and move them with loads and stores; all exact against numpy, a
    reallocated buffer included (a new segment, never a stale mapping)."""
    returncode, output = _run_checks(ranks, "--shared-memory", "--counts", "0,1,17,1000,70000")
    assert returncode == 0, output[-4000:]
    line = next((line for line in output.splitlines()
                 if line.startswith(f"mpi ranks={ranks} backend=host shared memory (")), None)
    assert line is not None and line.endswith(" 0 failed"), output[-4000:]
    assert int(line.split("memory (")[1].split()[0]) >= 1, line


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_registered_buffers_divergence_and_registration(ranks):
    """Mixed registered/unregistered calls exact; a diverging registered call (count,
    offset, beyond a peer's window, an unregistered buffer on one rank) raises
    DivergedError on every rank with the guard bytes around every window untouched;
    registration mistakes raise on every rank; deregistered memory is exchanged again; a
    rank late to every call (its peers' digests come first) synchronizes; a group every
    rank abandons runs on none, one that one rank abandons raises DivergedError at once."""
    returncode, output = _run_program(ranks, "run_registered.py", "--backend", "host")
    assert returncode == 0, output[-4000:]
    assert f"registered ranks={ranks}: 10 passed, 0 failed" in output, output[-4000:]


@pytest.mark.mpi
def test_callers_are_fenced_only_after_the_peers_buffers_are_mapped():
    returncode, output = _run_program(2, "run_fence_order.py")
    assert returncode == 0 and "fence order: ok (2 ranks)" in output, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_captured_calls_replay_with_resetting_signals(ranks):
    """run_capture.py on the host backend: calls issued as captured ones (graph slots that
    reset after their last wait, no signal base, lanes of their own) and issued again as
    replays, 100 times, every output checked, eager calls between; one rank capturing
    while the others call eagerly raises on every rank."""
    returncode, output = _run_program(ranks, "run_capture.py", "--backend", "host",
                                      "--replays", "100")
    assert returncode == 0 and "capture: 2 passed, 0 failed" in output, output[-4000:]


@pytest.mark.mpi
def test_captured_calls_of_a_world_of_one_replay():
    """run_capture.py with one rank: its out-of-place calls are direct kernels, its
    in-place ones the completion alone, captured and replayed 50 times, every output
    checked, eager calls between (no ring and no diverging rank: there is no peer)."""
    returncode, output = _run_program(1, "run_capture.py", "--backend", "host",
                                      "--replays", "50")
    assert returncode == 0 and "capture: 1 passed, 0 failed" in output, output[-4000:]
    assert "ok     replays: 50 replays of 3 graphs" in output, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_direct_kernels_across_processes(ranks):
    """run_checks.py with ``kernel_bytes``: every collective that has a direct kernel runs
    as one (the host backend runs its protocol: per-block slots, epoch, shares, ring
    halves), the rest as ever, exact against numpy; the direct calls go without a
    descriptor exchange once the rings are known, on unregistered buffers too."""
    returncode, output = _run_checks(ranks, "--kernel-bytes", str(1 << 20))
    assert returncode == 0, output[-4000:]
    line = next((line for line in output.splitlines()
                 if line.startswith(f"mpi ranks={ranks} backend=host kernel_bytes=1048576 (")),
                None)
    assert line is not None and line.endswith(" 0 failed"), output[-4000:]
    # the peers touch only the rings, learned once: unregistered calls go without asking
    assert int(line.split("kernel_bytes=1048576 (")[1].split()[0]) >= 100, line
    returncode, output = _run_checks(ranks, "--kernel-bytes", str(1 << 20), "--registered",
                                     "--counts", "0,17,1000")
    assert returncode == 0 and output.rstrip().endswith(" 0 failed"), output[-4000:]


@pytest.mark.mpi
def test_every_collective_with_the_host_streams_jittered():
    """run_checks.py on registered buffers, small calls as direct kernels (on the callers'
    streams), the rest on the lanes or on one lane on the caller's stream, every host
    stream sleeping up to 3 ms before each item (``HOCCL_HOST_JITTER``): the streams
    interleave in orders a loaded machine rarely shows; every signal and completion
    word is checked never to go down, every output exact."""
    returncode, output = _run_checks(2, "--kernel-bytes", str(64 << 10), "--registered",
                                     "--counts", "0,17,1000,40000",
                                     env={"HOCCL_HOST_JITTER": "0.003"})
    assert returncode == 0 and output.rstrip().endswith(" 0 failed"), output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, jitter", [(2, 0), (3, 0), (2, 0.1)])
def test_calls_on_callers_streams_keep_call_order(ranks, jitter):
    """run_on_caller.py: direct kernels and one-lane copy-engine calls on two caller
    streams of each rank, between calls on the lanes, one stream held back at times:
    outputs exact, the completion word sampled throughout never goes down.  ``jitter``
    (``HOCCL_HOST_JITTER``): every host stream sleeps up to that long before each item,
    so the streams interleave in orders a machine rarely shows (a lane stalled between
    its two completion writes while a call on another stream ran whole: the host's word
    written in the wrong order went down, and the host waited for ever)."""
    returncode, output = _run_program(ranks, "run_on_caller.py",
                                      env={"HOCCL_HOST_JITTER": str(jitter)})
    assert returncode == 0 and "on caller: " in output and " 0 failed" in output, \
        output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_repeated_calls_on_registered_buffers_go_the_short_path_and_stay_exact(ranks):
    """run_repeats.py: the same copy-engine calls on the same registered buffers, round
    after round with fresh values and poisoned outputs: exact, and repeats from the third
    round on; after the scratch is replaced the next call is planned afresh."""
    returncode, output = _run_program(ranks, "run_repeats.py", "--backend", "host")
    assert returncode == 0 and f"repeats ranks={ranks}: " in output \
        and " 0 failed" in output, output[-4000:]


#: a program of run_late_calls.py that timed out (a rank late to its calls waited in
#: synchronize for a digest that had come) in two of three runs before that was fixed
LATE_SEED = 12


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [3, 4])
@pytest.mark.parametrize("seed", [LATE_SEED, int(np.random.default_rng().integers(1 << 20))])
def test_repeated_calls_with_ranks_late_to_them_stay_exact(ranks, seed):
    """run_late_calls.py: calls repeated on registered and plain buffers, alone and in
    groups, with one rank at a time late to every call, synchronize and MPI barriers
    between: every output exact against numpy, no wait left for a message already come."""
    returncode, output = _run_program(ranks, "run_late_calls.py", "--seed", str(seed))
    assert returncode == 0 and f"late calls ranks={ranks} seed={seed}: " in output \
        and " 0 failed" in output, f"seed {seed}:\n{output[-4000:]}"


@pytest.mark.mpi
@pytest.mark.parametrize("scenario", ["silent", "count", "blocks", "collective", "late",
                                      "repeat"])
def test_direct_kernel_calls_go_without_messages_and_their_kernels_compare(scenario):
    """run_direct_divergence.py: once the peers' rings are known, direct calls of every
    kind send no message and are exact; ranks whose calls then differ (in count, in block
    count, in collective) are told by their kernels, and both raise DivergedError at
    once with their outputs unwritten, instead of waiting for a timeout; a rank whose
    wait the other's abort released first (``late``) learns the divergence from it."""
    returncode, output = _run_program(2, "run_direct_divergence.py", scenario, "--backend",
                                      "host")
    # the two processes' lines may run together in the captured output: count verdicts
    passed = {rank for rank in (0, 1) if f"rank {rank}: OK " in output}
    assert returncode == 0 and passed == {0, 1} and ": FAILED" not in output, output[-4000:]


@pytest.mark.mpi
def test_captured_direct_kernels_replay():
    """run_capture.py with ``kernel_bytes``: captured direct kernels replayed, eager
    calls between (one epoch for both), a capture on one rank raising everywhere."""
    returncode, output = _run_program(2, "run_capture.py", "--backend", "host",
                                      "--replays", "50", "--kernel-bytes", str(1 << 20))
    assert returncode == 0 and "capture: 2 passed, 0 failed" in output, output[-4000:]


@pytest.mark.mpi
def test_captured_pulled_reductions_replay():
    """The same with ``pull_bytes``: captured reductions that read the peers' inputs."""
    returncode, output = _run_program(2, "run_capture.py", "--backend", "host",
                                      "--replays", "50", "--pull-bytes", str(1 << 20))
    assert returncode == 0 and "capture: 2 passed, 0 failed" in output, output[-4000:]
