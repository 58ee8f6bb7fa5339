"""Checking hierarchical plans (``hoccl.sched.hierarchical``): ``verify_hierarchical`` proves
a plan, ``simulate_hierarchical`` runs it on numpy."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import numpy_dtype, reduce_arrays
from .._errors import PlanError
from ._hierarchical_plan import (LEVELS, Call, Divide, HierarchicalPlan, Phase, Region, _COPYING,
                                 _ROOTED)
from .algorithms import Options, Shape, build_plan
from .simulate import SCRATCH_FILL, simulate
from .verify import verify

__all__ = ["verify_hierarchical", "simulate_hierarchical", "divide_in_place"]


def _fail(plan: HierarchicalPlan, message: str) -> NoReturn:
    s = plan.shape
    raise PlanError(f"verify_hierarchical: {s.collective} on {plan.topology.hosts}x"
                    f"{plan.topology.local_size}: {message}")


def _signature(shape: Shape) -> tuple:
    return (shape.collective, shape.world_size, shape.count, shape.dtype, shape.op, shape.root,
            shape.peer)


def _participants(shape: Shape) -> Tuple[int, ...]:
    if shape.collective == "sendrecv":
        return (shape.root, shape.peer)
    return tuple(range(shape.world_size))


def _accesses(plan: HierarchicalPlan, where: str, call: Call, index: int
              ) -> Tuple[List[Region], List[Region]]:
    """What ``call`` reads and writes on the member numbered ``index``, after checking that
    its regions have the sizes and the in-place form its collective requires."""
    s, send, recv = call.shape, call.send, call.recv
    c, g, kind = s.count, s.world_size, s.collective
    is_root = index == s.root

    def need(region: Optional[Region], count: int, name: str) -> Region:
        if region is None or region.count != count:
            _fail(plan, f"{where}: {kind} needs a {name} of {count} elements; got {region}")
        return region

    def disjoint(a: Region, b: Region) -> None:
        if a.overlaps(b):
            _fail(plan, f"{where}: {kind} out of place, but send {a} overlaps recv {b}")

    def but(region: Region, own: Region) -> List[Region]:
        return [Region(region.buffer, region.start, own.start - region.start),
                Region(region.buffer, own.stop, region.stop - own.stop)]

    def in_place_as(inner: Region, expected: Region) -> None:
        if inner != expected:
            _fail(plan, f"{where}: {kind} in place needs {expected}; got {inner}")

    if kind in ("all_gather", "gather") and (kind == "all_gather" or is_root):
        send, recv = need(send, c, "send"), need(recv, g * c, "recv")
        own = recv.block(index, c)
        if s.in_place:
            in_place_as(send, own)
            return [send], but(recv, own)
        disjoint(send, recv)
        return [send], [recv]
    if kind == "gather":
        return [need(send, c, "send")], []
    if kind in ("reduce_scatter", "scatter") and (kind == "reduce_scatter" or is_root):
        send, recv = need(send, g * c, "send"), need(recv, c, "recv")
        if s.in_place:
            in_place_as(recv, send.block(index, c))
            return [send], ([recv] if kind == "reduce_scatter" else [])
        disjoint(send, recv)
        return [send], [recv]
    if kind == "scatter":
        return [], [need(recv, c, "recv")]
    if kind in ("all_reduce", "reduce"):
        send = need(send, c, "send")
        if kind == "reduce" and not is_root:
            return [send], []
        recv = need(recv, c, "recv")
        if s.in_place:
            in_place_as(recv, send)
        else:
            disjoint(send, recv)
        return [send], [recv]
    if kind == "all_to_all":
        send, recv = need(send, g * c, "send"), need(recv, g * c, "recv")
        disjoint(send, recv)
        return [send], [recv]
    if kind == "broadcast":
        recv = need(recv, c, "recv")
        if not is_root:
            return [], [recv]
        send = need(send, c, "send")
        if s.in_place:
            in_place_as(recv, send)
            return [send], []
        disjoint(send, recv)
        return [send], [recv]
    if kind == "sendrecv":
        if index == s.root:
            return [need(send, c, "send")], []
        return [], [need(recv, c, "recv")]
    return [], []  # barrier


def _check_groups(plan: HierarchicalPlan, number: int, phase: Phase) -> None:
    """The members of each group at the phase's level make the same calls, in the same
    order, each as its member number requires."""
    topology = plan.topology
    for group in topology.groups(phase.level):
        lists = {rank: phase.steps[rank] for rank in group}
        if phase.level == "local":
            for rank, steps in lists.items():
                if any(not isinstance(step, Divide) for step in steps):
                    _fail(plan, f"phase {number}: rank {rank} makes a call at the local level")
            continue
        active = [rank for rank in group if lists[rank]]
        if not active:
            continue
        reference = lists[active[0]]
        expected: set = set()
        for call in reference:
            if not isinstance(call, Call):
                _fail(plan, f"phase {number}: a Divide at the {phase.level} level")
            if call.shape.world_size != len(group):
                _fail(plan, f"phase {number}: {call} on a group of {len(group)} ranks")
            if not all(0 <= member < len(group) for member in _participants(call.shape)):
                _fail(plan, f"phase {number}: {call} names a member outside the group")
            expected.update(group[member] for member in _participants(call.shape))
        if set(active) != expected:
            _fail(plan, f"phase {number} ({phase.level}): ranks {sorted(active)} make calls "
                        f"but the calls' participants are {sorted(expected)}")
        mine = [_signature(call.shape) for call in reference if isinstance(call, Call)]
        for rank in active:
            theirs = [_signature(step.shape) for step in lists[rank]
                      if isinstance(step, Call)]
            if theirs != mine or len(theirs) != len(lists[rank]):
                _fail(plan, f"phase {number} ({phase.level}): rank {rank} calls {theirs} but "
                            f"rank {active[0]} calls {mine}")


@lru_cache(maxsize=1024)
def _verify_call(shape: Shape) -> None:
    """Prove the plan of one call (once per distinct call)."""
    verify(build_plan(shape, Options()))


def verify_hierarchical(plan: HierarchicalPlan, *, sub_plans: bool = True) -> None:
    """Prove ``plan`` or raise ``PlanError``:

    * in every phase, the members of each group make the same calls in the same order
      (so no phase can wait for a call that never comes), each call's regions have the
      sizes and in-place forms its collective requires and lie inside the rank's buffers;
    * the steps of one phase on one rank touch disjoint memory (they may run side by
      side), no step reads an element that is neither an input nor written in an earlier
      phase, no step writes an element that holds only the caller's input;
    * every output element is written; those of copying collectives exactly once;
    * (``sub_plans``) the plan of every distinct call is proved by ``verify``.
    """
    topology, shape = plan.topology, plan.shape
    if len(plan.buffers) != topology.world_size:
        _fail(plan, f"{len(plan.buffers)} ranks' buffers for a world of {topology.world_size}")
    defined: List[Dict[str, np.ndarray]] = []
    protected: List[Dict[str, np.ndarray]] = []
    writes: List[Dict[str, np.ndarray]] = []
    for rank, layouts in enumerate(plan.buffers):
        defined.append({})
        protected.append({})
        writes.append({})
        for layout in layouts:
            inputs = np.zeros(layout.count, bool)
            outputs = np.zeros(layout.count, bool)
            for start, stop in layout.inputs:
                inputs[start:stop] = True
            for start, stop in layout.outputs:
                outputs[start:stop] = True
            defined[rank][layout.name] = inputs.copy()
            protected[rank][layout.name] = inputs & ~outputs
            writes[rank][layout.name] = np.zeros(layout.count, np.int64)

    def inside(rank: int, region: Region, where: str) -> None:
        sizes = {layout.name: layout.count for layout in plan.buffers[rank]}
        if region.buffer not in sizes or region.start < 0 or region.stop > sizes[region.buffer]:
            _fail(plan, f"{where}: {region} lies outside rank {rank}'s buffers {sizes}")

    for number, phase in enumerate(plan.phases):
        if phase.level not in LEVELS:
            _fail(plan, f"phase {number}: unknown level {phase.level!r}")
        _check_groups(plan, number, phase)
        for rank, steps in enumerate(phase.steps):
            touched: List[Tuple[int, List[Region], List[Region]]] = []
            for position, step in enumerate(steps):
                where = f"phase {number} rank {rank} step {position} ({step})"
                if isinstance(step, Divide):
                    reads, written = [step.region], [step.region]
                    if step.divisor < 1:
                        _fail(plan, f"{where}: divisor must be positive")
                else:
                    index = topology.index_in(phase.level, rank)
                    reads, written = _accesses(plan, where, step, index)
                    if sub_plans:
                        _verify_call(step.shape)
                for region in reads + written:
                    inside(rank, region, where)
                for region in reads:
                    if not defined[rank][region.buffer][region.start:region.stop].all():
                        _fail(plan, f"{where}: reads {region}, part of which holds nothing yet")
                for region in written:
                    if protected[rank][region.buffer][region.start:region.stop].any():
                        _fail(plan, f"{where}: writes {region}, which holds only the caller's "
                                    f"input")
                for other, other_reads, other_writes in touched:
                    for mine in written:
                        if any(mine.overlaps(theirs) for theirs in other_reads + other_writes):
                            _fail(plan, f"{where}: writes {mine}, which step {other} of the "
                                        f"same phase touches")
                    for mine in reads:
                        if any(mine.overlaps(theirs) for theirs in other_writes):
                            _fail(plan, f"{where}: reads {mine}, which step {other} of the "
                                        f"same phase writes")
                touched.append((position, reads, written))
            for _, _, written in touched:
                for region in written:
                    defined[rank][region.buffer][region.start:region.stop] = True
                    writes[rank][region.buffer][region.start:region.stop] += 1
    copying = shape.collective in _COPYING
    for rank, layouts in enumerate(plan.buffers):
        for layout in layouts:
            for start, stop in layout.outputs:
                counts = writes[rank][layout.name][start:stop]
                if (counts == 0).any():
                    missing = start + int(np.flatnonzero(counts == 0)[0])
                    _fail(plan, f"rank {rank}'s {layout.name}[{missing}] is an output that "
                                f"no step writes")
                if copying and (counts > 1).any():
                    twice = start + int(np.flatnonzero(counts > 1)[0])
                    _fail(plan, f"rank {rank}'s {layout.name}[{twice}] is written "
                                f"{int(counts.max())} times")


# -- simulating ---------------------------------------------------------------------------
def divide_in_place(values: np.ndarray, divisor: int) -> None:
    """``values /= divisor`` as "avg" divides: integers truncate toward zero, 16-bit
    floats divide in float32."""
    if values.dtype.kind in "iu":
        wide = values.astype(np.int64)
        values[...] = (np.sign(wide) * (np.abs(wide) // divisor)).astype(values.dtype)
    else:
        values[...] = (values.astype(np.float32 if values.itemsize == 2 else values.dtype)
                       / divisor).astype(values.dtype)


def _apply(shape: Shape, send: List[Any], recv: List[Any]) -> None:
    """One call's definition on its members' arrays (member i: ``send[i]``, ``recv[i]``),
    the reference ``simulate_hierarchical`` checks the calls' own plans against."""
    g, c, kind, root = shape.world_size, shape.count, shape.collective, shape.root
    dtype = numpy_dtype(shape.dtype)
    inputs: List[Any] = [None if x is None else x.copy() for x in send]  # in place: aliases

    def reduced(parts: List[np.ndarray]) -> np.ndarray:
        return reduce_arrays(parts, shape.op, dtype)
    if kind in ("all_gather", "gather"):
        for i in (range(g) if kind == "all_gather" else [root]):
            recv[i][...] = np.concatenate(inputs)
    elif kind == "reduce_scatter":
        for i in range(g):
            recv[i][...] = reduced([x[i * c:(i + 1) * c] for x in inputs])
    elif kind in ("all_reduce", "reduce"):
        for i in (range(g) if kind == "all_reduce" else [root]):
            recv[i][...] = reduced(inputs)
    elif kind == "all_to_all":
        for i in range(g):
            for j in range(g):
                recv[i][j * c:(j + 1) * c] = inputs[j][i * c:(i + 1) * c]
    elif kind in ("broadcast", "scatter"):
        for i in range(g):
            recv[i][...] = inputs[root] if kind == "broadcast" else inputs[root][i * c:(i + 1) * c]
    elif kind == "sendrecv":
        recv[shape.peer][...] = inputs[root]


def simulate_hierarchical(plan: HierarchicalPlan, arrays: Sequence[Dict[str, np.ndarray]], *,
                          seed: Optional[int] = None,
                          calls: str = "plans") -> List[Dict[str, np.ndarray]]:
    """Run ``plan`` on numpy arrays in place (``arrays[rank]``: "send" / "recv" as the plan
    names them, flat, of the shape's dtype) and return them with each rank's scratch.

    Phases run in order; a Divide divides its region; each call of a group runs, with
    ``calls="plans"``, as ``simulate`` of that call's own plan (``build_plan(call.shape)``,
    the plan the level's hoccl communicator runs; in a random legal order when ``seed``
    is given) on its members' regions, or with ``calls="definitions"`` as the
    collective's definition on numpy (fast: for worlds whose per-call plans are too
    large to interpret step by step).  Scratch starts poisoned."""
    if calls not in ("plans", "definitions"):
        raise ValueError(f"simulate_hierarchical: calls must be 'plans' or 'definitions'; "
                         f"got {calls!r}")
    dtype = numpy_dtype(plan.shape.dtype)
    memory: List[Dict[str, np.ndarray]] = []
    for rank in range(plan.topology.world_size):
        given = {name: np.asarray(array).reshape(-1) for name, array in arrays[rank].items()}
        count = plan.scratch_count(rank)
        if count:
            given["scratch"] = np.full(count * dtype.itemsize, SCRATCH_FILL,
                                       np.uint8).view(dtype)
        memory.append(given)

    def view(rank: int, region: Optional[Region]) -> Any:
        if region is None:
            return None
        return memory[rank][region.buffer][region.start:region.stop]

    for number, phase in enumerate(plan.phases):
        if phase.level == "local":
            for rank, steps in enumerate(phase.steps):
                for step in steps:
                    assert isinstance(step, Divide)
                    divide_in_place(view(rank, step.region), step.divisor)
            continue
        for group in plan.topology.groups(phase.level):
            members = [rank for rank in group if phase.steps[rank]]
            if not members:
                continue
            for position in range(len(phase.steps[members[0]])):
                made: Dict[int, Call] = {}
                for rank in members:
                    step = phase.steps[rank][position]
                    assert isinstance(step, Call)
                    made[rank] = step
                first = made[members[0]].shape
                owner = group[first.root] if first.collective in _ROOTED else members[0]
                shape = made[owner].shape
                if calls == "definitions":
                    _apply(shape, [view(rank, made[rank].send) if rank in made else None
                                   for rank in group],
                           [view(rank, made[rank].recv) if rank in made else None
                            for rank in group])
                    continue
                local: List[Dict[str, np.ndarray]] = [{} for _ in group]
                for rank, step in made.items():
                    for name, region in (("send", step.send), ("recv", step.recv)):
                        if region is not None:
                            local[group.index(rank)][name] = view(rank, region)
                simulate(build_plan(shape, Options()), local,
                         seed=None if seed is None else seed + number)
    return memory
