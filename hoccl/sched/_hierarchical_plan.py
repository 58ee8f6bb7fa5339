"""The types of hierarchical plans (``hoccl.sched.hierarchical``): the topology, regions,
calls and phases, and the regions of the caller's buffers per collective."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

from .algorithms import Shape

__all__ = ["Topology", "Region", "Call", "Divide", "Phase", "BufferLayout", "HierarchicalPlan",
           "Step", "LEVELS"]

LEVELS = ("host", "rail", "world", "local")
#: collectives whose outputs are copies: every output element is written exactly once
_COPYING = ("all_gather", "all_to_all", "broadcast", "gather", "scatter", "sendrecv")
_ROOTED = ("broadcast", "reduce", "gather", "scatter")


@dataclass(frozen=True)
class Topology:
    """``hosts`` hosts of ``local_size`` ranks each; rank = host * local_size + local."""
    hosts: int
    local_size: int

    def __post_init__(self) -> None:
        for name in ("hosts", "local_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology: {name} must be a positive int; got {value!r}")

    @property
    def world_size(self) -> int:
        return self.hosts * self.local_size

    def rank(self, host: int, local: int) -> int:
        return host * self.local_size + local

    def host_of(self, rank: int) -> int:
        return rank // self.local_size

    def local_of(self, rank: int) -> int:
        return rank % self.local_size

    def groups(self, level: str) -> List[Tuple[int, ...]]:
        """The groups of ranks that call together at ``level``, each in member order."""
        if level == "host":
            return [tuple(self.rank(h, l) for l in range(self.local_size))
                    for h in range(self.hosts)]
        if level == "rail":
            return [tuple(self.rank(h, l) for h in range(self.hosts))
                    for l in range(self.local_size)]
        if level == "world":
            return [tuple(range(self.world_size))]
        return [(rank,) for rank in range(self.world_size)]

    def index_in(self, level: str, rank: int) -> int:
        """``rank``'s member number in its group at ``level``."""
        return {"host": self.local_of(rank), "rail": self.host_of(rank), "world": rank,
                "local": 0}[level]


@dataclass(frozen=True)
class Region:
    """Elements ``[start, start + count)`` of one of a rank's buffers."""
    buffer: str
    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count

    def block(self, index: int, count: int) -> "Region":
        """Elements ``[index*count, (index+1)*count)`` of this region."""
        return Region(self.buffer, self.start + index * count, count)

    def overlaps(self, other: "Region") -> bool:
        return (self.buffer == other.buffer and self.count > 0 and other.count > 0
                and self.start < other.stop and other.start < self.stop)

    def __str__(self) -> str:
        return f"{self.buffer}[{self.start}:{self.stop}]"


@dataclass(frozen=True)
class Call:
    """One collective (or one side of a send/recv) of the rank's group at the phase's
    level.  ``shape`` is the call as that group's communicator sees it: world size, root
    and peer are member numbers in the group."""
    shape: Shape
    send: Optional[Region]
    recv: Optional[Region]

    def __str__(self) -> str:
        s = self.shape
        extra = (f" root={s.root}" if s.collective in _ROOTED else
                 f" {s.root}->{s.peer}" if s.collective == "sendrecv" else "")
        op = f" op={s.op}" if s.collective in ("reduce_scatter", "all_reduce", "reduce") else ""
        form = " in place" if s.in_place else ""
        return (f"{s.collective}(world {s.world_size}, count {s.count}{extra}{op}{form}) "
                f"send={self.send} recv={self.recv}")


@dataclass(frozen=True)
class Divide:
    """``region /= divisor`` element-wise (integers truncate toward zero, as "avg" does)."""
    region: Region
    divisor: int

    def __str__(self) -> str:
        return f"divide {self.region} by {self.divisor}"


Step = Union[Call, Divide]


@dataclass(frozen=True)
class Phase:
    """Every rank's steps of one phase (``steps[rank]``, possibly empty), at ``level``."""
    level: str
    steps: Tuple[Tuple[Step, ...], ...]


@dataclass(frozen=True)
class BufferLayout:
    """One buffer of one rank, in elements: ``inputs`` hold the caller's data on entry,
    ``outputs`` must hold the result on exit (ranges ``(start, stop)``)."""
    name: str
    count: int
    inputs: Tuple[Tuple[int, int], ...] = ()
    outputs: Tuple[Tuple[int, int], ...] = ()


@dataclass(frozen=True)
class HierarchicalPlan:
    """A collective over ``topology``: each rank's buffers and the phases."""
    shape: Shape
    topology: Topology
    buffers: Tuple[Tuple[BufferLayout, ...], ...]
    phases: Tuple[Phase, ...]

    def buffer(self, rank: int, name: str) -> BufferLayout:
        for layout in self.buffers[rank]:
            if layout.name == name:
                return layout
        raise KeyError(f"HierarchicalPlan.buffer: rank {rank} has no buffer {name!r}")

    def scratch_count(self, rank: int) -> int:
        """Elements of scratch ``rank`` needs (0: none)."""
        return next((layout.count for layout in self.buffers[rank] if layout.name == "scratch"),
                    0)

    def program(self, rank: int) -> List[Tuple[str, Tuple[Step, ...]]]:
        """``rank``'s (level, steps) per phase it takes part in, in order."""
        return [(phase.level, phase.steps[rank]) for phase in self.phases if phase.steps[rank]]

    def describe(self) -> str:
        s, t = self.shape, self.topology
        lines = [f"hierarchical {s.collective} {t.hosts} hosts x {t.local_size} ranks, count "
                 f"{s.count} {s.dtype} op={s.op} root={s.root} in_place={s.in_place}"]
        for index, phase in enumerate(self.phases):
            lines.append(f" phase {index} ({phase.level})")
            for rank, steps in enumerate(phase.steps):
                lines.extend(f"   rank {rank}: {step}" for step in steps)
        return "\n".join(lines)


# -- the caller's buffers -----------------------------------------------------------------
def _caller_buffers(shape: Shape, rank: int) -> Tuple[BufferLayout, ...]:
    """``rank``'s send and recv as the single-host plans lay them out: an in-place call
    has one buffer, named for the larger of the two."""
    n, c, kind, ip = shape.world_size, shape.count, shape.collective, shape.in_place
    root = rank == shape.root
    own = (rank * c, (rank + 1) * c)
    everything_but_own = ((0, rank * c), ((rank + 1) * c, n * c))
    if kind == "all_gather":
        if ip:
            return (BufferLayout("recv", n * c, (own,), everything_but_own),)
        return BufferLayout("send", c, ((0, c),)), BufferLayout("recv", n * c, (), ((0, n * c),))
    if kind == "reduce_scatter":
        if ip:
            return (BufferLayout("send", n * c, ((0, n * c),), (own,)),)
        return BufferLayout("send", n * c, ((0, n * c),)), BufferLayout("recv", c, (), ((0, c),))
    if kind == "all_reduce" or (kind == "reduce" and root):
        if ip:
            return (BufferLayout("recv", c, ((0, c),), ((0, c),)),)
        return BufferLayout("send", c, ((0, c),)), BufferLayout("recv", c, (), ((0, c),))
    if kind == "reduce":
        return (BufferLayout("send", c, ((0, c),)),)
    if kind == "all_to_all":
        return (BufferLayout("send", n * c, ((0, n * c),)),
                BufferLayout("recv", n * c, (), ((0, n * c),)))
    if kind == "broadcast":
        if root and ip:
            return (BufferLayout("recv", c, ((0, c),)),)
        if root:
            return BufferLayout("send", c, ((0, c),)), BufferLayout("recv", c, (), ((0, c),))
        return (BufferLayout("recv", c, (), ((0, c),)),)
    if kind == "gather":
        if root and ip:
            return (BufferLayout("recv", n * c, (own,), everything_but_own),)
        if root:
            return BufferLayout("send", c, ((0, c),)), BufferLayout("recv", n * c, (), ((0, n * c),))
        return (BufferLayout("send", c, ((0, c),)),)
    if kind == "scatter":
        if root and ip:
            return (BufferLayout("send", n * c, ((0, n * c),)),)
        if root:
            return (BufferLayout("send", n * c, ((0, n * c),)),
                    BufferLayout("recv", c, (), ((0, c),)))
        return (BufferLayout("recv", c, (), ((0, c),)),)
    if kind == "sendrecv":
        if rank == shape.root:
            return (BufferLayout("send", c, ((0, c),)),)
        if rank == shape.peer:
            return (BufferLayout("recv", c, (), ((0, c),)),)
        return ()
    return ()  # barrier


def _both(shape: Shape, rank: int) -> Tuple[Region, Region]:
    """``_caller_regions`` of a rank that has both (every rank of a non-rooted call)."""
    send, recv = _caller_regions(shape, rank)
    assert send is not None and recv is not None
    return send, recv


def _caller_regions(shape: Shape, rank: int) -> Tuple[Optional[Region], Optional[Region]]:
    """``rank``'s (send, recv) as the regions of the whole call (a flat plan's call)."""
    n, c, kind, ip = shape.world_size, shape.count, shape.collective, shape.in_place
    root = rank == shape.root
    if kind == "all_gather":
        recv = Region("recv", 0, n * c)
        return (recv.block(rank, c) if ip else Region("send", 0, c)), recv
    if kind == "reduce_scatter":
        send = Region("send", 0, n * c)
        return send, (send.block(rank, c) if ip else Region("recv", 0, c))
    if kind == "all_reduce":
        return Region("recv" if ip else "send", 0, c), Region("recv", 0, c)
    if kind == "all_to_all":
        return Region("send", 0, n * c), Region("recv", 0, n * c)
    if kind == "broadcast":
        return (Region("recv" if ip else "send", 0, c) if root else None), Region("recv", 0, c)
    if kind == "reduce":
        return (Region("recv" if root and ip else "send", 0, c),
                Region("recv", 0, c) if root else None)
    if kind == "gather":
        if root:
            recv = Region("recv", 0, n * c)
            return (recv.block(rank, c) if ip else Region("send", 0, c)), recv
        return Region("send", 0, c), None
    if kind == "scatter":
        if root:
            send = Region("send", 0, n * c)
            return send, (send.block(rank, c) if ip else Region("recv", 0, c))
        return None, Region("recv", 0, c)
    if kind == "sendrecv":
        return (Region("send", 0, c) if rank == shape.root else None,
                Region("recv", 0, c) if rank == shape.peer else None)
    return None, None
