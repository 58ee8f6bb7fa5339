"""The shared-memory mailboxes (hoccl._mailbox): messages arrive intact and in order under
contention (processes under mpiexec, threads of one process), a full ring refuses and
times out without losing anything, an oversized message is refused, and a dead peer is
seen in seconds."""

import os
import pickle
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hoccl._errors import HocclError, HocclTimeoutError, InvalidArgumentError, PeerDeadError
from hoccl._mailbox import MESSAGE_BYTES, SLOTS, Mailboxes, _Process, _start_time
from test_mpi import MPI_ENV, SURVIVE_KILL, _mpiexec, keep_going_flags

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from mailbox_stress import (CorruptMessage, check_message, exercise,  # noqa: E402
                            make_message)

STRESS = Path(__file__).parent / "mpi" / "mailbox_stress.py"


def _mpi_run(ranks, scenario, *, survive_kill=False):
    mpiexec = _mpiexec()
    command = [mpiexec, *keep_going_flags(mpiexec), "-n", str(ranks),
               *(SURVIVE_KILL if survive_kill else []), sys.executable, str(STRESS), scenario]
    env = {**os.environ, **MPI_ENV}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    return result.stdout + result.stderr


def _one_rank():
    """Mailboxes of a world of one: a rank's ring to itself."""
    return Mailboxes(0, 1, lambda value: [value], lambda: None)


def _pickled_bytes(nbytes):
    """Random bytes whose pickle is ``nbytes`` long (``nbytes`` >= 300)."""
    overhead = len(pickle.dumps(bytes(1024), protocol=pickle.HIGHEST_PROTOCOL)) - 1024
    return os.urandom(nbytes - overhead)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [3, 4])
def test_messages_arrive_intact_and_in_order_between_processes_under_contention(ranks):
    output = _mpi_run(ranks, "contention")
    for rank in range(ranks):
        assert (f"rank {rank}: OK received {2000 * (ranks - 1)} intact messages from "
                f"{ranks - 1} peers in order") in output, output[-4000:]
    assert "FAILED" not in output, output[-4000:]


def test_messages_arrive_intact_and_in_order_between_threads():
    world_size = 3
    barrier = threading.Barrier(world_size, timeout=120)
    gathered = [None] * world_size
    outcomes = {}

    def rank_main(rank):
        def allgather(value):
            gathered[rank] = value
            barrier.wait()
            everyone = list(gathered)
            barrier.wait()  # nobody overwrites ``gathered`` before everyone has read it
            return everyone
        try:
            mailboxes = Mailboxes(rank, world_size, allgather, barrier.wait)
            try:
                outcomes[rank] = exercise(mailboxes, barrier.wait, messages=400,
                                          seed=random.randrange(1 << 30))
            finally:
                mailboxes.close()
        except BaseException as error:
            outcomes[rank] = error
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rank in range(world_size):
        assert isinstance(outcomes[rank], str), outcomes
        assert outcomes[rank].startswith(f"received {400 * (world_size - 1)} intact"), outcomes


def test_the_message_checker_catches_planted_faults():
    message = make_message(1, 2, 7, os.urandom(100))
    check_message(message, 1, 2, 7)
    flipped = bytearray(message)
    flipped[40] ^= 0x10
    faults = [(bytes(flipped), 1, 2, 7), (message[:-1], 1, 2, 7), (message, 1, 2, 8),
              (message, 0, 2, 7), (message, 1, 3, 7)]
    for fault in faults:
        with pytest.raises(CorruptMessage):
            check_message(*fault)


def test_a_message_filling_a_slot_arrives_and_one_byte_more_is_refused_naming_the_sizes():
    mailboxes = _one_rank()
    try:
        largest = _pickled_bytes(MESSAGE_BYTES)
        assert len(pickle.dumps(largest, protocol=pickle.HIGHEST_PROTOCOL)) == MESSAGE_BYTES
        mailboxes.send(0, largest, time.monotonic() + 10, "all_gather")
        assert mailboxes.ready(0)
        assert mailboxes.receive(0) == largest
        with pytest.raises(InvalidArgumentError) as raised:
            mailboxes.send(0, largest + b"x", time.monotonic() + 10, "all_gather")
        text = str(raised.value)
        assert isinstance(raised.value, HocclError)
        assert text.startswith("all_gather:")
        assert f"{MESSAGE_BYTES + 1} bytes" in text and f"at most {MESSAGE_BYTES}" in text
        assert not mailboxes.ready(0)  # the refused message took no slot
    finally:
        mailboxes.close()


def test_a_full_ring_times_out_naming_the_peer_and_loses_nothing():
    mailboxes = _one_rank()
    try:
        messages = [_pickled_bytes(random.randint(300, MESSAGE_BYTES)) for _ in range(SLOTS)]
        for message in messages:
            mailboxes.send(0, message, time.monotonic() + 10, "all_reduce")
        started = time.monotonic()
        with pytest.raises(HocclTimeoutError) as raised:
            mailboxes.send(0, b"one too many", started + 0.2, "all_reduce")
        assert str(raised.value).startswith("all_reduce: rank 0's mailbox to rank 0 stayed full")
        assert time.monotonic() - started >= 0.2
        received = []
        while mailboxes.ready(0):
            received.append(mailboxes.receive(0))
        assert received == messages
        with pytest.raises(HocclError, match="receive: rank 0 has no message from rank 0"):
            mailboxes.receive(0)
        mailboxes.send(0, b"again", time.monotonic() + 10, "all_reduce")
        assert mailboxes.ready(0) and mailboxes.receive(0) == b"again"
    finally:
        mailboxes.close()


def test_closed_mailboxes_refuse_calls_and_close_twice_is_harmless():
    mailboxes = _one_rank()
    mailboxes.close()
    mailboxes.close()
    with pytest.raises(InvalidArgumentError, match="send: rank 0 has no mailbox to rank 0"):
        mailboxes.send(0, b"late", time.monotonic() + 10, "send")
    with pytest.raises(InvalidArgumentError, match="closed"):
        mailboxes.ready(0)


def test_a_process_counts_as_exited_once_a_zombie_reaped_or_its_pid_reused():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    process = _Process("here", child.pid, _start_time(child.pid), None)
    assert process.start is not None and process.alive()
    child.stdin.close()  # it exits, and stays a zombie until waited for
    deadline = time.monotonic() + 30
    while process.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not process.alive()
    assert os.path.exists(f"/proc/{child.pid}")  # not reaped yet: a zombie
    child.wait()
    assert not process.alive()
    me = _Process.this()
    assert me.alive()
    assert not me._replace(start=me.start + 1).alive()  # the pid now names another process


@pytest.mark.parametrize("same_namespace", [True, False])
def test_check_alive_names_an_exited_peer_when_its_pid_means_something_here(same_namespace):
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    start = _start_time(child.pid)
    child.stdin.close()
    child.wait()

    def allgather(value):
        """Rank 0 reports the exited child as its process."""
        name, me = value
        namespace = me.namespace if same_namespace else "pid:[1]"
        return [(name, me._replace(pid=child.pid, start=start, namespace=namespace))]

    mailboxes = Mailboxes(0, 1, allgather, lambda: None)
    try:
        if same_namespace:
            assert not mailboxes.alive(0)
            assert mailboxes.dead([0]) == (f"rank 0, whose process (pid {child.pid} on host "
                                           f"{socket.gethostname()}) has exited")
            with pytest.raises(PeerDeadError) as raised:
                mailboxes.check_alive([0], "broadcast")
            assert str(raised.value) == (
                f"broadcast: rank 0 waited for rank 0, whose process (pid {child.pid} on host "
                f"{socket.gethostname()}) has exited")
        else:  # another pid namespace: the pid cannot be looked up here
            assert mailboxes.alive(0) and mailboxes.dead([0]) is None
            mailboxes.check_alive([0], "broadcast")
    finally:
        mailboxes.close()


@pytest.mark.mpi
def test_a_send_to_a_killed_peer_with_a_full_ring_raises_within_seconds():
    output = _mpi_run(2, "dead", survive_kill=True)
    assert ("rank 0: OK PeerDeadError after" in output
            and "stress: rank 0 waited for rank 1, whose process (pid " in output
            and ") has exited" in output), output[-4000:]
    assert "FAILED" not in output, output[-4000:]


def test_a_spinning_wait_hands_the_gil_to_the_process_s_other_threads(monkeypatch):
    """While it spins (before it sleeps) a wait yields at each poll: a pipelined call's
    other worker, or the threads of a split copy, would else wait for the interpreter's
    switch interval (5 ms) each time they come back from C."""
    import hoccl._mailbox as mailbox
    yields, sleeps, polls = [], [], []
    monkeypatch.setattr(mailbox.os, "sched_yield", lambda: yields.append(1))
    monkeypatch.setattr(mailbox.time, "sleep", sleeps.append)

    def ready():
        polls.append(1)
        return len(polls) > 50
    mailbox.wait_until(ready, time.monotonic() + 60, lambda: "never")
    # each poll that found nothing yielded (spinning) or slept (past the 2 ms of spin)
    assert len(yields) + len(sleeps) == 50 and yields, (len(yields), len(sleeps))
