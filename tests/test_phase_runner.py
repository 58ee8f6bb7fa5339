"""The runner of a hierarchical call's phases (``hoccl._hierarchy.phases.PhaseRunner``):
one worker per level, each step after its chunk's previous one, and on a GPU the
device-side hand-off between them: every step gets ``ready``, the event of the step it
waits for, and ``done``, its own event when a later step waits for it."""

import threading

import pytest

from hoccl import HocclTimeoutError
from hoccl._hierarchy.phases import PhaseRunner


class _Events:
    """A stand-in for the device's events: numbered, and which are dropped."""

    def __init__(self):
        self.made, self.dropped = 0, []

    def make(self):
        self.made += 1
        return f"event {self.made}"

    def drop(self, event):
        self.dropped.append(event)


#: a pipelined all_reduce of three chunks as one rank runs it: (level, chunk, phase)
STEPS = [("host", 0, 0), ("host", 1, 0), ("rail", 0, 1), ("host", 2, 0), ("rail", 1, 1),
         ("host", 0, 2), ("rail", 2, 1), ("host", 1, 2), ("host", 2, 2)]


def _entries(calls, order):
    entries, last = [], {}
    for index, (level, chunk, phase) in enumerate(STEPS):
        def run(ready, done, index=index):
            with order:
                calls[index] = (ready, done)
        entries.append((level, run, last.get(chunk)))
        last[chunk] = index
    return entries


def test_each_step_waits_for_its_chunks_step_before_on_the_device_too():
    events = _Events()
    runner = PhaseRunner(5.0, events.make, events.drop)
    try:
        for call in range(2):  # the pool's events serve the next call again
            calls, order = {}, threading.Lock()
            entries = _entries(calls, order)
            runner.pipelined("all_reduce", entries)
            waited = {after for _, _, after in entries if after is not None}
            handed = {}
            for index, (_, _, after) in enumerate(entries):
                ready, done = calls[index]
                assert (done is not None) == (index in waited), index
                if done is not None:
                    handed[index] = done
                assert ready == (None if after is None else handed[after]), index
            assert len(set(handed.values())) == len(waited) == 6
            assert events.made == 6, "one event per hand-off, made once"
    finally:
        runner.close()
    assert sorted(events.dropped) == sorted(f"event {n}" for n in range(1, 7))


def test_on_the_host_and_in_sequence_no_step_gets_an_event():
    calls, order = {}, threading.Lock()
    for runner, run in ((PhaseRunner(5.0), "pipelined"), (PhaseRunner(5.0, object), "sequential")):
        entries = _entries(calls, order)
        if run == "pipelined":
            runner.pipelined("all_reduce", entries)
        else:
            runner.sequential(entries)
        assert set(calls.values()) == {(None, None)}
        runner.close()


def test_a_failed_step_fails_the_steps_after_it_and_the_call():
    runner = PhaseRunner(5.0)
    ran = []

    def fail(ready, done):
        raise HocclTimeoutError("the rail did not finish")
    entries = [("host", lambda r, d: ran.append(0), None), ("rail", fail, 0),
               ("host", lambda r, d: ran.append(2), 1)]
    with pytest.raises(HocclTimeoutError, match="the rail did not finish"):
        runner.pipelined("all_reduce", entries)
    assert ran == [0]
    runner.close()


def test_a_trace_records_every_step_on_its_level_s_worker_after_the_step_it_waits_for():
    runner = PhaseRunner(5.0)
    try:
        calls, order = {}, threading.Lock()
        entries = _entries(calls, order)
        runner.trace = []
        runner.pipelined("all_reduce", entries)
        trace = {index: rest for index, *rest in runner.trace}
        assert sorted(trace) == list(range(len(STEPS)))
        for index, (level, _, after) in enumerate(entries):
            worker, taken, waited, returned = trace[index]
            assert worker == f"hoccl-{level}-phases"
            assert taken <= waited <= returned
            if after is not None:
                assert waited >= trace[after][3], (index, after)
    finally:
        runner.close()
