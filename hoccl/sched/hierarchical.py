"""Hierarchical plans: hoccl inside each host, an inter-host engine between hosts.

The world is ``hosts`` × ``local_size`` ranks and consecutive ranks share a host: rank
``r`` is local rank ``r % local_size`` of host ``r // local_size``.  A collective over
the world becomes a ``HierarchicalPlan``: a sequence of *phases*, in each of which every
rank makes zero or more calls at one *level*:

* ``"host"``  — a hoccl collective among the ranks of the rank's host (world
  ``local_size``, members numbered by local rank): zero SMs for the data;
* ``"rail"``  — a collective of the inter-host engine (NCCL, MPI, or hoccl itself on
  simulated hosts) among the ranks with the same local rank, one per host (world
  ``hosts``, members numbered by host): local rank i only ever talks to local rank i
  of the other hosts;
* ``"world"`` — send/recv between ranks of different hosts and different local ranks,
  on the engine over the whole world;
* ``"local"`` — a step of one rank alone: ``Divide`` (the division of "avg", which
  every other level computes as a sum).

A call names its buffers as ``Region`` s: element ranges of the rank's ``send``,
``recv`` and ``scratch``.  The calls of one phase on one rank touch disjoint memory, so
they may run side by side; phases run one after the other.

``build_hierarchical(shape, topology)`` makes the plan, ``verify_hierarchical(plan)``
proves it (matched calls, valid regions, no read of unwritten memory, no caller input
overwritten, every output written; every intra- and inter-host call's own plan verified
by ``verify``), and ``simulate_hierarchical(plan, arrays)`` runs it on numpy, each call
through ``simulate`` of that call's own plan.  The runtime (``hoccl._hierarchy``) runs
the same phases, each call through the level's communicator.

The algorithms (n = hosts · local_size ranks, c = count; r = (h, l)):

* all_gather: rail all_gather of every rank's block into scratch (H blocks), then per
  source host h' a host all_gather of block (h', l) into recv[h'·L·c, (h'+1)·L·c): the
  layout comes out rank-major with no local copy, and every network link carries
  (H−1)·c, the least possible;
* reduce_scatter: per destination host h' a host reduce_scatter of recv blocks
  [h'·L, (h'+1)·L) into scratch (rank l keeps the host's sum of block h'·L + l), then a
  rail reduce_scatter of those H partial sums;
* all_reduce: host reduce_scatter into this rank's 1/L shard, rail all_reduce of the
  shard, host all_gather (the remainder of count / L elements: host all_reduce, then
  every rail all_reduces it);
* all_to_all: per destination host a host all_to_all that gathers, on local rank l,
  what every rank of the host sends to local rank l of each host (scratch), then one
  rail all_to_all of L·c blocks;
* broadcast: the root's host scatters the data into L pieces, each rail broadcasts its
  piece from the root's host, each other host all_gathers the pieces while the root's
  host broadcasts the whole (every rail carries 1/L of the data);
* reduce: host reduce_scatter into pieces, rail reduce of each piece to the root's
  host, host gather to the root;
* gather / scatter: through the root's rail only (all data meets at one GPU anyway);
* send/recv: on the host, on the rail, or on the world engine, whichever holds both;
* barrier: host barrier, then rail barrier.

"avg" is a sum everywhere and one ``Divide`` by the world size, applied to the fewest
elements (a rank's shard before all_reduce's all_gather, a piece before reduce's gather).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple, Union

import numpy as np

from .._dtypes import numpy_dtype, reduce_arrays
from .._errors import PlanError
from .algorithms import Options, Shape, build_plan
from .simulate import SCRATCH_FILL, simulate
from .verify import verify

__all__ = ["Topology", "Region", "Call", "Divide", "Phase", "BufferLayout",
           "HierarchicalPlan", "LEVELS", "build_hierarchical", "verify_hierarchical",
           "simulate_hierarchical", "divide_in_place"]

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


# -- building -----------------------------------------------------------------------------
class _Builder:
    """Accumulates phases; knows the topology and the shape of the whole call."""

    def __init__(self, shape: Shape, topology: Topology):
        self.shape, self.topology = shape, topology
        self.H, self.L, self.n = topology.hosts, topology.local_size, topology.world_size
        self.phases: List[Tuple[str, List[List[Step]]]] = []
        self.scratch = [0] * self.n
        self.op = "sum" if shape.op == "avg" else shape.op

    def phase(self, level: str) -> None:
        self.phases.append((level, [[] for _ in range(self.n)]))

    def call(self, rank: int, collective: str, count: int, send: Optional[Region],
             recv: Optional[Region], root: int = 0, peer: int = -1,
             in_place: bool = False) -> None:
        """A call of ``rank`` at the current phase's level (skipped when it moves nothing)."""
        level, steps = self.phases[-1]
        if count == 0 and collective != "barrier":
            return
        size = {"host": self.L, "rail": self.H, "world": self.n}[level]
        s = self.shape
        sub = Shape(collective, size, count, s.dtype, s.itemsize,
                    self.op if collective in ("reduce_scatter", "all_reduce", "reduce") else "sum",
                    root, peer, in_place)
        steps[rank].append(Call(sub, send, recv))

    def divide(self, rank: int, region: Region) -> None:
        if region.count:
            self.phases[-1][1][rank].append(Divide(region, self.n))

    def need_scratch(self, rank: int, count: int) -> Region:
        self.scratch[rank] = max(self.scratch[rank], count)
        return Region("scratch", 0, count)

    def ranks(self):
        """Every (rank, host, local)."""
        for rank in range(self.n):
            yield rank, rank // self.L, rank % self.L

    def plan(self) -> HierarchicalPlan:
        buffers = []
        for rank in range(self.n):
            layouts = _caller_buffers(self.shape, rank)
            if self.scratch[rank]:
                layouts = layouts + (BufferLayout("scratch", self.scratch[rank]),)
            buffers.append(layouts)
        phases = tuple(Phase(level, tuple(tuple(s) for s in steps))
                       for level, steps in self.phases if any(steps))
        return HierarchicalPlan(self.shape, self.topology, tuple(buffers), phases)


def _flat(b: _Builder) -> None:
    """One host (or one rank per host): the whole call at one level.  On one host hoccl
    computes "avg" itself; across hosts it is a sum and a division."""
    s = b.shape
    level = "host" if b.H == 1 else "rail"
    if level == "host":
        b.op = s.op
    b.phase(level)
    for rank in range(b.n):
        send, recv = _caller_regions(s, rank)
        if s.collective == "sendrecv" and rank not in (s.root, s.peer):
            continue
        b.call(rank, s.collective, s.count, send, recv, root=s.root, peer=s.peer,
               in_place=s.in_place)
    if s.op == "avg" and level == "rail":
        b.phase("local")
        for rank in range(b.n):
            recv = _caller_regions(s, rank)[1]
            if recv is not None and (s.collective != "reduce" or rank == s.root):
                b.divide(rank, recv)


def _all_gather(b: _Builder) -> None:
    s, H, L, c = b.shape, b.H, b.L, b.shape.count
    b.phase("rail")
    for rank, h, l in b.ranks():
        send, _ = _caller_regions(s, rank)
        b.call(rank, "all_gather", c, send, b.need_scratch(rank, H * c))
    b.phase("host")
    for rank, h, l in b.ranks():
        send, recv = _both(s, rank)
        for source in range(H):
            block = recv.block(source, L * c)
            if source == h:  # this host's own blocks: from the caller's buffer
                b.call(rank, "all_gather", c, send, block, in_place=s.in_place)
            else:
                b.call(rank, "all_gather", c, Region("scratch", source * c, c), block)


def _reduce_scatter(b: _Builder) -> None:
    s, H, L, c = b.shape, b.H, b.L, b.shape.count
    b.phase("host")
    for rank, h, l in b.ranks():
        send, _ = _both(s, rank)
        b.need_scratch(rank, H * c)
        for destination in range(H):
            b.call(rank, "reduce_scatter", c, send.block(destination, L * c),
                   Region("scratch", destination * c, c))
    b.phase("rail")
    for rank, h, l in b.ranks():
        _, recv = _caller_regions(s, rank)
        b.call(rank, "reduce_scatter", c, Region("scratch", 0, H * c), recv)
    if s.op == "avg":
        b.phase("local")
        for rank, h, l in b.ranks():
            b.divide(rank, _both(s, rank)[1])


def _all_reduce(b: _Builder) -> None:
    s, L, c = b.shape, b.L, b.shape.count
    q, rest = divmod(c, L)
    main = q * L
    b.phase("host")
    for rank, h, l in b.ranks():
        send, recv = _both(s, rank)
        b.call(rank, "reduce_scatter", q, Region(send.buffer, 0, main), recv.block(l, q),
               in_place=s.in_place)
        b.call(rank, "all_reduce", rest, Region(send.buffer, main, rest),
               Region("recv", main, rest), in_place=s.in_place)
    b.phase("rail")
    for rank, h, l in b.ranks():
        shard, remainder = Region("recv", l * q, q), Region("recv", main, rest)
        b.call(rank, "all_reduce", q, shard, shard, in_place=True)
        b.call(rank, "all_reduce", rest, remainder, remainder, in_place=True)
    if s.op == "avg":
        b.phase("local")
        for rank, h, l in b.ranks():
            b.divide(rank, Region("recv", l * q, q))
            b.divide(rank, Region("recv", main, rest))
    b.phase("host")
    for rank, h, l in b.ranks():
        b.call(rank, "all_gather", q, Region("recv", l * q, q), Region("recv", 0, main),
               in_place=True)


def _all_to_all(b: _Builder) -> None:
    H, L, c, n = b.H, b.L, b.shape.count, b.n
    b.phase("host")
    for rank, h, l in b.ranks():
        b.need_scratch(rank, n * c)
        for destination in range(H):
            b.call(rank, "all_to_all", c, Region("send", destination * L * c, L * c),
                   Region("scratch", destination * L * c, L * c))
    b.phase("rail")
    for rank, h, l in b.ranks():
        b.call(rank, "all_to_all", L * c, Region("scratch", 0, n * c), Region("recv", 0, n * c))


def _broadcast(b: _Builder) -> None:
    s, L, c = b.shape, b.L, b.shape.count
    root_host, root_local = divmod(s.root, L)
    q, rest = divmod(c, L)
    main = q * L
    source = Region("recv" if s.in_place else "send", 0, c)  # the root's data
    b.phase("host")  # the root's host cuts the data into L pieces
    for rank, h, l in b.ranks():
        if h != root_host:
            continue
        if rank == s.root:
            b.call(rank, "scatter", q, Region(source.buffer, 0, main), source.block(l, q),
                   root=root_local, in_place=True)
        else:
            b.call(rank, "scatter", q, None, b.need_scratch(rank, q), root=root_local)
    b.phase("rail")  # rail l carries piece l (and the root's rail the remainder)
    for rank, h, l in b.ranks():
        if h == root_host:
            piece = source.block(l, q) if rank == s.root else Region("scratch", 0, q)
            b.call(rank, "broadcast", q, piece, piece, root=root_host, in_place=True)
        else:
            b.call(rank, "broadcast", q, None, Region("recv", l * q, q), root=root_host)
        if l == root_local:
            tail = Region("recv", main, rest)
            if rank == s.root:
                b.call(rank, "broadcast", rest, Region(source.buffer, main, rest),
                       Region(source.buffer, main, rest), root=root_host, in_place=True)
            else:
                b.call(rank, "broadcast", rest, None, tail, root=root_host)
    b.phase("host")  # other hosts put the pieces together; the root's host broadcasts
    for rank, h, l in b.ranks():
        if h == root_host:
            if rank == s.root:
                b.call(rank, "broadcast", c, source, Region("recv", 0, c), root=root_local,
                       in_place=s.in_place)
            else:
                b.call(rank, "broadcast", c, None, Region("recv", 0, c), root=root_local)
            continue
        b.call(rank, "all_gather", q, Region("recv", l * q, q), Region("recv", 0, main),
               in_place=True)
        tail = Region("recv", main, rest)
        b.call(rank, "broadcast", rest, tail if l == root_local else None, tail,
               root=root_local, in_place=l == root_local)


def _reduce(b: _Builder) -> None:
    s, L, c = b.shape, b.L, b.shape.count
    root_host, root_local = divmod(s.root, L)
    q, rest = divmod(c, L)
    main = q * L
    b.phase("host")  # each host sums into pieces (local rank l: piece l)
    for rank, h, l in b.ranks():
        send = _caller_regions(s, rank)[0]
        assert send is not None  # every rank of a reduce sends
        b.need_scratch(rank, q + rest)
        b.call(rank, "reduce_scatter", q, Region(send.buffer, 0, main), Region("scratch", 0, q))
        b.call(rank, "reduce", rest, Region(send.buffer, main, rest),
               Region("scratch", q, rest) if l == root_local else None, root=root_local)
    b.phase("rail")  # rail l sums piece l on the root's host
    for rank, h, l in b.ranks():
        piece = Region("scratch", 0, q)
        if rank == s.root:
            b.call(rank, "reduce", q, piece, Region("recv", l * q, q), root=root_host)
        else:
            b.call(rank, "reduce", q, piece, piece if h == root_host else None, root=root_host,
                   in_place=h == root_host)
        if l == root_local:
            b.call(rank, "reduce", rest, Region("scratch", q, rest),
                   Region("recv", main, rest) if rank == s.root else None, root=root_host)
    if s.op == "avg":
        b.phase("local")
        for rank, h, l in b.ranks():
            if h == root_host:
                b.divide(rank, Region("recv", l * q, q) if rank == s.root
                         else Region("scratch", 0, q))
            if rank == s.root:
                b.divide(rank, Region("recv", main, rest))
    b.phase("host")  # the root gathers the pieces of its host
    for rank, h, l in b.ranks():
        if h != root_host:
            continue
        if rank == s.root:
            b.call(rank, "gather", q, Region("recv", l * q, q), Region("recv", 0, main),
                   root=root_local, in_place=True)
        else:
            b.call(rank, "gather", q, Region("scratch", 0, q), None, root=root_local)


def _gather(b: _Builder) -> None:
    s, L, c = b.shape, b.L, b.shape.count
    root_host, root_local = divmod(s.root, L)
    b.phase("host")  # local rank root_local of each host gathers its host's blocks
    for rank, h, l in b.ranks():
        send, recv = _caller_regions(s, rank)
        if l != root_local:
            b.call(rank, "gather", c, send, None, root=root_local)
        elif rank == s.root:
            assert recv is not None
            b.call(rank, "gather", c, send, recv.block(root_host, L * c), root=root_local,
                   in_place=s.in_place)
        else:
            b.call(rank, "gather", c, send, b.need_scratch(rank, L * c), root=root_local)
    b.phase("rail")  # the root's rail gathers the host blocks
    for rank, h, l in b.ranks():
        if l != root_local:
            continue
        if rank == s.root:
            recv = Region("recv", 0, b.n * c)
            b.call(rank, "gather", L * c, recv.block(root_host, L * c), recv, root=root_host,
                   in_place=True)
        else:
            b.call(rank, "gather", L * c, Region("scratch", 0, L * c), None, root=root_host)


def _scatter(b: _Builder) -> None:
    s, L, c = b.shape, b.L, b.shape.count
    root_host, root_local = divmod(s.root, L)
    b.phase("rail")  # the root's rail scatters host blocks
    for rank, h, l in b.ranks():
        if l != root_local:
            continue
        if rank == s.root:
            send = Region("send", 0, b.n * c)
            b.call(rank, "scatter", L * c, send, send.block(root_host, L * c), root=root_host,
                   in_place=True)
        else:
            b.call(rank, "scatter", L * c, None, b.need_scratch(rank, L * c), root=root_host)
    b.phase("host")  # local rank root_local of each host scatters its host block
    for rank, h, l in b.ranks():
        _, recv = _caller_regions(s, rank)
        if l != root_local:
            b.call(rank, "scatter", c, None, recv, root=root_local)
        elif rank == s.root:
            b.call(rank, "scatter", c, Region("send", root_host * L * c, L * c), recv,
                   root=root_local, in_place=s.in_place)
        else:
            b.call(rank, "scatter", c, Region("scratch", 0, L * c), recv, root=root_local)


def _sendrecv(b: _Builder) -> None:
    s, t = b.shape, b.topology
    sender, receiver = s.root, s.peer
    if t.host_of(sender) == t.host_of(receiver):
        level = "host"
    elif t.local_of(sender) == t.local_of(receiver):
        level = "rail"
    else:
        level = "world"
    b.phase(level)
    root, peer = t.index_in(level, sender), t.index_in(level, receiver)
    b.call(sender, "sendrecv", s.count, Region("send", 0, s.count), None, root=root, peer=peer)
    b.call(receiver, "sendrecv", s.count, None, Region("recv", 0, s.count), root=root,
           peer=peer)


def _barrier(b: _Builder) -> None:
    for level, size in (("host", b.L), ("rail", b.H)):
        if size == 1:
            continue
        b.phase(level)
        for rank in range(b.n):
            b.call(rank, "barrier", 0, None, None)


_ALGORITHMS = {"all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
               "all_reduce": _all_reduce, "all_to_all": _all_to_all, "broadcast": _broadcast,
               "reduce": _reduce, "gather": _gather, "scatter": _scatter,
               "sendrecv": _sendrecv, "barrier": _barrier}


@lru_cache(maxsize=256)
def build_hierarchical(shape: Shape, topology: Topology) -> HierarchicalPlan:
    """The hierarchical plan of ``shape`` (a call over the whole world) on ``topology``;
    cached, so a repeated call costs a dict lookup."""
    if shape.collective not in _ALGORITHMS:
        raise ValueError(f"build_hierarchical: collective must be one of {tuple(_ALGORITHMS)}; "
                         f"got {shape.collective!r}")
    if shape.world_size != topology.world_size:
        raise ValueError(f"build_hierarchical: the shape's world size {shape.world_size} is not "
                         f"{topology.hosts} hosts x {topology.local_size}")
    builder = _Builder(shape, topology)
    flat = topology.hosts == 1 or topology.local_size == 1
    if flat and shape.collective not in ("sendrecv", "barrier"):
        _flat(builder)
    else:
        _ALGORITHMS[shape.collective](builder)
    return builder.plan()


# -- verifying ----------------------------------------------------------------------------
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
