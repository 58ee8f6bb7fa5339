"""Building hierarchical plans (``hoccl.sched.hierarchical``): one builder per collective."""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Tuple

from ._hierarchical_plan import (BufferLayout, Call, Divide, HierarchicalPlan, Phase, Region, Step,
                                 Topology, _both, _caller_buffers, _caller_regions)
from .algorithms import Shape

__all__ = ["build_hierarchical", "build_host_share"]


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


def _all_gather_from(b: _Builder, source: int) -> None:
    """all_gather's blocks of host ``source`` alone: a rail broadcast from it into
    scratch, then a host all_gather of the block into place (a pipelined all_gather is
    one such share per host, ``build_host_share``)."""
    s, L, c = b.shape, b.L, b.shape.count
    b.phase("rail")
    for rank, h, l in b.ranks():
        send, _ = _both(s, rank)
        if h == source:
            b.call(rank, "broadcast", c, send, send, root=source, in_place=True)
        else:
            b.call(rank, "broadcast", c, None, b.need_scratch(rank, c), root=source)
    b.phase("host")
    for rank, h, l in b.ranks():
        send, recv = _both(s, rank)
        block = recv.block(source, L * c)
        if h == source:
            b.call(rank, "all_gather", c, send, block, in_place=s.in_place)
        else:
            b.call(rank, "all_gather", c, Region("scratch", 0, c), block)


def _reduce_scatter_to(b: _Builder, destination: int) -> None:
    """reduce_scatter's blocks of host ``destination`` alone: a host reduce_scatter into
    scratch, then a rail reduce of the hosts' sums to it (and avg's division there)."""
    s, L, c = b.shape, b.L, b.shape.count
    b.phase("host")
    for rank, h, l in b.ranks():
        send, _ = _both(s, rank)
        b.call(rank, "reduce_scatter", c, send.block(destination, L * c),
               b.need_scratch(rank, c))
    b.phase("rail")
    for rank, h, l in b.ranks():
        recv = _both(s, rank)[1] if h == destination else None
        b.call(rank, "reduce", c, Region("scratch", 0, c), recv, root=destination)
    if s.op == "avg":
        b.phase("local")
        for rank, h, l in b.ranks():
            if h == destination:
                b.divide(rank, _both(s, rank)[1])


@lru_cache(maxsize=256)
def build_host_share(shape: Shape, topology: Topology, host: int) -> HierarchicalPlan:
    """The part of an all_gather (reduce_scatter) on ``topology`` that moves the blocks of
    host ``host`` (to it): the plans a pipelined all_gather (reduce_scatter) overlaps."""
    if shape.collective not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"build_host_share: collective must be all_gather or reduce_scatter; "
                         f"got {shape.collective!r}")
    builder = _Builder(shape, topology)
    share = _all_gather_from if shape.collective == "all_gather" else _reduce_scatter_to
    share(builder, host)
    return builder.plan()


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
