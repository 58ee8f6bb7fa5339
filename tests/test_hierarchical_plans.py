"""Hierarchical plans (hosts x local ranks) are verified and simulated for every collective,
both forms, odd counts, several roots, dtypes and ops, on 2x2, 2x8, 4x8 and 16x8 ranks
(and the one-host and one-rank-per-host edges), and the results match hoccl.testing's
numpy reference bit for bit: copies, and reductions too (the reference reduces as every
engine across hosts does: each host's inputs, then the hosts' sums, each step rounded
once: ``hoccl.testing.hierarchical_reduced``).  Pipelined plans (all_reduce, broadcast,
reduce cut into chunks) are proved and give the same bits.  Inputs are fresh random
data, outputs poisoned; the caller's input-only elements must come back untouched.
Set ``HOCCL_TEST_SEED`` to replay a run."""

from __future__ import annotations

import os
import random
from dataclasses import replace
from typing import Dict, List, Optional

import numpy as np
import pytest

from hoccl import PlanError
from hoccl._dtypes import ITEMSIZE, numpy_dtype
from hoccl.sched import SCRATCH_FILL, Shape
from hoccl.sched.hierarchical import (BY_HOST, PIPELINED, Call, HierarchicalPlan, Phase, PipelinedPlan,
                                      Region, Topology, build_hierarchical,
                                      pipeline_hierarchical, simulate_hierarchical,
                                      verify_hierarchical, verify_pipelined)
from hoccl.testing import IN_PLACE_FORMS, expected, random_array

SESSION_SEED = int(os.environ.get("HOCCL_TEST_SEED", random.randrange(2 ** 32)))
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
               "reduce", "gather", "scatter")
REDUCING = ("reduce_scatter", "all_reduce", "reduce")
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def setup_module(module):
    print(f"HOCCL_TEST_SEED={SESSION_SEED}")


def _send_count(collective: str, n: int, count: int) -> int:
    return count * n if collective in ("reduce_scatter", "all_to_all", "scatter") else count


def run(topology: Topology, collective: str, count: int, dtype: str = "int32", op: str = "sum",
        root: int = 0, peer: int = -1, in_place: bool = False, seed: int = 0,
        plan: Optional[HierarchicalPlan] = None, calls: str = "plans") -> List[Dict[str, np.ndarray]]:
    """Build (or take), verify and simulate one plan; assert every rank's result and
    return every rank's buffers."""
    n = topology.world_size
    shape = Shape(collective, n, count, dtype, ITEMSIZE[dtype], op, root, peer, in_place)
    plan = plan or build_hierarchical(shape, topology)
    verify_hierarchical(plan)
    rng = np.random.default_rng([SESSION_SEED, seed])
    np_dtype = numpy_dtype(dtype)
    data: List[Optional[np.ndarray]] = [random_array(rng, _send_count(collective, n, count), dtype)
                                        for _ in range(n)]
    if collective in ("broadcast", "scatter"):
        data = [x if r == root else None for r, x in enumerate(data)]
    if collective == "sendrecv":
        data = [x if r == root else None for r, x in enumerate(data)]
    arrays: List[Dict[str, np.ndarray]] = []
    for rank in range(n):
        buffers = {}
        for layout in plan.buffers[rank]:
            if layout.name == "scratch":
                continue
            array = np.full(layout.count * np_dtype.itemsize, SCRATCH_FILL, np.uint8).view(np_dtype)
            at = 0
            for start, stop in layout.inputs:
                array[start:stop] = data[rank][at:at + stop - start]
                at += stop - start
            buffers[layout.name] = array
        arrays.append(buffers)
    before = [{name: array.copy() for name, array in buffers.items()} for buffers in arrays]
    simulate_hierarchical(plan, arrays, seed=seed, calls=calls)
    if collective == "sendrecv":
        want = [data[root] if r == peer else None for r in range(n)]
    else:
        want = expected(collective, data, op=op, root=root, local_size=topology.local_size)
    for rank in range(n):
        for layout in plan.buffers[rank]:  # the caller's input-only elements stay as they were
            if layout.name == "scratch":
                continue
            keep = np.zeros(layout.count, bool)
            for start, stop in layout.inputs:
                keep[start:stop] = True
            for start, stop in layout.outputs:
                keep[start:stop] = False
            got, was = arrays[rank][layout.name], before[rank][layout.name]
            assert np.array_equal(got[keep].view(np.uint8), was[keep].view(np.uint8)), \
                f"{collective}: rank {rank} changed its input {layout.name}"
        if want[rank] is None:
            continue
        result = _result(plan, rank, arrays[rank])
        _assert_result(collective, rank, want[rank], result)
    return arrays


def _result(plan: HierarchicalPlan, rank: int, buffers: Dict[str, np.ndarray]) -> np.ndarray:
    """The rank's result: the call's receive region (in place: inside the one buffer)."""
    s = plan.shape
    from hoccl.sched.hierarchical import _caller_regions
    region = _caller_regions(s, rank)[1]
    return buffers[region.buffer][region.start:region.stop]


def _assert_result(collective, rank, want, got):
    assert got.shape == want.shape, f"{collective}: rank {rank} {got.shape} vs {want.shape}"
    bad = np.flatnonzero(want.view(np.uint8) != got.view(np.uint8))
    assert bad.size == 0, (f"{collective}: rank {rank} differs at byte {bad[0]}: "
                           f"got {got[:8]}, want {want[:8]}")


def _roots(n: int, L: int) -> List[int]:
    """Ranks 0, the last, and one in the middle of another host and local rank."""
    return sorted({0, n - 1, min(n - 1, L + 1)})


def _cases(hosts: int, local_size: int, counts, ops_of_dtypes):
    """Every collective x form x root x count x (dtype, op); ``ops_of_dtypes`` maps each
    dtype to the ops its reductions run."""
    n = hosts * local_size
    for collective in COLLECTIVES:
        for in_place in ([False, True] if collective in IN_PLACE_FORMS else [False]):
            for root in (_roots(n, local_size) if collective in ROOTED else [0]):
                for count in counts:
                    for dtype, ops in ops_of_dtypes.items():
                        for op in (ops if collective in REDUCING else ["sum"]):
                            yield collective, count, dtype, op, root, in_place


SMALL = [(2, 2), (2, 3), (3, 1), (1, 4), (3, 2)]


@pytest.mark.parametrize("hosts,local_size", SMALL)
def test_every_collective_on_small_topologies_matches_numpy(hosts, local_size):
    """Each call of each phase runs as its own hoccl plan, in a random legal order."""
    topology = Topology(hosts, local_size)
    for seed, (collective, count, dtype, op, root, in_place) in enumerate(
            _cases(hosts, local_size, [0, 1, 19], {"int32": ["sum", "avg", "prod"],
                                                    "float32": ["sum", "max"]})):
        run(topology, collective, count, dtype, op, root, in_place=in_place, seed=seed)


def test_every_collective_on_2_hosts_of_8_matches_numpy():
    topology = Topology(2, 8)
    for seed, (collective, count, dtype, op, root, in_place) in enumerate(
            _cases(2, 8, [19], {"bfloat16": ["sum", "avg"]})):
        run(topology, collective, count, dtype, op, root, in_place=in_place, seed=seed)


AT_SCALE = {(2, 2): ([3, 7], {"int8": ["sum", "min"], "int64": ["avg"], "bfloat16": ["sum"]}),
            (2, 8): ([3, 19], {"int8": ["sum", "min"], "int64": ["avg"], "bfloat16": ["sum"]}),
            (4, 8): ([3, 19], {"int8": ["sum"], "int64": ["avg"], "bfloat16": ["max"]}),
            (16, 8): ([11], {"int64": ["avg"], "bfloat16": ["sum"]})}


@pytest.mark.parametrize("hosts,local_size", list(AT_SCALE))
def test_every_collective_at_scale_matches_numpy(hosts, local_size):
    """Every phase's calls as their collectives' definitions (the calls' own plans at
    these sizes are proved by verify and simulated by the tests of the flat plans)."""
    topology = Topology(hosts, local_size)
    counts, ops_of_dtypes = AT_SCALE[hosts, local_size]
    for seed, (collective, count, dtype, op, root, in_place) in enumerate(
            _cases(hosts, local_size, counts, ops_of_dtypes)):
        run(topology, collective, count, dtype, op, root, in_place=in_place, seed=seed,
            calls="definitions")


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_plans_and_definitions_of_the_calls_agree(collective):
    """The fast path of simulate_hierarchical is checked against the calls' own plans."""
    topology = Topology(2, 8)
    root = 11 if collective in ROOTED else 0
    results = [run(topology, collective, 21, "int32", "sum", root, in_place=False, seed=5,
                   calls=calls) for calls in ("plans", "definitions")]
    for rank, (planned, defined) in enumerate(zip(*results)):
        for name in planned:
            if name != "scratch":
                assert np.array_equal(planned[name], defined[name]), (collective, rank, name)


@pytest.mark.parametrize("hosts,local_size", [(2, 2), (2, 8), (4, 8), (16, 8)])
def test_send_recv_and_barrier_plans(hosts, local_size):
    topology = Topology(hosts, local_size)
    n = topology.world_size
    pairs = [(0, 1), (1, 0), (0, local_size), (1, n - 1), (n - 1, local_size - 1)]
    for seed, (sender, receiver) in enumerate(pairs):
        run(topology, "sendrecv", 7, "float32", root=sender, peer=receiver, seed=seed)
    plan = build_hierarchical(Shape("barrier", n, 0), topology)
    verify_hierarchical(plan)
    assert [phase.level for phase in plan.phases] == ["host", "rail"]


def test_send_recv_takes_the_level_that_holds_both_ranks():
    topology = Topology(4, 8)
    levels = {pair: build_hierarchical(Shape("sendrecv", 32, 4, root=pair[0], peer=pair[1]),
                                       topology).phases[0].level
              for pair in [(3, 5), (3, 11), (3, 12)]}
    assert levels == {(3, 5): "host", (3, 11): "rail", (3, 12): "world"}


def test_phases_use_only_their_levels_groups():
    """Every rail call is among ranks with one local rank; every host call within a host."""
    topology = Topology(4, 8)
    plan = build_hierarchical(Shape("all_reduce", 32, 100, "float32", 4), topology)
    assert [phase.level for phase in plan.phases] == ["host", "rail", "host"]
    rail = plan.phases[1]
    for rank, steps in enumerate(rail.steps):
        for step in steps:
            assert step.shape.world_size == topology.hosts
    assert plan.scratch_count(0) == 0  # all_reduce stages in the caller's buffer


def test_all_gather_sends_each_block_over_the_network_once():
    """The rail step carries (H-1) blocks per rank, not (H-1) host blocks."""
    topology = Topology(4, 8)
    plan = build_hierarchical(Shape("all_gather", 32, 10, "float32", 4), topology)
    rail = [step for steps in plan.phases[0].steps for step in steps]
    assert plan.phases[0].level == "rail" and all(step.shape.count == 10 for step in rail)


# -- the checkers fail on planted faults ----------------------------------------------------
def _mutated(plan: HierarchicalPlan, phase_index: int, rank: int, change) -> HierarchicalPlan:
    phases = list(plan.phases)
    phase = phases[phase_index]
    steps = list(phase.steps)
    steps[rank] = change(steps[rank])
    phases[phase_index] = Phase(phase.level, tuple(steps))
    return replace(plan, phases=tuple(phases))


def _base(collective="all_gather", in_place=False, op="sum"):
    topology = Topology(2, 2)
    shape = Shape(collective, 4, 3, "int32", 4, op, 0, -1, in_place)
    return topology, build_hierarchical(shape, topology)


def test_verify_rejects_a_shifted_block():
    topology, plan = _base()
    host = 1  # the host phase: shift rank 2's first call's receive region by one element

    def shift(steps):
        call = steps[0]
        return (Call(call.shape, call.send, Region("recv", call.recv.start + 1,
                                                   call.recv.count)),) + steps[1:]
    with pytest.raises(PlanError, match="same phase"):
        verify_hierarchical(_mutated(plan, host, 2, shift))


def test_verify_rejects_a_call_one_member_never_makes():
    topology, plan = _base()
    with pytest.raises(PlanError, match="calls"):
        verify_hierarchical(_mutated(plan, 1, 3, lambda steps: steps[:-1]))


def test_verify_rejects_a_write_into_the_callers_input():
    topology, plan = _base("reduce_scatter")

    def into_send(steps):  # the first host call's partial sums land in the caller's input
        call = steps[0]
        return (Call(call.shape, call.send, Region("send", 6, call.recv.count)),) + steps[1:]
    with pytest.raises(PlanError, match="holds only the caller's input"):
        verify_hierarchical(_mutated(plan, 0, 0, into_send))


def test_verify_rejects_reading_scratch_before_it_is_written():
    topology, plan = _base()
    phases = (plan.phases[1], plan.phases[0])  # host phase first: scratch is still empty
    with pytest.raises(PlanError, match="holds nothing yet"):
        verify_hierarchical(replace(plan, phases=phases))


def test_verify_rejects_steps_of_one_phase_that_touch_the_same_memory():
    plan = build_hierarchical(Shape("all_reduce", 4, 5, "int32", 4), Topology(2, 2))

    def clash(steps):  # the remainder's all_reduce writes over the shard
        first, second = steps
        return first, Call(second.shape, Region("send", 0, 1), first.recv.block(0, 1))
    with pytest.raises(PlanError, match="same phase"):
        verify_hierarchical(_mutated(plan, 0, 0, clash))


def test_the_result_check_fails_on_a_plan_with_a_wrong_source():
    """A plan that verifies but moves the wrong data is caught by the numpy comparison."""
    topology, plan = _base()

    def wrong_source(steps):  # host all_gather of host 1's blocks from scratch block 0
        out = list(steps)
        call = out[1]
        out[1] = Call(call.shape, Region("scratch", 0, call.send.count), call.recv)
        return tuple(out)
    mutated = _mutated(plan, 1, 0, wrong_source)
    verify_hierarchical(mutated)
    with pytest.raises(AssertionError, match="differs"):
        run(topology, "all_gather", 3, plan=mutated)


# -- pipelined plans ------------------------------------------------------------------
@pytest.mark.parametrize("hosts,local_size", [(2, 2), (3, 2), (2, 3), (4, 1)])
@pytest.mark.parametrize("collective", PIPELINED + BY_HOST)
def test_pipelined_plans_are_proved_and_give_the_bits_of_the_whole_call(collective, hosts,
                                                                         local_size):
    """Chunked into 1, 2 and many chunks (the last short) or, for all_gather and
    reduce_scatter, one chunk per host; both forms, every root: the flattened steps
    verify and simulate to the reference's bits (which the unchunked plan gives too:
    the same folds per element)."""
    topology = Topology(hosts, local_size)
    n = topology.world_size
    seed = 0
    for count, chunk in ((7, 7), (17, 6), (23, 2)):
        for in_place in (False, True):
            for root in (_roots(n, local_size) if collective in ROOTED else [0]):
                for dtype, op in (("bfloat16", "avg"), ("float16", "sum"), ("int8", "prod")):
                    if collective in ("broadcast", "all_gather") and op != "sum":
                        continue
                    seed += 1
                    shape = Shape(collective, n, count, dtype, ITEMSIZE[dtype], op, root,
                                  -1, in_place)
                    pipelined = pipeline_hierarchical(shape, topology, chunk)
                    verify_pipelined(pipelined)
                    chunks = (-(-count // chunk) if collective in PIPELINED else
                              hosts if hosts > 1 and local_size > 1 else 1)
                    assert len(pipelined.plans) == chunks
                    run(topology, collective, count, dtype, op, root, in_place=in_place,
                        seed=seed, plan=pipelined.flatten())


def test_a_pipelined_program_runs_along_the_diagonals_with_each_phase_after_its_chunks_last():
    shape = Shape("all_reduce", 4, 32, "float32", 4, "avg")
    pipelined = pipeline_hierarchical(shape, Topology(2, 2), 8)
    program = [(entry.chunk, entry.phase, entry.level) for entry in pipelined.program(0)]
    assert program[:6] == [(0, 0, "host"), (1, 0, "host"), (0, 1, "rail"), (2, 0, "host"),
                           (1, 1, "rail"), (0, 2, "local")]
    host = [(chunk, phase) for chunk, phase, level in program if level == "host"]
    # the host's reduce_scatter of later chunks comes before the all_gather of chunk 0
    assert host.index((2, 0)) < host.index((0, 3))


def test_verify_pipelined_refuses_overlapping_chunks_and_orders_that_differ_between_members():
    shape = Shape("broadcast", 4, 8, "int32", 4, root=1)
    topology = Topology(2, 2)
    good = pipeline_hierarchical(shape, topology, 4)
    overlapping = PipelinedPlan(shape, topology, ((0, 4), (0, 4)), good.plans[:1] * 2)
    with pytest.raises(PlanError, match="no step writes|written 2 times"):
        verify_pipelined(overlapping)

    class Swapped(PipelinedPlan):
        def program(self, rank):
            steps = super().program(rank)
            if rank == 3:
                first, second = [i for i, entry in enumerate(steps) if entry.level == "rail"][:2]
                steps[first], steps[second] = steps[second], steps[first]
            return steps
    with pytest.raises(PlanError, match="verify_pipelined: rank 3 takes phase|at the rail level"):
        verify_pipelined(Swapped(shape, topology, good.chunks, good.plans))
    verify_pipelined(good)
