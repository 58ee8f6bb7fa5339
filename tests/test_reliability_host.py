"""What happens when things go wrong, on the host backend: stuck work, timeouts, abort,
teardown, interpreter exit, logging.  (Dead peers and mismatches across processes are in
tests/test_mpi.py.)"""

import os
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import weakref

import numpy as np
import pytest

import hoccl
from hoccl.testing import assert_exact, check_collective, is_poison, poison, random_array


def _block_default_stream(comm):
    """Hold the caller's (default) stream of ``comm`` until the returned event is set:
    the host twin of a kernel that never ends."""
    gate = threading.Event()
    comm.device_handle.default_stream.enqueue(lambda: gate.wait(30))
    return gate


def _all_reduce_with_rank_1_held(init_local, timeout):
    """Two host ranks whose all_reduce cannot finish: rank 1's caller stream is held.
    Returns the communicators and the gate that releases rank 1's stream."""
    comms = init_local(2, backend="host", timeout=timeout)
    gate = _block_default_stream(comms[1])
    data = [np.ones(8, np.float32) for _ in range(2)]
    out = [poison(8, "float32") for _ in range(2)]
    for comm in comms:
        comm.all_reduce(data[comm.rank], out[comm.rank])
    return comms, gate


def test_watchdog_aborts_stuck_work_and_names_the_missing_peer(init_local):
    comms, gate = _all_reduce_with_rank_1_held(init_local, timeout=1)
    data = [np.ones(8, np.float32) for _ in range(2)]
    deadline = time.monotonic() + 10
    while not comms[0].aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert comms[0].aborted, "the watchdog did not abort within 10 s"
    reason = comms[0].abort_reason
    assert "all_reduce" in reason and "rank 1" in reason, reason
    with pytest.raises(hoccl.AbortedError, match="all_reduce"):
        comms[0].synchronize()
    with pytest.raises(hoccl.AbortedError):
        comms[1].all_gather(data[1], np.zeros(16, np.float32))
    gate.set()
    # abort released every wait: the lanes and caller streams drain
    for comm in comms:
        comm.device_handle.synchronize_stream(comm.device_handle.default_stream, 5)
        for lane in comm._engine.streams.lanes:
            comm.device_handle.synchronize_stream(lane, 5)
        comm.close()
    # and a new communicator works
    check_collective(init_local(2, backend="host"), "all_reduce", count=9, dtype="int32",
                     seed=1)


def test_synchronize_timeout_says_which_signal_is_missing(init_local):
    comms = init_local(2, backend="host", timeout=0.5)
    comms[0]._health._stop.set()  # keep the watchdog out of it: this is synchronize's own timeout
    comms[1]._health._stop.set()
    gate = _block_default_stream(comms[1])
    send = [np.ones(4, np.float32) for _ in range(2)]
    recv = [poison(8, "float32") for _ in range(2)]
    for comm in comms:
        comm.all_gather(send[comm.rank], recv[comm.rank])
    time.sleep(0.2)
    assert "peers [0]" in comms[1]._health.diagnose("synchronize")  # rank 1 never sent READY,
    # so rank 0 never pushed into it: rank 1 misses rank 0's DONE
    started = time.monotonic()
    with pytest.raises(hoccl.HocclTimeoutError) as info:
        comms[0].synchronize()
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert message.startswith("synchronize: rank 0's all_gather") and "peers [1]" in message
    assert "READY (have 0, need 1)" in message, message
    gate.set()


def test_abort_releases_waits_and_later_calls_raise(init_local):
    comms = init_local(3, backend="host", timeout=60)
    gate = _block_default_stream(comms[2])
    for comm in comms:
        comm.barrier()
    comms[0].abort("test abort")
    assert all(comm.aborted for comm in comms)  # one process: its ranks share the fate
    for comm in comms:
        for lane in comm._engine.streams.lanes:
            comm.device_handle.synchronize_stream(lane, 5)
    with pytest.raises(hoccl.AbortedError, match="test abort"):
        comms[1].barrier()
    comms[0].abort("again")  # idempotent
    gate.set()
    for comm in comms:
        comm.close()
        comm.close()


def test_timeout_comes_from_the_environment(init_local, monkeypatch):
    monkeypatch.setenv("HOCCL_TIMEOUT", "7.5")
    assert init_local(1, backend="host")[0].timeout == 7.5
    with pytest.raises(hoccl.InvalidArgumentError, match="timeout must be a positive"):
        init_local(1, backend="host", timeout=-1)


def test_many_init_close_cycles_leak_no_threads_or_files():
    def census():
        return threading.active_count(), len(os.listdir("/proc/self/fd"))
    rng = np.random.default_rng(2)
    for _ in range(20):  # warm up lazily created state
        comms = hoccl.init_local(2, backend="host")
        for comm in comms:
            comm.close()
    before = census()
    for cycle in range(1000):
        comms = hoccl.init_local(2, backend="host")
        if cycle % 100 == 0:
            data = [random_array(rng, 5, "int64") for _ in range(2)]
            out = [poison(10, "int64") for _ in range(2)]
            for comm in comms:
                comm.all_gather(data[comm.rank], out[comm.rank])
            for comm in comms:
                comm.synchronize()
            assert_exact(f"cycle {cycle}: rank 0", np.concatenate(data), out[0])
        for comm in comms:
            comm.close()
    after = census()
    assert after[0] <= before[0] + 2 and after[1] <= before[1] + 2, (before, after)


def test_many_init_close_cycles_keep_memory_flat():
    """Signal pads are reused once every rank of their group has closed (nobody can write
    into them any more), so a program that makes groups often does not grow: 600
    init_local(3)/close cycles, with a collective every 100, leave every pad given back
    and Python's allocations within 4 MiB of where they began (caches come and go; each
    cycle's three pads, about 36 KB, were once kept for good: 21 MB).
    ``tools/memory_cycles.py`` runs 10,000 of them."""
    from hoccl.backends.host import _PADS

    def cycle(index):
        comms = hoccl.init_local(3, backend="host")
        if index % 100 == 0:
            check_collective(comms, "all_reduce", count=7, dtype="float32", seed=index)
        for comm in comms:
            comm.close()
    for index in range(20):  # warm up lazily created state
        cycle(index)
    kept_before = _PADS.counts()[0]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for index in range(600):
            cycle(index)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 4 << 20, f"{grown} bytes more after 600 cycles"
    assert _PADS.counts()[0] == kept_before  # every pad given back
    # an aborted group's pads are kept: its ranks' pumps may still poison them
    comms = hoccl.init_local(3, backend="host")
    comms[0].abort("test")
    for comm in comms:
        comm.close()
    assert _PADS.counts()[0] == kept_before + 3


def _python(code: str, timeout: float, **env):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env})


def test_interpreter_exit_with_open_communicators_and_stuck_work_does_not_hang():
    started = time.monotonic()
    result = _python("""
        import numpy as np, hoccl
        comms = hoccl.init_local(2, backend="host", timeout=600)
        comms[0].all_reduce(np.ones(4), np.zeros(4))   # rank 1 never calls
        other = hoccl.init_local(2, backend="host")
        for comm in other:
            comm.barrier()
        print("exiting")
        """, 60)
    assert result.returncode == 0, result.stderr
    assert "exiting" in result.stdout and time.monotonic() - started < 30


def test_debug_logging_traces_init_and_each_collective():
    result = _python("""
        import numpy as np, hoccl
        comms = hoccl.init_local(2, backend="host")
        for comm in comms:
            comm.all_gather(np.ones(3), np.zeros(6))
        for comm in comms:
            comm.synchronize()
        """, 60, HOCCL_DEBUG="DEBUG")
    assert result.returncode == 0, result.stderr
    log = result.stderr
    assert "hoccl INFO init_local: 2 ranks, backend host" in log, log
    assert "hoccl DEBUG rank 1 issue all_gather" in log, log


def test_watchdog_does_not_count_the_wait_for_other_ranks_calls(init_local):
    """init_local: rank 0 calls, rank 1 calls much later (longer than the timeout); the
    collective then runs normally, and the watchdog must not abort it."""
    comms = init_local(2, backend="host", timeout=0.5)
    data = [np.full(4, rank + 1.0) for rank in range(2)]
    out = [poison(4, "float64") for _ in range(2)]
    comms[0].barrier()  # starts rank 0's watchdog
    comms[1].barrier()
    comms[0].all_reduce(data[0], out[0])
    time.sleep(1.5)
    comms[1].all_reduce(data[1], out[1])
    for comm in comms:
        comm.synchronize()
    assert not comms[0].aborted
    assert_exact("all_reduce: rank 0", np.full(4, 3.0), out[0])


def test_the_watchdog_keeps_no_buffer_of_a_call_it_looked_at_once_the_call_is_done(
        init_local):
    """The watchdogs look at a call while it waits (rank 1's caller stream held); once it
    is done they keep none of its buffers (a framework's tensors would otherwise live on
    in a daemon thread, to be freed there, perhaps as the interpreter exits)."""
    comms = init_local(2, backend="host", timeout=5)  # a look every 0.25 s
    gate = _block_default_stream(comms[1])
    rng = np.random.default_rng()
    data = [random_array(rng, 8, "float32") for _ in range(2)]
    out = [poison(8, "float32") for _ in range(2)]
    for comm in comms:
        comm.all_reduce(data[comm.rank], out[comm.rank])
    time.sleep(0.6)
    assert all(comm._engine.unfinished() for comm in comms)  # looked at while it waited
    gate.set()
    for comm in comms:
        comm.synchronize()
    for rank in range(2):
        assert_exact(f"all_reduce: rank {rank}", data[0] + data[1], out[rank])
    buffers = [weakref.ref(array) for array in data + out]
    del data, out
    assert [ref() is None for ref in buffers] == [True] * 4


def test_close_waits_for_a_look_of_the_watchdog_still_in_progress(init_local, monkeypatch):
    """A look that goes on when close begins ends before close returns: no thread of a
    closed rank runs on (a daemon thread that frees a call's torch tensor as the
    interpreter exits ends the process: "terminate called without an active
    exception")."""
    from hoccl._health import Health
    look, looking = Health._look, threading.Semaphore(0)

    def look_on_past_the_stop(health):
        looking.release()
        health._stop.wait(10)
        time.sleep(0.3)
        return look(health)
    monkeypatch.setattr(Health, "_look", look_on_past_the_stop)
    comms = init_local(2, backend="host", timeout=5)
    check_collective(comms, "all_reduce", count=9, dtype="float32", seed=2)
    assert looking.acquire(timeout=5) and looking.acquire(timeout=5)  # both in a look
    watchdogs = [comm._health._watchdog for comm in comms]
    for comm in comms:
        comm.close()
    assert [thread.is_alive() for thread in watchdogs] == [False, False]


@pytest.mark.parametrize("gate_opens", [False, True])
def test_close_after_abort_keeps_memory_that_a_held_caller_stream_will_still_touch(
        init_local, monkeypatch, caplog, gate_opens):
    """An aborted call whose caller stream is still held (by the user's own work) reaches
    its fences later: close waits a bounded time for it, and says so when it does not.
    Either way an aborted communicator keeps its devices' memory: the abort's poison
    released its peers' waits, and their lanes may still write into it."""
    monkeypatch.setattr(sys.modules["hoccl.comm"], "_DRAIN_SECONDS", 2.0 if gate_opens else 0.3)
    comms, gate = _all_reduce_with_rank_1_held(init_local, timeout=60)
    comms[0].abort("test abort")
    leaks = []
    for comm in comms:
        original = comm.device_handle.close
        monkeypatch.setattr(comm.device_handle, "close",
                            lambda leak=False, original=original: (leaks.append(leak),
                                                                    original(leak)))
    if gate_opens:
        threading.Timer(0.2, gate.set).start()
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="hoccl"):
        for comm in comms:
            comm.close()
    assert time.monotonic() - started < 5
    assert leaks == [True] * 2
    assert ("keeping this communicator's device memory" in caplog.text) is not gate_opens
    gate.set()


def test_close_completes_calls_the_other_ranks_never_made(init_local, caplog):
    """init_local holds a call until every rank has made it; a rank that closes first
    must not leave its caller's stream waiting for that call for ever."""
    comms = init_local(2, backend="host", timeout=30)
    send = random_array(np.random.default_rng(5), 4, "float32")
    recv = poison(8, "float32")
    comms[0].all_gather(send, recv)  # rank 1 never makes it
    after = threading.Event()
    stream = comms[0].device_handle.default_stream
    stream.enqueue(after.set)  # work the caller enqueued after the call
    with caplog.at_level("WARNING", logger="hoccl"):
        comms[0].close()
    assert after.wait(5), "the caller's stream stayed blocked after close"
    assert "1 call(s) never ran" in caplog.text and "all_gather" in caplog.text
    assert is_poison(recv).all()  # unwritten
    with pytest.raises(hoccl.HocclTimeoutError, match=r"ranks \[0\] have not made"):
        comms[1].all_gather(send, poison(8, "float32"))
        comms[1].synchronize()
    comms[1].close()
