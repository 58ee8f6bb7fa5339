"""Pipelined hierarchical plans: a call cut into chunks whose phases overlap.

``pipeline_hierarchical(shape, topology, chunk)`` cuts an all_reduce, broadcast or
reduce (one block of ``count`` elements on every rank) into chunks of ``chunk``
elements, each a hierarchical plan of its own on its slice of the caller's buffers
(and a scratch of its own); an all_gather or reduce_scatter across hosts of several
ranks into one chunk per host (``build_host_share``: the blocks of that host, a rail
broadcast then a host all_gather, or a host reduce_scatter then a rail reduce), whose
regions lie where the whole call's do.  It orders every chunk's phases along the
diagonals of the pipeline::

    time        0      1      2      3      4
    host      RS c0  RS c1  RS c2  AG c0  AG c1 ...    (all_reduce: reduce_scatter in
    rail             AR c0  AR c1  AR c2         ...     the host, all_reduce across
                                                          hosts, all_gather in the host)

``program(rank)`` lists the rank's (chunk, phase) steps in that order, sorted by
(chunk + phase, phase): every rank takes its steps of one level in the same order, and
a step comes after the step of its chunk's previous phase.  A runtime that runs each
level's steps in that order on a worker of its own, each step after its chunk's
previous phase, overlaps chunk k+1's first phase with chunk k's second and chunk k−1's
third; no wait can form a cycle, because the earliest unfinished step in this order is
always runnable on every rank.  ``flatten()`` is the same steps as one sequential plan
(chunk after chunk): ``verify_pipelined`` proves it with ``verify_hierarchical`` and
checks that the members of every group make the same calls in the same order at every
level, as the workers will make them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from .._errors import PlanError
from ._hierarchical_build import build_hierarchical, build_host_share
from ._hierarchical_check import verify_hierarchical
from ._hierarchical_plan import (BufferLayout, Call, Divide, HierarchicalPlan, Phase, Region,
                                 Step, Topology)
from .algorithms import Shape

__all__ = ["PIPELINED", "BY_HOST", "PipelinedStep", "PipelinedPlan", "pipeline_hierarchical",
           "verify_pipelined"]

#: the collectives that can be cut into chunks of elements: one block of ``count`` on
#: every rank
PIPELINED = ("all_reduce", "broadcast", "reduce")
#: the collectives cut into one chunk per host
BY_HOST = ("all_gather", "reduce_scatter")


@dataclass(frozen=True)
class PipelinedStep:
    """One rank's steps of phase ``phase`` of chunk ``chunk``, at ``level``, with regions
    of the whole call's buffers."""
    chunk: int
    phase: int
    level: str
    steps: Tuple[Step, ...]


@dataclass(frozen=True)
class PipelinedPlan:
    """A call cut into ``chunks``, one hierarchical plan each: a chunk's (start, stop) is
    the element range of the caller's buffers its plan covers, its regions shifted by
    ``start`` (a host's share of an all_gather or reduce_scatter: (0, count), unshifted)."""
    shape: Shape
    topology: Topology
    chunks: Tuple[Tuple[int, int], ...]
    plans: Tuple[HierarchicalPlan, ...]

    def _scratch_bases(self, rank: int) -> List[int]:
        bases, at = [], 0
        for plan in self.plans:
            bases.append(at)
            at += plan.scratch_count(rank)
        return bases

    def scratch_count(self, rank: int) -> int:
        """Elements of scratch ``rank`` needs: every chunk's, side by side."""
        return sum(plan.scratch_count(rank) for plan in self.plans)

    def _shifted(self, rank: int, chunk: int, steps: Tuple[Step, ...]) -> Tuple[Step, ...]:
        start = self.chunks[chunk][0]
        scratch = self._scratch_bases(rank)[chunk]

        def move(region: Optional[Region]) -> Optional[Region]:
            if region is None:
                return None
            offset = scratch if region.buffer == "scratch" else start
            return Region(region.buffer, region.start + offset, region.count)
        moved: List[Step] = []
        for step in steps:
            if isinstance(step, Divide):
                region = move(step.region)
                assert region is not None
                moved.append(Divide(region, step.divisor))
            else:
                moved.append(Call(step.shape, move(step.send), move(step.recv)))
        return tuple(moved)

    def program(self, rank: int) -> List[PipelinedStep]:
        """``rank``'s steps in pipeline order (the module docstring)."""
        entries = []
        for chunk, plan in enumerate(self.plans):
            for phase, item in enumerate(plan.phases):
                if item.steps[rank]:
                    entries.append(PipelinedStep(chunk, phase, item.level,
                                                 self._shifted(rank, chunk, item.steps[rank])))
        return sorted(entries, key=lambda entry: (entry.chunk + entry.phase, entry.phase))

    def flatten(self) -> HierarchicalPlan:
        """The same steps as one sequential plan: chunk 0's phases, then chunk 1's..."""
        n = self.topology.world_size
        phases = []
        for chunk, plan in enumerate(self.plans):
            for item in plan.phases:
                phases.append(Phase(item.level, tuple(
                    self._shifted(rank, chunk, item.steps[rank]) for rank in range(n))))
        whole = build_hierarchical(self.shape, self.topology)
        buffers = []
        for rank in range(n):
            layouts = tuple(layout for layout in whole.buffers[rank] if layout.name != "scratch")
            if self.scratch_count(rank):
                layouts += (BufferLayout("scratch", self.scratch_count(rank)),)
            buffers.append(layouts)
        return HierarchicalPlan(self.shape, self.topology, tuple(buffers), tuple(phases))


@lru_cache(maxsize=256)
def pipeline_hierarchical(shape: Shape, topology: Topology, chunk: int) -> PipelinedPlan:
    """``shape`` (one of ``PIPELINED``) cut into chunks of ``chunk`` elements (the last
    takes the rest); one of ``BY_HOST`` into one chunk per host (``chunk`` unused; on one
    host, or one rank per host, the whole plan is the one chunk).  Cached."""
    if shape.collective not in PIPELINED + BY_HOST:
        raise ValueError(f"pipeline_hierarchical: collective must be one of "
                         f"{PIPELINED + BY_HOST}; got {shape.collective!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"pipeline_hierarchical: chunk must be a positive int; got {chunk!r}")
    if shape.collective in BY_HOST:
        if topology.hosts == 1 or topology.local_size == 1:
            return PipelinedPlan(shape, topology, ((0, shape.count),),
                                 (build_hierarchical(shape, topology),))
        return PipelinedPlan(shape, topology, ((0, shape.count),) * topology.hosts,
                             tuple(build_host_share(shape, topology, host)
                                   for host in range(topology.hosts)))
    ranges = tuple((start, min(shape.count, start + chunk))
                   for start in range(0, shape.count, chunk)) or ((0, 0),)
    plans = tuple(build_hierarchical(shape._replace(count=stop - start), topology)
                  for start, stop in ranges)
    return PipelinedPlan(shape, topology, ranges, plans)


def _signature(step: Step) -> tuple:
    if isinstance(step, Divide):
        return ("divide", step.divisor)
    s = step.shape
    return (s.collective, s.world_size, s.count, s.dtype, s.op, s.root, s.peer)


def verify_pipelined(plan: PipelinedPlan) -> None:
    """Prove ``plan`` or raise ``PlanError``: its flattened form passes
    ``verify_hierarchical`` (every chunk's regions valid, disjoint from the other
    chunks', every output written), and at every level the members of each group take
    the same steps in the same order in ``program``, each after its chunk's previous
    phase."""
    verify_hierarchical(plan.flatten())
    topology = plan.topology
    programs = [plan.program(rank) for rank in range(topology.world_size)]
    for rank, program in enumerate(programs):
        reached: Dict[int, int] = {}
        for entry in program:
            if reached.get(entry.chunk, -1) >= entry.phase:
                raise PlanError(f"verify_pipelined: rank {rank} takes phase {entry.phase} of "
                                f"chunk {entry.chunk} after a later one")
            reached[entry.chunk] = entry.phase
    for level in ("host", "rail", "world"):
        for group in topology.groups(level):
            sequences = {rank: [(entry.chunk, entry.phase) + tuple(map(_signature, entry.steps))
                                for entry in programs[rank] if entry.level == level]
                         for rank in group}
            active = [rank for rank in group if sequences[rank]]
            for rank in active[1:]:
                if sequences[rank] != sequences[active[0]]:
                    raise PlanError(f"verify_pipelined: at the {level} level rank {rank} "
                                    f"takes {sequences[rank][:3]}... but rank {active[0]} "
                                    f"{sequences[active[0]][:3]}...")
