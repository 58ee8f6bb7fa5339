"""``verify`` accepts correct plans and rejects broken ones.

Correct plans from ``build_plan`` are mutated the ways a scheduler bug would break
them (a lost signal, a missing fence, a misplaced or duplicated copy, a dropped
lane-to-lane dependency, ...).  Every target of each mutation in a plan is tried,
and each mutant must raise ``PlanError``; the unmutated plan must verify.  Small
hand-made plans pin down the model's rules one at a time, and randomly edited plans
check the other direction: whatever ``verify`` accepts, ``simulate`` runs to the
reference result in every interleaving tried.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hoccl._errors import PlanError
from hoccl.sched import (COLLECTIVES, After, BufferSpec, BufRef, Copy, Mark, Options, Plan,
                         Reduce, Shape, Signal, Wait, build_plan, simulate, verify)
from hoccl.sched.plan import CHANNELS, DONE, GATHERED, PAIR_DONE, PAIR_READY, READY, RING
from test_sched_plans import IN_PLACE_FORMS, REDUCING, ROOTED, Case, reference


def _with_program(plan: Plan, rank: int, program) -> Plan:
    programs = list(plan.programs)
    programs[rank] = tuple(program)
    return replace(plan, programs=tuple(programs))


def _steps(plan: Plan, kind) -> Iterator[Tuple[int, int, object]]:
    for rank, program in enumerate(plan.programs):
        for index, step in enumerate(program):
            if isinstance(step, kind):
                yield rank, index, step


def _without(plan: Plan, rank: int, index: int) -> Plan:
    program = list(plan.programs[rank])
    del program[index]
    return _with_program(plan, rank, program)


def _replacing(plan: Plan, rank: int, index: int, step) -> Plan:
    program = list(plan.programs[rank])
    program[index] = step
    return _with_program(plan, rank, program)


def _inserting(plan: Plan, rank: int, index: int, step) -> Plan:
    program = list(plan.programs[rank])
    program.insert(index, step)
    return _with_program(plan, rank, program)


def _signalled(plan: Plan, receiver: int, slot: int) -> List[int]:
    return [s.value for _, _, s in _steps(plan, Signal) if (s.peer, s.slot) == (receiver, slot)]


def _lane_predecessor(program, index: int):
    for earlier in range(index - 1, -1, -1):
        if program[earlier].lane == program[index].lane:
            return earlier
    return None


# -- mutations: each yields every mutant of the plan it can make ------------------------
def drop_awaited_signal(plan: Plan) -> Iterator[Plan]:
    """A Signal some Wait needs (no other signal into its slot reaches that value)."""
    for rank, index, signal in _steps(plan, Signal):
        others = [v for v in _signalled(plan, signal.peer, signal.slot) if v != signal.value]
        if any(w.slot == signal.slot and w.value > max(others, default=0)
               for w in plan.programs[signal.peer] if isinstance(w, Wait)):
            yield _without(plan, rank, index)


def drop_ready_wait_before_push(plan: Plan) -> Iterator[Plan]:
    """The READY wait ahead of a copy into (or out of) that peer's buffer (the lane's
    first wait for that peer: a repeated one is redundant and harmless to drop)."""
    for rank, index, wait in _steps(plan, Wait):
        if wait.slot % CHANNELS not in (READY, PAIR_READY):
            continue
        peer = wait.slot // CHANNELS
        program = plan.programs[rank]
        if any(isinstance(s, Wait) and (s.lane, s.slot) == (wait.lane, wait.slot)
               for s in program[:index]):
            continue
        following = [s for s in program[index + 1:] if s.lane == wait.lane]
        if following and isinstance(following[0], Copy) and peer in (following[0].src.rank,
                                                                      following[0].dst.rank):
            yield _without(plan, rank, index)


def drop_ready_wait_before_pull(plan: Plan) -> Iterator[Plan]:
    """A pulled reduction's wait for a peer's READY (its input may be read) ahead of the
    Reduce that reads that peer's memory."""
    for rank, index, wait in _steps(plan, Wait):
        if wait.slot % CHANNELS != READY:
            continue
        peer = wait.slot // CHANNELS
        following = [s for s in plan.programs[rank][index + 1:]
                     if s.lane == wait.lane and not isinstance(s, Wait)]
        if (following and isinstance(following[0], Reduce)
                and any(ref.rank == peer for ref in following[0].inputs)):
            yield _without(plan, rank, index)


def _touches(step, rank: int) -> bool:
    """Whether a Copy or Reduce reads or writes ``rank``'s memory."""
    if isinstance(step, Copy):
        return rank in (step.src.rank, step.dst.rank)
    return isinstance(step, Reduce) and any(ref.rank == rank for ref in step.inputs)


def drop_done_wait(plan: Plan) -> Iterator[Plan]:
    """The wait for the last DONE/GATHERED from a peer that copied into or out of this
    rank's memory (or reduced what it read there): this rank's exit no longer follows
    those steps.  (A DONE that only closes a handshake with nothing copied, like in-place
    gather's, guards nothing; nor does a pulled all_reduce's DONE, there for graph
    replays: the GATHERED after the sender's sums orders the exit after its reads.)"""
    for rank, index, wait in _steps(plan, Wait):
        sender = wait.slot // CHANNELS
        touched = any(_touches(step, rank) for step in plan.programs[sender])
        pulled = any(isinstance(step, Reduce) and _touches(step, rank)
                     for step in plan.programs[sender])
        if pulled and plan.collective == "all_reduce" and wait.slot % CHANNELS == DONE:
            continue
        if (touched and wait.slot % CHANNELS in (DONE, GATHERED, PAIR_DONE)
                and wait.value == max(_signalled(plan, rank, wait.slot))):
            yield _without(plan, rank, index)


def shift_copy_destination(plan: Plan) -> Iterator[Plan]:
    """A Copy's destination one byte lower: it overlaps the write below and leaves a byte unwritten."""
    for rank, index, copy in _steps(plan, Copy):
        if copy.dst.offset >= 1:
            shifted = replace(copy, dst=replace(copy.dst, offset=copy.dst.offset - 1))
            yield _replacing(plan, rank, index, shifted)


def drop_copy(plan: Plan) -> Iterator[Plan]:
    for rank, index, _ in _steps(plan, Copy):
        yield _without(plan, rank, index)


def duplicate_output_copy(plan: Plan) -> Iterator[Plan]:
    """A Copy into a caller's buffer issued twice (scratch, and a direct kernel's ring,
    may legally be rewritten)."""
    for rank, index, copy in _steps(plan, Copy):
        if copy.dst.buffer not in ("scratch", RING):
            yield _inserting(plan, rank, index + 1, copy)


def drop_after(plan: Plan) -> Iterator[Plan]:
    """all_reduce's gather lane no longer waits for the reduction it sends."""
    for rank, index, _ in _steps(plan, After):
        yield _without(plan, rank, index)


def raise_wait_beyond_signals(plan: Plan) -> Iterator[Plan]:
    for rank, index, wait in _steps(plan, Wait):
        value = max(_signalled(plan, rank, wait.slot)) + 1
        yield replace(_replacing(plan, rank, index, replace(wait, value=value)),
                      max_value=max(plan.max_value, value))


def signal_before_copy(plan: Plan) -> Iterator[Plan]:
    """A Signal moved ahead of the Copy before it on its lane: the peer may go on before
    the data lands.  Targets the last signal into a slot (the peer's exit relies on it)
    and every DONE of a reduction (the owner reduces that chunk when it sees it)."""
    for rank, index, signal in _steps(plan, Signal):
        program = plan.programs[rank]
        before = _lane_predecessor(program, index)
        if before is None or not isinstance(program[before], Copy):
            continue
        if plan.kernel_blocks and program[before].dst.rank != signal.peer:
            # a direct kernel signals after all of its stores: moving a signal before a
            # store into another rank's ring, or before a receiver's read of its own ring
            # (a broadcast's second signal only has to come in the same call), is harmless
            continue
        last = signal.value == max(_signalled(plan, signal.peer, signal.slot))
        if last or (plan.collective in REDUCING and signal.slot % CHANNELS == DONE):
            moved = list(program)
            moved.insert(before, moved.pop(index))
            yield _with_program(plan, rank, moved)


MUTATIONS: List[Tuple[Callable[[Plan], Iterator[Plan]], Optional[str]]] = [
    (drop_awaited_signal, "deadlock"),
    (drop_ready_wait_before_push, "no step of rank .* happens before it"),
    (drop_ready_wait_before_pull, "no step of rank .* happens before it"),
    (drop_done_wait, None),
    (shift_copy_destination, "writ"),
    (drop_copy, None),
    (duplicate_output_copy, "written exactly once"),
    # the gather lane's copies lose both their order after the reduction (a race) and
    # their only path from the peer's READY (a fence): verify reports the fence first;
    # pulled, the peer's exit loses its only path from the reads of its input
    (drop_after, "race|no step of rank .* happens (before|after) it"),
    (raise_wait_beyond_signals, "deadlock"),
    (signal_before_copy, None),
]

PLAN_CONFIGS = [
    (collective, world_size, in_place, route)
    for collective in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast",
                       "gather", "reduce", "scatter", "sendrecv")
    for world_size in (2, 3, 6)
    for in_place in (False, True)
    for route in ("peer", "local")
    if not (in_place and collective in ("all_to_all", "sendrecv"))
    and not (route == "local" and collective == "sendrecv")
] + [
    # reductions that read the peers' inputs where they lie (Options.pull_bytes)
    (collective, world_size, in_place, "pull")
    for collective in ("all_reduce", "reduce_scatter", "reduce")
    for world_size in (2, 3, 6)
    for in_place in (False, True)
] + [
    # direct kernels (Options.kernel_bytes): stores into the peers' rings, one DONE each
    (collective, world_size, in_place, "kernel")
    for collective in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast")
    for world_size in (2, 3, 6)
    for in_place in (False, True)
    if not (in_place and collective == "all_to_all")
]


def _plan(collective: str, world_size: int, in_place: bool, route: str) -> Plan:
    # 5 float32 elements in chunks of 2: reductions run three chunks
    shape = Shape(collective, world_size, 5, "float32", 4, "sum", root=world_size - 1,
                  peer=0, in_place=in_place)
    if route == "pull":
        return build_plan(shape, Options(chunk_bytes=8, pull_bytes=1 << 20))
    if route == "kernel":
        return build_plan(shape, Options(kernel_bytes=1 << 20))
    return build_plan(shape, Options(chunk_bytes=8, self_route=route))


def _cases():
    for config in PLAN_CONFIGS:
        plan = _plan(*config)
        for mutation, message in MUTATIONS:
            if next(mutation(plan), None) is not None:
                label = f"{mutation.__name__}-{config[0]}-n{config[1]}-" \
                        f"{'inplace' if config[2] else 'oop'}-{config[3]}"
                yield pytest.param(config, mutation, message, id=label)


@pytest.mark.parametrize("config", PLAN_CONFIGS,
                         ids=[f"{c[0]}-n{c[1]}-{'inplace' if c[2] else 'oop'}-{c[3]}"
                              for c in PLAN_CONFIGS])
def test_unmutated_plan_verifies(config):
    plan = _plan(*config)
    assert verify(plan) is plan


@pytest.mark.parametrize("config, mutation, message", list(_cases()))
def test_every_mutant_is_rejected(config, mutation, message):
    plan = _plan(*config)
    mutants = list(mutation(plan))
    assert mutants
    for mutant in mutants:
        assert mutant != plan
        with pytest.raises(PlanError, match=message) as raised:
            verify(mutant)
        assert str(raised.value).startswith(f"verify: {plan.collective} plan")


def test_every_mutation_finds_targets():
    found = {mutation.__name__ for mutation, _ in MUTATIONS
             for config in PLAN_CONFIGS if next(mutation(_plan(*config)), None) is not None}
    assert found == {mutation.__name__ for mutation, _ in MUTATIONS}


def test_large_plans_verify():
    for shape in (Shape("all_gather", 64, 3, "float32", 4),
                  Shape("all_to_all", 32, 3, "float32", 4, in_place=False),
                  Shape("all_reduce", 16, 1000, "float32", 4)):
        plan = build_plan(shape, Options(chunk_bytes=512))
        assert verify(plan) is plan


# -- hand-made plans: one rule each -------------------------------------------------------
def _slot(sender: int, channel: int) -> int:
    return sender * CHANNELS + channel


def _handoff(done_wait_value: int) -> Plan:
    """Rank 0 signals DONE=1, copies into rank 1's scratch, signals DONE=2; rank 1 waits
    for DONE >= ``done_wait_value`` and then reads the scratch."""
    rank0 = (Wait(0, _slot(1, READY), 1),
             Signal(0, 1, _slot(0, DONE), 1),
             Copy(0, BufRef(0, "send", 0), BufRef(1, "scratch", 0), 4),
             Signal(0, 1, _slot(0, DONE), 2))
    rank1 = (Signal(0, 0, _slot(1, READY), 1),
             Wait(0, _slot(0, DONE), done_wait_value),
             Copy(0, BufRef(1, "scratch", 0), BufRef(1, "recv", 0), 4))
    buffers = ((BufferSpec("send", 4, inputs=((0, 4),)),),
               (BufferSpec("scratch", 4), BufferSpec("recv", 4, outputs=((0, 4),))))
    return Plan("handoff", 2, 1, buffers, (rank0, rank1), 2, (0, 1))


def test_wait_is_released_by_the_first_signal_reaching_its_value():
    assert verify(_handoff(2)) is not None
    with pytest.raises(PlanError, match="rank 0 step 2"):
        verify(_handoff(1))  # released by DONE=1, written before the data


def test_waiting_for_each_other_before_signalling_is_a_deadlock_cycle():
    programs = ((Wait(0, _slot(1, READY), 1), Signal(0, 1, _slot(0, READY), 1)),
                (Wait(0, _slot(0, READY), 1), Signal(0, 0, _slot(1, READY), 1)))
    plan = Plan("barrier", 2, 1, ((), ()), programs, 1, (0, 1))
    with pytest.raises(PlanError, match="deadlock: steps wait for each other in a cycle"):
        verify(plan)


def _mutate_handoff(rank: int, index: int, step, **changes) -> Plan:
    plan = _handoff(2)
    if step is None:  # the step at ``index`` twice
        return replace(_inserting(plan, rank, index, plan.programs[rank][index]), **changes)
    return replace(_replacing(plan, rank, index, step), **changes)


@pytest.mark.parametrize("rank, index, step, changes, message", [
    (0, 1, Signal(1, 1, _slot(0, DONE), 1), {"lanes": 2}, "one writer"),
    (0, 1, Signal(0, 1, _slot(1, DONE), 1), {}, "belongs to the rank it names"),
    (0, 3, Signal(0, 1, _slot(0, DONE), 1), {}, "strictly increase"),
    (0, 1, Signal(3, 1, _slot(0, DONE), 1), {}, "lane 3 is outside"),
    (0, 1, Signal(0, 2, _slot(0, DONE), 1), {}, "peer 2 is not a rank"),
    (0, 1, Signal(0, 1, 99, 1), {}, "slot 99 is outside"),
    (1, 1, Wait(0, _slot(0, DONE), 3), {}, "value must lie in 1..max_value=2"),
    (0, 2, Copy(0, BufRef(0, "send", 0), BufRef(1, "nothing", 0), 4), {}, "'nothing'"),
    (0, 2, Copy(0, BufRef(0, "send", 2), BufRef(1, "scratch", 0), 4), {}, "outside rank 0"),
    (1, 2, Copy(0, BufRef(0, "send", 0), BufRef(0, "send", 0), 4), {}, "must read or write"),
    (1, 2, Reduce(0, (BufRef(1, "recv", 0),), BufRef(0, "send", 0), 1, "float32", "sum"), {},
     "output .* is not on the running rank 1"),
    (1, 2, Reduce(0, (BufRef(1, "scratch", 0),), BufRef(1, "recv", 0), 1, "float32", "xor"), {},
     "op must be one of"),
    (1, 2, After(0, 7), {}, "mark 7, which is not recorded"),
    (0, 2, Copy(0, BufRef(0, "send", 0), BufRef(0, "send", 0), 4), {}, "overlap"),
])
def test_malformed_steps_are_rejected(rank, index, step, changes, message):
    with pytest.raises(PlanError, match=message):
        verify(_mutate_handoff(rank, index, step, **changes))


def test_reduce_output_partially_overlapping_an_input_is_rejected():
    scratch = BufferSpec("scratch", 12)
    program = (Copy(0, BufRef(0, "send", 0), BufRef(0, "scratch", 0), 8),
               Reduce(0, (BufRef(0, "scratch", 0),), BufRef(0, "scratch", 4), 2, "float32", "sum"))
    plan = Plan("reduce", 1, 1, ((BufferSpec("send", 8, inputs=((0, 8),)), scratch),),
                (program,), 1, (0,))
    with pytest.raises(PlanError, match="partially overlaps"):
        verify(plan)
    in_place = replace(program[1], output=BufRef(0, "scratch", 0))
    assert verify(_with_program(plan, 0, (program[0], in_place)))


def test_writing_a_callers_input_is_rejected():
    plan = build_plan(Shape("all_gather", 2, 4, "uint8", 1), Options(self_route="local"))
    rank0 = plan.programs[0] + (Copy(0, BufRef(0, "recv", 4), BufRef(0, "send", 0), 4),)
    with pytest.raises(PlanError, match="not outputs of the collective"):
        verify(_with_program(plan, 0, rank0))


def test_reading_scratch_nobody_wrote_is_rejected():
    plan = Plan("scratch", 1, 1, ((BufferSpec("scratch", 4), BufferSpec("recv", 4, outputs=((0, 4),))),),
                ((Copy(0, BufRef(0, "scratch", 0), BufRef(0, "recv", 0), 4),),), 1, (0,))
    with pytest.raises(PlanError, match="not inputs and are not written before"):
        verify(plan)


def test_unordered_writes_to_scratch_race():
    both = (Copy(0, BufRef(0, "send", 0), BufRef(0, "scratch", 0), 4),
            Copy(1, BufRef(0, "send", 0), BufRef(0, "scratch", 0), 4))
    specs = ((BufferSpec("send", 4, inputs=((0, 4),)), BufferSpec("scratch", 4)),)
    with pytest.raises(PlanError, match="race: writes"):
        verify(Plan("scratch", 1, 2, specs, (both,), 1, (0,)))
    ordered = (both[0], Mark(0, 1), After(1, 1), both[1])
    assert verify(Plan("scratch", 1, 2, specs, (ordered,), 1, (0,)))


def test_non_participant_with_steps_is_rejected():
    plan = build_plan(Shape("sendrecv", 3, 4, "uint8", 1, root=0, peer=1))
    assert verify(plan) is plan
    with pytest.raises(PlanError, match="rank 2 is not a participant"):
        verify(_with_program(plan, 2, (Mark(0, 1),)))


# -- soundness: whatever verify accepts computes the right thing --------------------------
@st.composite
def _edited_plans(draw):
    """A correct plan with one step dropped, duplicated, swapped with the next or moved
    to another lane: some edits are harmless, most are not."""
    kind = draw(st.sampled_from([c for c in COLLECTIVES if c != "barrier"]))
    n = draw(st.integers(2, 5))  # a single rank's in-place plans have no step to edit
    root = draw(st.integers(0, n - 1)) if kind in ROOTED else 0
    peer = draw(st.integers(0, n - 1)) if kind == "sendrecv" else -1
    case = Case(kind, n, draw(st.sampled_from((1, 3, 5))), "int32", "sum", root, peer,
                draw(st.booleans()) and kind in IN_PLACE_FORMS,
                draw(st.sampled_from(("peer", "local"))), 8, None)
    plan = build_plan(case.shape(), case.options())
    rank = draw(st.sampled_from([r for r in range(n) if plan.programs[r]]))
    program = list(plan.programs[rank])
    index = draw(st.integers(0, len(program) - 1))
    edit = draw(st.sampled_from(("drop", "duplicate", "swap", "relane")))
    if edit == "drop":
        del program[index]
    elif edit == "duplicate":
        program.insert(index, program[index])
    elif edit == "swap" and index + 1 < len(program):
        program[index], program[index + 1] = program[index + 1], program[index]
    elif edit == "relane":
        program[index] = replace(program[index], lane=draw(st.integers(0, plan.lanes - 1)))
    return case, _with_program(plan, rank, program)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edited=_edited_plans(), seed=st.integers(0, 2 ** 16))
def test_a_plan_verify_accepts_simulates_to_the_reference(edited, seed):
    case, plan = edited
    try:
        verify(plan)
    except PlanError:
        return
    rng = np.random.default_rng(seed)
    for interleaving in range(seed, seed + 4):
        arrays, expected = reference(case, rng)
        simulate(plan, arrays, seed=interleaving)
        for rank in range(case.world_size):
            for name, wanted in expected[rank].items():
                assert arrays[rank][name].tobytes() == wanted.tobytes(), (case, rank, name)
