"""Every collective's plan is verified and simulated, and its result matches a numpy
reference written from the NCCL/MPI definitions (independently of the plan).

Inputs are fresh random data, outputs are poisoned before each run (``hoccl.testing.poison``:
a signalling NaN for floats, which no input or sum equals), and every buffer (inputs
included: a collective must not touch its caller's input) is compared bit for bit.
Integer inputs span their whole type (never the poison itself), so a wrapped sum can
equal the poison; that an output is written at all is ``verify``'s proof (every output
byte written exactly once), not the poison's.  Reductions use ``reduce_arrays`` over
the ranks in rank order, the order and accumulation the plan's ``Reduce`` steps use, so
floats compare exactly too.  Set ``HOCCL_TEST_SEED`` to replay a failing run.
"""

from __future__ import annotations

import os
import random
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hoccl._dtypes import ITEMSIZE, numpy_dtype, reduce_arrays
from hoccl.sched import COLLECTIVES, Options, Shape, build_plan, simulate, verify
from hoccl.sched.algorithms import KERNEL_COLLECTIVES
from hoccl.sched.plan import CHANNELS, READY, RING, Wait
from hoccl.testing import assert_exact, is_poison, poison

SESSION_SEED = int(os.environ.get("HOCCL_TEST_SEED", random.randrange(2 ** 32)))
DTYPES = tuple(ITEMSIZE)
OPS = ("sum", "prod", "max", "min", "avg")
REDUCING = ("reduce_scatter", "all_reduce", "reduce")
IN_PLACE_FORMS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce",
                  "gather", "scatter")
ROOTED = ("broadcast", "reduce", "gather", "scatter", "sendrecv")

Arrays = List[Dict[str, np.ndarray]]


class Case(NamedTuple):
    collective: str
    world_size: int
    count: int
    dtype: str
    op: str
    root: int
    peer: int
    in_place: bool
    self_route: str
    chunk_bytes: int
    copy_lanes: Optional[int]
    one_shot_bytes: int = 0
    pull_bytes: int = 0
    kernel_bytes: int = 0

    def shape(self) -> Shape:
        return Shape(self.collective, self.world_size, self.count, self.dtype,
                     ITEMSIZE[self.dtype], self.op, self.root, self.peer, self.in_place)

    def options(self) -> Options:
        return Options(copy_lanes=self.copy_lanes, chunk_bytes=self.chunk_bytes,
                       self_route=self.self_route, one_shot_bytes=self.one_shot_bytes,
                       pull_bytes=self.pull_bytes, kernel_bytes=self.kernel_bytes)

    def label(self) -> str:
        return (f"{self.collective}-n{self.world_size}-c{self.count}-{self.dtype}-{self.op}"
                f"-root{self.root}-peer{self.peer}-{'inplace' if self.in_place else 'oop'}"
                f"-{self.self_route}-chunk{self.chunk_bytes}-lanes{self.copy_lanes}"
                f"{f'-oneshot{self.one_shot_bytes}' if self.one_shot_bytes else ''}"
                f"{f'-pull{self.pull_bytes}' if self.pull_bytes else ''}"
                f"{f'-kernel{self.kernel_bytes}' if self.kernel_bytes else ''}")


# -- the reference: what each collective computes, from its definition ---------------------
def _random(rng: np.random.Generator, dtype: str, count: int) -> np.ndarray:
    dt = numpy_dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        values = rng.integers(info.min, info.max, size=count, dtype=dt, endpoint=True)
        values[is_poison(values)] ^= 1
        return values
    return rng.standard_normal(count).astype(dt)


def _reduced(blocks: List[np.ndarray], case: Case) -> np.ndarray:
    return reduce_arrays(blocks, case.op, numpy_dtype(case.dtype))


def reference(case: Case, rng: np.random.Generator) -> Tuple[Arrays, Arrays]:
    """``(arrays, expected)``: per rank, buffer name -> array before the call (inputs
    random, outputs poisoned) and after it (the whole buffer, untouched bytes included)."""
    n, c, dt, root = case.world_size, case.count, case.dtype, case.root
    kind, in_place = case.collective, case.in_place
    arrays: Arrays = [{} for _ in range(n)]
    expected: Arrays = [{} for _ in range(n)]

    def block(array: np.ndarray, index: int) -> np.ndarray:
        return array[index * c:(index + 1) * c]

    def give(rank: int, name: str, before: np.ndarray, after: np.ndarray) -> None:
        arrays[rank][name] = before.copy()
        expected[rank][name] = after

    if kind == "all_gather":
        data = [_random(rng, dt, c) for _ in range(n)]
        gathered = np.concatenate(data)
        for r in range(n):
            if in_place:
                recv = poison(n * c, dt)
                block(recv, r)[...] = data[r]
                give(r, "recv", recv, gathered)
            else:
                give(r, "send", data[r], data[r])
                give(r, "recv", poison(n * c, dt), gathered)
    elif kind == "reduce_scatter":
        sends = [_random(rng, dt, n * c) for _ in range(n)]
        for r in range(n):
            result = _reduced([block(send, r) for send in sends], case)
            if in_place:
                after = sends[r].copy()
                block(after, r)[...] = result
                give(r, "send", sends[r], after)
            else:
                give(r, "send", sends[r], sends[r])
                give(r, "recv", poison(c, dt), result)
    elif kind in ("all_reduce", "reduce"):
        data = [_random(rng, dt, c) for _ in range(n)]
        total = _reduced(data, case)
        for r in range(n):
            if kind == "reduce" and r != root:
                give(r, "send", data[r], data[r])
            elif in_place:
                give(r, "recv", data[r], total)
            else:
                give(r, "send", data[r], data[r])
                give(r, "recv", poison(c, dt), total)
    elif kind == "all_to_all":
        sends = [_random(rng, dt, n * c) for _ in range(n)]
        for r in range(n):
            give(r, "send", sends[r], sends[r])
            give(r, "recv", poison(n * c, dt), np.concatenate([block(s, r) for s in sends]))
    elif kind == "broadcast":
        data = _random(rng, dt, c)
        for r in range(n):
            if r == root and in_place:
                give(r, "recv", data, data)
                continue
            if r == root:
                give(r, "send", data, data)
            give(r, "recv", poison(c, dt), data)
    elif kind == "gather":
        data = [_random(rng, dt, c) for _ in range(n)]
        for r in range(n):
            if r == root and in_place:
                recv = poison(n * c, dt)
                block(recv, r)[...] = data[r]
                give(r, "recv", recv, np.concatenate(data))
                continue
            give(r, "send", data[r], data[r])
            if r == root:
                give(r, "recv", poison(n * c, dt), np.concatenate(data))
    elif kind == "scatter":
        send = _random(rng, dt, n * c)
        for r in range(n):
            if r == root:
                give(r, "send", send, send)
            if r != root or not in_place:
                give(r, "recv", poison(c, dt), block(send, r).copy())
    elif kind == "sendrecv":
        data = _random(rng, dt, c)
        give(case.root, "send", data, data)
        give(case.peer, "recv", poison(c, dt), data)
    elif kind != "barrier":
        raise AssertionError(f"no reference for {kind}")
    return arrays, expected


# -- running a case -----------------------------------------------------------------------
def run_case(case: Case, seeds=(None, 1, 2), case_seed: int = 0) -> None:
    plan = build_plan(case.shape(), case.options())
    assert verify(plan) is plan
    rng = np.random.default_rng([SESSION_SEED, case_seed])
    for seed in seeds:
        arrays, expected = reference(case, rng)
        for rank in range(case.world_size):
            declared = {b.name: b.nbytes for b in plan.buffers[rank]
                        if b.name not in ("scratch", RING)}
            assert declared == {name: a.nbytes for name, a in arrays[rank].items()}, (
                f"{case.label()}: rank {rank} plan buffers {declared}, reference "
                f"{ {name: a.nbytes for name, a in arrays[rank].items()} }")
        simulate(plan, arrays, seed=seed)
        for rank in range(case.world_size):
            for name, wanted in expected[rank].items():
                assert_exact(f"{case.label()} (simulate seed {seed}, HOCCL_TEST_SEED="
                             f"{SESSION_SEED}): rank {rank} {name!r}", wanted,
                             arrays[rank][name])


# -- the grid -----------------------------------------------------------------------------
def _roots(kind: str, n: int) -> List[Tuple[int, int]]:
    """``(root, peer)`` pairs: first and last rank as root; sendrecv both directions."""
    if kind == "sendrecv":
        return sorted({(0, n - 1), (n - 1, 0), (0, 0)})
    if kind in ROOTED:
        return [(root, -1) for root in sorted({0, n - 1})]
    return [(0, -1)]


def _variants(kind: str) -> List[Tuple[bool, str]]:
    in_place = (False, True) if kind in IN_PLACE_FORMS else (False,)
    routes = ("peer", "local") if kind not in ("sendrecv", "barrier") else ("peer",)
    return [(ip, route) for ip in in_place for route in routes]


def _cases() -> List[Case]:
    cases: List[Case] = []
    turn = 0  # cycles dtypes, ops, chunk sizes and lane counts through the grid

    def add(kind, n, count, root, peer, in_place, route):
        nonlocal turn
        dtype = DTYPES[turn % len(DTYPES)]
        op = OPS[(turn // 3) % len(OPS)]
        chunk = (1, 2 * ITEMSIZE[dtype] + 1, 3 * ITEMSIZE[dtype], 1 << 20)[turn % 4]
        lanes = (None, None, 1, 2)[(turn // 2) % 4]
        cases.append(Case(kind, n, count, dtype, op, root, peer, in_place, route, chunk, lanes))
        turn += 1

    for n in range(1, 17):
        for kind in COLLECTIVES:
            # every option, on small counts (and on a few odd ones in small worlds)
            for count in (0, 1, 7, 13) if n <= 5 else (0, 1):
                for root, peer in _roots(kind, n):
                    for in_place, route in _variants(kind):
                        add(kind, n, count, root, peer, in_place, route)
            if n <= 5:
                continue
            # larger worlds: options in turn, on counts that do not divide evenly
            variants, roots = _variants(kind), _roots(kind, n)
            for index in range(4):
                in_place, route = variants[(n + index) % len(variants)]
                root, peer = roots[(n // 2 + index) % len(roots)]
                count = (3 * n + 2, 11, 2 * n - 1, 5)[(n + index) % 4]
                add(kind, n, count, root, peer, in_place, route)
    # one-shot all_reduce (one phase: every rank sums every input itself)
    for n in (2, 3, 4, 5, 8, 16):
        for count in (1, 7, 13, 3 * n + 2):
            for in_place in (False, True):
                dtype = DTYPES[turn % len(DTYPES)]
                op = OPS[(turn // 3) % len(OPS)]
                chunk = (1, 2 * ITEMSIZE[dtype] + 1, 1 << 20)[turn % 3]
                cases.append(Case("all_reduce", n, count, dtype, op, 0, -1, in_place, "local",
                                  chunk, (None, 1, 2)[turn % 3], one_shot_bytes=1 << 20))
                turn += 1
    # pulled reductions (the reduction reads the peers' inputs where they lie)
    for kind in ("reduce_scatter", "all_reduce", "reduce"):
        for n in (2, 3, 4, 5, 8, 16):
            for count in (1, 7, 3 * n + 2):
                for in_place in (False, True):
                    dtype = DTYPES[turn % len(DTYPES)]
                    op = OPS[(turn // 3) % len(OPS)]
                    chunk = (1, 2 * ITEMSIZE[dtype] + 1, 1 << 20)[turn % 3]
                    root = (0, n - 1)[turn % 2] if kind == "reduce" else 0
                    cases.append(Case(kind, n, count, dtype, op, root, -1, in_place, "local",
                                      chunk, (None, 1, 2)[turn % 3], pull_bytes=1 << 20))
                    turn += 1
    # direct kernels (one kernel per rank: the peers' memory read or written from SMs)
    for kind in KERNEL_COLLECTIVES:
        for n in (2, 3, 4, 5, 8):
            for count in (0, 1, 7, 3 * n + 2):
                for in_place in ((False, True) if kind in IN_PLACE_FORMS else (False,)):
                    dtype = DTYPES[turn % len(DTYPES)]
                    op = OPS[(turn // 3) % len(OPS)] if kind in REDUCING else "sum"
                    root = (0, n - 1)[turn % 2] if kind == "broadcast" else 0
                    cases.append(Case(kind, n, count, dtype, op, root, -1, in_place, "local",
                                      1 << 20, None, kernel_bytes=1 << 20))
                    turn += 1
    return cases


CASES = _cases()


@pytest.mark.parametrize("case_index", range(len(CASES)), ids=[c.label() for c in CASES])
def test_plan_verifies_and_simulates_to_the_reference(case_index):
    case = CASES[case_index]
    seeds = (None, 1, 2) if case.world_size <= 8 else (None, 3)
    run_case(case, seeds=seeds, case_seed=case_index)


def test_grid_covers_every_collective_dtype_op_and_option():
    assert {c.collective for c in CASES} == set(COLLECTIVES)
    assert {c.dtype for c in CASES} == set(DTYPES)
    assert {c.op for c in CASES if c.collective in REDUCING} == set(OPS)
    assert {c.world_size for c in CASES} == set(range(1, 17))
    for kind in IN_PLACE_FORMS:
        assert {c.in_place for c in CASES if c.collective == kind} == {False, True}, kind
    for kind in ROOTED:
        assert any(c.root == c.world_size - 1 > 0 for c in CASES if c.collective == kind), kind
    assert {c.self_route for c in CASES} == {"peer", "local"}
    one_shot = [c for c in CASES if c.one_shot_bytes]
    assert {c.in_place for c in one_shot} == {False, True} and len(one_shot) >= 40
    pulled = [c for c in CASES if c.pull_bytes]
    assert {(c.collective, c.in_place) for c in pulled} == {
        (kind, in_place) for kind in REDUCING for in_place in (False, True)}
    direct = [c for c in CASES if c.kernel_bytes]
    assert {(c.collective, c.in_place) for c in direct} == {
        (kind, in_place) for kind in KERNEL_COLLECTIVES
        for in_place in ((False, True) if kind in IN_PLACE_FORMS else (False,))}
    assert all(c.shape() and build_plan(c.shape(), c.options()).kernel_blocks for c in direct)


def test_pulled_reductions_read_the_peers_inputs_below_their_threshold_only():
    """Under ``pull_bytes`` (the input's bytes: n blocks of a reduce_scatter) nothing is
    copied into scratch and each sum reads every rank's input where it lies; above it the
    peers push into scratch as ever."""
    from hoccl.sched.plan import Copy, Reduce
    options = Options(pull_bytes=4096)
    for kind, count, pulled in (("reduce_scatter", 256, True), ("reduce_scatter", 257, False),
                                ("all_reduce", 1024, True), ("all_reduce", 1025, False),
                                ("reduce", 1024, True), ("reduce", 1025, False)):
        plan = build_plan(Shape(kind, 4, count, "float32", 4, root=2), options)
        verify(plan)
        scratch = [spec for buffers in plan.buffers for spec in buffers if spec.name == "scratch"]
        into_scratch = [step for program in plan.programs for step in program
                        if isinstance(step, Copy) and step.dst.buffer == "scratch"]
        remote_reads = [ref for r, program in enumerate(plan.programs) for step in program
                        if isinstance(step, Reduce) for ref in step.inputs if ref.rank != r]
        assert (not scratch and not into_scratch and remote_reads) if pulled else \
            (scratch and into_scratch and not remote_reads), (kind, count)
    # a one-shot all_reduce keeps its push
    plan = build_plan(Shape("all_reduce", 4, 64, "float32", 4),
                      Options(pull_bytes=4096, one_shot_bytes=4096))
    assert any(spec.name == "scratch" for spec in plan.buffers[0])
    with pytest.raises(Exception, match="pull_bytes"):
        Options(pull_bytes=-1)


def test_one_shot_all_reduce_is_one_phase_below_its_threshold_only():
    """Under ``one_shot_bytes`` every rank sums every element itself and nothing is
    gathered; above it the two-phase plan (each rank sums its share, then gathers)."""
    from hoccl.sched.plan import GATHERED, Reduce, Signal
    options = Options(one_shot_bytes=4096)
    for count, one_shot in ((1024, True), (1025, False)):
        plan = build_plan(Shape("all_reduce", 4, count, "float32", 4), options)
        summed = [sum(step.count for step in program if isinstance(step, Reduce))
                  for program in plan.programs]
        gathered = any(isinstance(step, Signal) and step.slot % CHANNELS == GATHERED
                       for program in plan.programs for step in program)
        assert summed == ([count] * 4 if one_shot else [257, 256, 256, 256]), summed
        assert gathered is not one_shot
    with pytest.raises(Exception, match="one_shot_bytes"):
        Options(one_shot_bytes=-1)


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 16])
def test_barrier_makes_every_rank_wait_for_every_peers_ready(world_size):
    plan = verify(build_plan(Shape("barrier", world_size, 0)))
    for rank, program in enumerate(plan.programs):
        waited = {step.slot // CHANNELS for step in program
                  if isinstance(step, Wait) and step.slot % CHANNELS == READY}
        assert waited == set(range(world_size)) - {rank}
    assert simulate(plan, [{} for _ in range(world_size)], seed=world_size) == [{}] * world_size


@st.composite
def _random_cases(draw):
    kind = draw(st.sampled_from(COLLECTIVES))
    n = draw(st.integers(1, 8))
    root = draw(st.integers(0, n - 1))
    peer = draw(st.integers(0, n - 1)) if kind == "sendrecv" else -1
    dtype = draw(st.sampled_from(DTYPES))
    return Case(kind, n, draw(st.integers(0, 40)), dtype, draw(st.sampled_from(OPS)),
                root if kind in ROOTED else 0, peer,
                draw(st.booleans()) and kind in IN_PLACE_FORMS,
                draw(st.sampled_from(("peer", "local"))),
                draw(st.integers(1, 8 * ITEMSIZE[dtype])),
                draw(st.sampled_from((None, 1, 2, 3, 4))))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_random_cases(), seed=st.integers(0, 2 ** 16))
def test_random_shapes_simulate_to_the_reference(case, seed):
    run_case(case, seeds=(seed,), case_seed=seed)
