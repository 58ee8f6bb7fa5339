"""Plans replayed from CUDA graphs (``hoccl.sched.replay``) and the executor's binding of
captured calls, without a GPU."""

import pytest

from hoccl.p2p import Executor, compile_program
from hoccl.p2p import _RESET, _SIGNAL, _WAIT
from hoccl.sched import Options, Shape, build_plan, verify
from hoccl.sched.plan import Plan, Signal, Wait
from hoccl.sched.replay import last_waits, replay_problem

CAPTURABLE = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce", "broadcast",
              "reduce", "gather", "scatter")


@pytest.mark.parametrize("collective", CAPTURABLE)
@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_collectives_replay_with_resetting_signals(collective, world_size):
    for in_place in ((False,) if collective == "all_to_all" else (False, True)):
        for options in (Options(), Options(chunk_bytes=1000, copy_lanes=2),
                        Options(one_shot_bytes=1 << 20), Options(pull_bytes=1 << 20)):
            for root in sorted({0, world_size - 1}):
                plan = build_plan(Shape(collective, world_size, 3000, "float32", 4,
                                        in_place=in_place, root=root), options)
                assert replay_problem(plan) is None, (collective, world_size, options)


def test_a_barrier_cannot_replay():
    """A rank's READY for the next barrier may come before the peer's reset of this one."""
    plan = build_plan(Shape("barrier", 2, 0, "float32", 4))
    assert "may signal it again in the next call" in replay_problem(plan)


def _plan(programs):
    return Plan(collective="custom", world_size=2, lanes=2, buffers=((), ()),
                programs=tuple(map(tuple, programs)), max_value=2, participants=(0, 1))


def test_problems_are_named():
    unwaited = [[Signal(0, 1, 0, 1)], []]
    assert "never waited for" in replay_problem(_plan(unwaited))
    short = [[Signal(0, 1, 0, 1), Signal(0, 1, 0, 2)], [Wait(0, 0, 1)]]
    assert "largest value" in replay_problem(_plan(short))
    lanes = [[Signal(0, 1, 0, 1), Signal(0, 1, 0, 2)], [Wait(0, 0, 1), Wait(1, 0, 2)]]
    assert "several lanes" in replay_problem(_plan(lanes))


class _Pad:
    """A pad's tables (``SignalPad.waits``, ``signals``) naming each slot."""
    graph_offset = 100  # past every slot of a 3-rank plan
    waits = [("local", slot) for slot in range(200)]
    signals = [[("remote", peer, slot) for slot in range(200)] for peer in range(3)]


def test_captured_binding_uses_graph_slots_and_resets_after_each_last_wait():
    plan = build_plan(Shape("all_gather", 3, 100, "float32", 4), Options(chunk_bytes=64))
    verify(plan)
    executor = Executor(0, device=None, streams=None, pad=_Pad(), sms=None)
    addresses = {(rank, name): 1 << 20 * (rank + 1) for rank in range(3)
                 for name in ("send", "recv")}
    eager = executor.bind(plan, addresses)
    captured = executor.bind(plan, addresses, captured=True)
    assert not any(kind == _RESET for kind, _, _ in eager)
    waits = [arg for kind, _, arg in eager if kind == _WAIT]
    assert all(address[1] < 100 for address, _ in waits)
    last = last_waits(plan, 0)
    resets = [(index, lane, arg) for index, (kind, lane, arg) in enumerate(captured)
              if kind == _RESET]
    assert sorted(arg[1] - 100 for _, _, arg in resets) == sorted(last)
    for index, lane, arg in resets:
        kind, wait_lane, (address, _) = captured[index - 1]
        assert kind == _WAIT and wait_lane == lane and address == arg  # right after it
    signals = [arg for kind, _, arg in captured if kind == _SIGNAL]
    assert signals and all(address[2] >= 100 for address, _ in signals)
    assert len(captured) == len(compile_program(plan, 0)) + len(last)
