"""Algorithms: pure functions from a collective's shape to a ``Plan``.

All algorithms here are *direct*: every rank talks to every peer, visiting peers in
rotated order ``(rank + k) % world_size`` so that no GPU is the first target of
every peer at once (incast).  Data moves by ``push``: the rank that owns the data
issues the copy into the peer's buffer, after the peer's ``READY`` signal says the
peer's caller stream has reached the collective, and follows it with a ``DONE``
signal that the peer's exit waits for.

Every program begins with its ``READY`` signals before any ``Wait``, so no two
ranks can wait for each other's readiness (no deadlock whatever the interleaving).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from .._errors import InvalidArgumentError
from .plan import (CHANNELS, DONE, GATHERED, PAIR_DONE, PAIR_READY, READY, RING, After,
                   BufferSpec, BufRef, Copy, Mark, Plan, Reduce, Signal, Step, Wait)

__all__ = ["Shape", "Options", "build_plan", "COLLECTIVES", "KERNEL_COLLECTIVES",
           "KERNEL_MAX_BLOCKS", "KERNEL_MAX_RANKS", "split", "kernel_bytes_of",
           "kernel_blocks_for"]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
               "reduce", "gather", "scatter", "sendrecv", "barrier")
SELF_ROUTES = ("peer", "local")
#: the collectives a direct kernel runs (``Options.kernel_bytes``)
KERNEL_COLLECTIVES = ("all_gather", "all_to_all", "broadcast", "reduce_scatter", "all_reduce")
#: most blocks (SMs) a direct kernel takes: each has a signal slot of its own per channel
KERNEL_MAX_BLOCKS = 32
#: the largest world a direct kernel serves (one NVLink domain; its steps, about four per
#: peer, travel in the kernel's arguments)
KERNEL_MAX_RANKS = 8
#: bytes of the largest buffer per block of a direct kernel, before ``kernel_sms`` caps it
KERNEL_BLOCK_BYTES = 32 << 10


class Shape(NamedTuple):
    """What a collective moves, independent of where the buffers are.

    ``count`` is NCCL's count: elements sent per rank (all_gather, gather), received
    per rank (reduce_scatter, scatter), in the whole buffer (all_reduce, broadcast,
    reduce, sendrecv), or per peer block (all_to_all).  For ``sendrecv`` ``root`` is
    the sender and ``peer`` the receiver.  A named tuple: every call builds one and
    looks its plan up by it, and a tuple is several times cheaper to build than a
    frozen dataclass.
    """
    collective: str
    world_size: int
    count: int  # type: ignore[assignment]  # the field hides tuple.count, which no one calls
    dtype: str = "uint8"
    itemsize: int = 1
    op: str = "sum"
    root: int = 0
    peer: int = -1
    in_place: bool = False
    #: sums only: the result times ``scale``, applied once by the reduction kernel as it
    #: rounds (torch's PREMUL_SUM); None: a plain sum
    scale: Optional[float] = None


@dataclass(frozen=True)
class Options:
    """How to move it.

    ``copy_lanes``: copy streams per rank that share the peers (None: one per peer up
    to 4).  ``chunk_bytes``: pipeline unit of reductions (a reduction of chunk k
    overlaps the copies of chunk k+1).  ``self_route``: how a rank's own block reaches
    its place in out-of-place forms: ``"local"`` (a copy on at most ``copy_sms`` SMs,
    the default: the own block then takes no link bandwidth from the peers' blocks) or
    ``"peer"`` (through a peer's copy engine and back: zero SMs, costs link bandwidth).  In-place forms
    have no own block to move and use no SM.  ``one_shot_bytes``: an all_reduce of at
    most this many bytes runs in one phase (every rank pushes its whole input into every
    peer's scratch and sums all of them itself: one round of signals instead of two,
    n - 1 times the copy traffic); 0 turns it off.  ``pull_bytes``: a reduce_scatter,
    all_reduce or reduce whose input is at most this many bytes (all ranks' blocks of a
    reduce_scatter) sums the peers' inputs where they lie: the reduction kernel reads
    them from the peers' memory (over NVLink between GPUs), with no copy into scratch
    before it (no copy-engine step, no scratch; the kernel's SMs move that data), and
    tells each peer when it is done reading; 0 (the default) turns it off.  One-shot
    all_reduces keep their push.

    ``kernel_bytes``: an all_gather, all_to_all, broadcast, reduce_scatter or all_reduce
    of at most ``KERNEL_MAX_RANKS`` ranks whose largest buffer is at most this many bytes
    runs as one *direct kernel* per rank (``_direct``): it stores what each peer needs into
    the peer's staging ring (over NVLink), signals it, waits for its own ring to be
    filled, and copies or sums from it into its output, on at most ``kernel_sms`` SMs and
    with no copy-engine step at all.  Small messages are
    bound by latency, not bandwidth, and one kernel launch (one graph node) is what a
    copy engine's start-up and a chain of stream memory operations cannot match; 0 (the
    default) turns it off.
    """
    copy_lanes: Optional[int] = None
    chunk_bytes: int = 32 << 20
    self_route: str = "local"
    one_shot_bytes: int = 0
    pull_bytes: int = 0
    kernel_bytes: int = 0
    kernel_sms: int = 16

    def __post_init__(self) -> None:
        if self.self_route not in SELF_ROUTES:
            raise InvalidArgumentError(f"self_route must be one of {SELF_ROUTES}; "
                                       f"got {self.self_route!r}")
        if not _positive_int(self.chunk_bytes):
            raise InvalidArgumentError(f"chunk_bytes must be a positive int; "
                                       f"got {self.chunk_bytes!r}")
        if self.copy_lanes is not None and not _positive_int(self.copy_lanes):
            raise InvalidArgumentError(f"copy_lanes must be None or a positive int; "
                                       f"got {self.copy_lanes!r}")
        if not _positive_int(self.kernel_sms) or self.kernel_sms > KERNEL_MAX_BLOCKS:
            raise InvalidArgumentError(f"kernel_sms must be an int in [1, {KERNEL_MAX_BLOCKS}]; "
                                       f"got {self.kernel_sms!r}")
        for name in ("one_shot_bytes", "pull_bytes", "kernel_bytes"):
            value = getattr(self, name)
            if not (_positive_int(value) or value == 0) or isinstance(value, bool):
                raise InvalidArgumentError(f"{name} must be an int >= 0; got {value!r}")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def split(total: int, parts: int) -> List[Tuple[int, int]]:
    """``parts`` contiguous ``(start, size)`` ranges covering ``total``, sizes differing by at most one."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        ranges.append((start, size))
        start += size
    return ranges


def _chunks(nbytes: int, chunk_bytes: int, itemsize: int) -> List[Tuple[int, int]]:
    """Byte ranges ``(offset, size)`` of at most ``chunk_bytes``, element aligned; one empty chunk for 0."""
    if nbytes == 0:
        return [(0, 0)]
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    return [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)]


class _Builder:
    """Accumulates per-rank programs; knows the slot layout and lane assignment."""

    def __init__(self, shape: Shape, options: Options):
        self.shape, self.options = shape, options
        n = shape.world_size
        self.n = n
        self.copy_lanes = max(1, min(options.copy_lanes or min(n - 1, 4), max(n - 1, 1)))
        self.programs: List[List[Step]] = [[] for _ in range(n)]
        self.buffers: List[Dict[str, BufferSpec]] = [{} for _ in range(n)]
        self.max_value = 0
        self.marks = [0] * n
        self.extra_lanes = 0
        self.last: Dict[Tuple[int, int, int], int] = {}  # (sender, receiver, channel) -> value

    # -- lanes ------------------------------------------------------------------------
    def lane_of(self, k: int) -> int:
        """The copy lane that serves the peer at rotation distance ``k`` (1 .. n-1)."""
        return (k - 1) % self.copy_lanes

    def side_lane(self, index: int = 0) -> int:
        """A lane beside the copy lanes (reductions, all_reduce's gather, local copies)."""
        self.extra_lanes = max(self.extra_lanes, index + 1)
        return self.copy_lanes + index

    # -- buffers ----------------------------------------------------------------------
    def buffer(self, rank: int, name: str, nbytes: int, inputs=(), outputs=()) -> None:
        self.buffers[rank][name] = BufferSpec(name, nbytes, tuple(r for r in inputs if r[1] > r[0]),
                                              tuple(r for r in outputs if r[1] > r[0]))

    # -- steps ------------------------------------------------------------------------
    def copy(self, rank: int, lane: int, src: BufRef, dst: BufRef, nbytes: int) -> None:
        if nbytes and src != dst:
            self.programs[rank].append(Copy(lane, src, dst, nbytes))

    def signal(self, rank: int, lane: int, peer: int, channel: int,
               value: Optional[int] = None) -> int:
        """Signal ``peer``; ``value`` defaults to one more than the last on that slot."""
        key = (rank, peer, channel)
        value = self.last.get(key, 0) + 1 if value is None else value
        self.last[key] = value
        self.max_value = max(self.max_value, value)
        self.programs[rank].append(Signal(lane, peer, rank * CHANNELS + channel, value))
        return value

    def wait(self, rank: int, lane: int, peer: int, channel: int, value: int) -> None:
        self.programs[rank].append(Wait(lane, peer * CHANNELS + channel, value))

    def reduce(self, rank: int, lane: int, inputs, output: BufRef, count: int) -> None:
        if count:
            s = self.shape
            self.programs[rank].append(Reduce(lane, tuple(inputs), output, count, s.dtype, s.op,
                                              s.scale))

    def mark(self, rank: int, lane: int) -> int:
        self.marks[rank] += 1
        self.programs[rank].append(Mark(lane, self.marks[rank]))
        return self.marks[rank]

    def after(self, rank: int, lane: int, mark: int) -> None:
        self.programs[rank].append(After(lane, mark))

    def finish(self) -> None:
        """Exit waits: every rank waits on lane 0 for the last DONE/GATHERED value of each
        peer that wrote into or read from its buffers, unless it already waited for it."""
        waited: Dict[Tuple[int, int], int] = {}
        for rank, program in enumerate(self.programs):
            for step in program:
                if isinstance(step, Wait):
                    key = (rank, step.slot)
                    waited[key] = max(waited.get(key, 0), step.value)
        for (sender, receiver, channel), value in sorted(self.last.items()):
            if channel in (DONE, GATHERED, PAIR_DONE):
                if waited.get((receiver, sender * CHANNELS + channel), 0) < value:
                    self.wait(receiver, 0, sender, channel, value)

    def plan(self, participants: Sequence[int] = (), pair: Tuple[int, ...] = ()) -> Plan:
        self.finish()
        s, o = self.shape, self.options
        lanes = self.copy_lanes + self.extra_lanes
        options = (("copy_lanes", self.copy_lanes), ("chunk_bytes", o.chunk_bytes),
                   ("self_route", o.self_route))
        return Plan(s.collective, self.n, lanes,
                    tuple(tuple(b.values()) for b in self.buffers),
                    tuple(tuple(p) for p in self.programs), self.max_value,
                    tuple(participants) or tuple(range(self.n)), pair, options)

    # -- shared shapes ----------------------------------------------------------------
    def ready_all(self, rank: int, peers: Sequence[int]) -> None:
        """READY to every peer, each on the lane that will later wait on that peer."""
        for peer in peers:
            self.signal(rank, self.lane_of((peer - rank) % self.n), peer, READY, 1)

    def push(self, rank: int, peer: int, src: BufRef, dst: BufRef, nbytes: int,
             pull_back: Optional[BufRef] = None) -> None:
        """Wait for ``peer``'s READY, copy ``src`` into ``peer``'s ``dst``, optionally copy it
        back from there into ``pull_back`` (the zero-SM route of a rank's own block), and
        signal DONE so ``peer``'s exit waits for both."""
        lane = self.lane_of((peer - rank) % self.n)
        self.wait(rank, lane, peer, READY, 1)
        self.copy(rank, lane, src, dst, nbytes)
        if pull_back is not None:
            self.copy(rank, lane, dst, pull_back, nbytes)
        self.signal(rank, lane, peer, DONE)

    def routes_through_peer(self) -> bool:
        return self.options.self_route == "peer" and self.n > 1

    def self_block(self, rank: int, src: BufRef, dst: BufRef, nbytes: int,
                   handshake: bool = False) -> None:
        """Move ``rank``'s own block from ``src`` to ``dst`` (both on ``rank``).

        ``"local"`` (or a single rank) copies on SMs, on a side lane.  ``"peer"`` sends
        it through the next rank's scratch and back on copy engines (that rank must
        have signalled READY and must hold a ``scratch`` of ``nbytes``).  ``handshake``
        keeps the peer route's signals even when there is nothing to copy.
        """
        if nbytes == 0 and not handshake:
            return
        if not self.routes_through_peer():
            self.copy(rank, self.side_lane(0), src, dst, nbytes)
            return
        via = (rank + 1) % self.n
        self.push(rank, via, src, BufRef(via, "scratch", 0), nbytes, pull_back=dst)


def _peers(rank: int, n: int) -> List[int]:
    """Every other rank, in rotated order starting after ``rank``."""
    return [(rank + k) % n for k in range(1, n)]


# ---------------------------------------------------------------------------------------
def _gather_buffers(b: _Builder, r: int) -> BufRef:
    """Rank ``r``'s buffers of an all_gather, and where its own block lies: in place, its
    block of ``recv``; out of place, ``send``."""
    n, nb = b.n, b.shape.count * b.shape.itemsize
    if b.shape.in_place:
        b.buffer(r, "recv", n * nb, inputs=[(r * nb, (r + 1) * nb)],
                 outputs=[(p * nb, (p + 1) * nb) for p in range(n) if p != r])
        return BufRef(r, "recv", r * nb)
    b.buffer(r, "send", nb, inputs=[(0, nb)])
    b.buffer(r, "recv", n * nb, outputs=[(0, n * nb)])
    return BufRef(r, "send", 0)


def _all_gather(b: _Builder) -> Plan:
    s, n = b.shape, b.n
    nb = s.count * s.itemsize
    for r in range(n):
        src = _gather_buffers(b, r)
        peers = _peers(r, n)
        b.ready_all(r, peers)
        own = BufRef(r, "recv", r * nb)
        for p in peers:
            # the first peer's copy of our block comes back into our own slot (zero SMs)
            pull_back = own if p == peers[0] and not s.in_place and b.routes_through_peer() else None
            b.push(r, p, src, BufRef(p, "recv", r * nb), nb, pull_back=pull_back)
        if not s.in_place and not b.routes_through_peer():
            b.self_block(r, src, own, nb)
    return b.plan()


def _all_to_all(b: _Builder) -> Plan:
    s, n = b.shape, b.n
    nb = s.count * s.itemsize
    for r in range(n):
        b.buffer(r, "send", n * nb, inputs=[(0, n * nb)])
        b.buffer(r, "recv", n * nb, outputs=[(0, n * nb)])
        if b.routes_through_peer():
            b.buffer(r, "scratch", nb)
        peers = _peers(r, n)
        b.ready_all(r, peers)
        for p in peers:
            b.push(r, p, BufRef(r, "send", p * nb), BufRef(p, "recv", r * nb), nb)
        b.self_block(r, BufRef(r, "send", r * nb), BufRef(r, "recv", r * nb), nb)
    return b.plan()


def _rooted_copy(b: _Builder) -> Plan:
    """broadcast, gather and scatter: copies between the root and every other rank."""
    s, n, root = b.shape, b.n, b.shape.root
    nb = s.count * s.itemsize
    kind = s.collective
    via = (root + 1) % n
    # gather and scatter route the root's own block through ``via``'s scratch (broadcast
    # pulls it back from the first peer's output instead).  Only the root knows whether
    # its call is in place, so the handshake with ``via`` is planned in both forms (its
    # copies are empty in place): every other rank's program is the same either way.
    staging = kind != "broadcast" and b.routes_through_peer() and nb > 0
    for r in range(n):
        if kind == "broadcast":
            if s.in_place:
                b.buffer(r, "recv", nb, inputs=[(0, nb)] if r == root else [],
                         outputs=[] if r == root else [(0, nb)])
            else:
                if r == root:
                    b.buffer(r, "send", nb, inputs=[(0, nb)])
                b.buffer(r, "recv", nb, outputs=[(0, nb)])
        elif kind == "gather":
            own = (root * nb, (root + 1) * nb)
            if r == root and s.in_place:
                b.buffer(r, "recv", n * nb, inputs=[own],
                         outputs=[(p * nb, (p + 1) * nb) for p in range(n) if p != root])
            else:
                b.buffer(r, "send", nb, inputs=[(0, nb)])
                if r == root:
                    b.buffer(r, "recv", n * nb, outputs=[(0, n * nb)])
        else:  # scatter
            if r == root:
                b.buffer(r, "send", n * nb, inputs=[(0, n * nb)])
                if not s.in_place:
                    b.buffer(r, "recv", nb, outputs=[(0, nb)])
            else:
                b.buffer(r, "recv", nb, outputs=[(0, nb)])
        if staging and r == via:
            b.buffer(r, "scratch", nb)

    in_place_src = "recv" if s.in_place else "send"
    peers = _peers(root, n)
    if kind == "gather":
        b.ready_all(root, peers)
        if staging:
            b.signal(via, 0, root, READY, 1)
        for p in peers:
            b.push(p, root, BufRef(p, "send", 0), BufRef(root, "recv", p * nb), nb)
        if staging or not s.in_place:
            b.self_block(root, BufRef(root, "send", 0), BufRef(root, "recv", root * nb),
                         0 if s.in_place else nb, handshake=staging)
        return b.plan()
    for p in peers:
        b.signal(p, 0, root, READY, 1)
    for p in peers:
        src = (BufRef(root, in_place_src, 0) if kind == "broadcast"
               else BufRef(root, "send", p * nb))
        pull_back = (BufRef(root, "recv", 0) if kind == "broadcast" and p == peers[0]
                     and not s.in_place and b.routes_through_peer() else None)
        b.push(root, p, src, BufRef(p, "recv", 0), nb, pull_back=pull_back)
    if staging or (not s.in_place and not b.routes_through_peer()):
        own_src = BufRef(root, "send", root * nb if kind == "scatter" else 0)
        b.self_block(root, own_src, BufRef(root, "recv", 0), 0 if s.in_place else nb,
                     handshake=staging)
    return b.plan()


def _reducing(b: _Builder) -> Plan:
    """reduce_scatter, all_reduce and reduce: peers push pieces into the owner's scratch
    chunk by chunk; the owner reduces chunk c on a side lane while chunk c+1 is in flight.
    all_reduce then pushes each reduced chunk to every peer (the gather phase).

    Pulled (``Options.pull_bytes``): no pushes and no scratch; each peer signals READY
    (its input may be read), the owner's reduction reads the peers' pieces where they
    lie, then signals each peer DONE (read: the peer's exit waits for it)."""
    s, n = b.shape, b.n
    kind, item = s.collective, s.itemsize
    # one phase: every rank reduces the whole of it (all_reduce up to one_shot_bytes)
    # (a threshold of 0 is off for every size, an empty buffer's included)
    one_shot = (kind == "all_reduce" and n > 1 and b.options.one_shot_bytes > 0
                and s.count * item <= b.options.one_shot_bytes)
    input_bytes = (n if kind == "reduce_scatter" else 1) * s.count * item
    pull = (n > 1 and not one_shot and b.options.pull_bytes > 0
            and input_bytes <= b.options.pull_bytes)
    if kind == "reduce_scatter":
        owned = [(r * s.count, s.count) for r in range(n)]  # element range each rank reduces
        total = n * s.count
    elif one_shot:
        owned = [(0, s.count)] * n
        total = s.count
    elif kind == "all_reduce":
        owned = split(s.count, n)
        total = s.count
    else:  # reduce
        owned = [(0, s.count) if r == s.root else (0, 0) for r in range(n)]
        total = s.count

    for r in range(n):
        start, size = owned[r]
        if kind == "reduce_scatter":
            if s.in_place:
                b.buffer(r, "send", total * item, inputs=[(0, total * item)],
                         outputs=[(start * item, (start + size) * item)])
            else:
                b.buffer(r, "send", total * item, inputs=[(0, total * item)])
                b.buffer(r, "recv", size * item, outputs=[(0, size * item)])
        elif kind == "all_reduce":
            if s.in_place:
                b.buffer(r, "recv", total * item, inputs=[(0, total * item)],
                         outputs=[(0, total * item)])
            else:
                b.buffer(r, "send", total * item, inputs=[(0, total * item)])
                b.buffer(r, "recv", total * item, outputs=[(0, total * item)])
        else:
            if r == s.root and s.in_place:
                b.buffer(r, "recv", total * item, inputs=[(0, total * item)],
                         outputs=[(0, total * item)])
            else:
                b.buffer(r, "send", total * item, inputs=[(0, total * item)])
                if r == s.root:
                    b.buffer(r, "recv", total * item, outputs=[(0, total * item)])
        if size and n > 1 and not pull:
            b.buffer(r, "scratch", (n - 1) * size * item)

    def input_ref(rank: int, byte_offset: int) -> BufRef:
        name = "recv" if s.in_place and (kind == "all_reduce" or
                                         (kind == "reduce" and rank == s.root)) else "send"
        return BufRef(rank, name, byte_offset)

    def output_ref(rank: int, element_in_block: int) -> BufRef:
        start = owned[rank][0]
        if kind == "reduce_scatter":
            return (BufRef(rank, "send", (start + element_in_block) * item) if s.in_place
                    else BufRef(rank, "recv", element_in_block * item))
        if kind == "all_reduce":
            return BufRef(rank, "recv", (start + element_in_block) * item)
        return BufRef(rank, "recv", element_in_block * item)

    chunks = [_chunks(size * item, b.options.chunk_bytes, item) for _, size in owned]
    # one lane where a second would overlap nothing: a pull has no copies to overlap its
    # sums (an all_reduce's gather copies follow its only sum), and a single chunk's sum
    # waits for the peer's copy anyway (lanes of their own keep copies to several peers
    # apart).  A one-lane plan runs on the caller's stream itself (``Communicator``):
    # no entry event, no join, no exit fence.
    single = all(len(pieces) <= 1 for pieces in chunks)
    gathers = kind == "all_reduce" and not one_shot
    gather_lane: Optional[int]
    if (pull and (not gathers or single)) or (single and b.copy_lanes == 1):
        b.copy_lanes = 1
        reduce_lane = 0
        gather_lane = 0 if gathers else None
    else:
        reduce_lane = b.side_lane(0)
        gather_lane = b.side_lane(1) if gathers else None

    for r in range(n):
        # owners this rank must feed, and its own readiness to be fed
        owners = [p for p in _peers(r, n) if owned[p][1]]
        feeders = _peers(r, n) if owned[r][1] else []
        if kind == "all_reduce" and not one_shot:
            # every peer writes its reduced block into our output in the gather phase
            b.ready_all(r, sorted(set(feeders) | {p for p in _peers(r, n) if owned[p][1]},
                                  key=lambda p: (p - r) % n))
        else:
            # pushed: our scratch is free for the feeders; pulled: our input is readable
            b.ready_all(r, owners if pull else feeders)
        pushed = []  # marks after this rank's pushes of its input on other lanes
        for p in owners if not pull else ():
            lane = b.lane_of((p - r) % n)
            slot_at_p = (r - p - 1) % n  # our block's place in p's scratch
            b.wait(r, lane, p, READY, 1)
            start, size = owned[p]
            for index, (offset, nbytes) in enumerate(chunks[p]):
                b.copy(r, lane, input_ref(r, start * item + offset),
                       BufRef(p, "scratch", slot_at_p * size * item + offset), nbytes)
                b.signal(r, lane, p, DONE, index + 1)
            if one_shot and s.in_place and lane != reduce_lane:
                pushed.append(b.mark(r, lane))
        if not owned[r][1]:
            continue
        for mark in pushed:  # in place, one shot: the sum overwrites what was pushed
            b.after(r, reduce_lane, mark)
        start, size = owned[r]
        if pull:  # every feeder's input readable: READY
            for p in feeders:
                b.wait(r, reduce_lane, p, READY, 1)
        for index, (offset, nbytes) in enumerate(chunks[r]):
            if pull:
                inputs = [input_ref(q, start * item + offset) for q in range(n)]
            else:
                for p in feeders:
                    b.wait(r, reduce_lane, p, DONE, index + 1)
                inputs = [input_ref(r, start * item + offset) if q == r else
                          BufRef(r, "scratch", ((q - r - 1) % n) * size * item + offset)
                          for q in range(n)]
            b.reduce(r, reduce_lane, inputs, output_ref(r, offset // item), nbytes // item)
            if gather_lane is not None and n > 1:
                if gather_lane != reduce_lane:
                    b.after(r, gather_lane, b.mark(r, reduce_lane))
                for p in _peers(r, n):
                    b.copy(r, gather_lane, output_ref(r, offset // item),
                           BufRef(p, "recv", (start * item) + offset), nbytes)
                    b.signal(r, gather_lane, p, GATHERED, index + 1)
        # done reading the feeders' inputs: their exits wait for it (a graph replay's reset
        # of their READY slot needs it too); on one lane GATHERED, after the sum, says it
        if pull and gather_lane != reduce_lane:
            for p in feeders:
                b.signal(r, reduce_lane, p, DONE, 1)
    return b.plan()


def _barrier(b: _Builder) -> Plan:
    for r in range(b.n):
        peers = _peers(r, b.n)
        b.ready_all(r, peers)
        for p in peers:
            b.wait(r, b.lane_of((p - r) % b.n), p, READY, 1)
    return b.plan()


def _sendrecv(b: _Builder) -> Plan:
    s = b.shape
    sender, receiver = s.root, s.peer
    nb = s.count * s.itemsize
    b.buffer(sender, "send", nb, inputs=[(0, nb)])
    b.buffer(receiver, "recv", nb, outputs=[(0, nb)])
    b.signal(receiver, 0, sender, PAIR_READY, 1)
    b.wait(sender, 0, receiver, PAIR_READY, 1)
    b.copy(sender, 0, BufRef(sender, "send", 0), BufRef(receiver, "recv", 0), nb)
    b.signal(sender, 0, receiver, PAIR_DONE, 1)
    b.wait(receiver, 0, sender, PAIR_DONE, 1)
    return b.plan(participants=(sender, receiver), pair=(sender, receiver))


def kernel_bytes_of(shape: Shape) -> int:
    """The largest buffer of ``shape``'s collective on any rank: what ``kernel_bytes`` bounds."""
    n, nb = shape.world_size, shape.count * shape.itemsize
    if shape.collective in ("all_gather", "all_to_all", "reduce_scatter"):
        return n * nb
    return nb


def kernel_blocks_for(nbytes: int, kernel_sms: int) -> int:
    """Blocks (SMs) of a direct kernel whose largest buffer is ``nbytes``: one per
    ``KERNEL_BLOCK_BYTES``, at most ``kernel_sms``."""
    return max(1, min(kernel_sms, KERNEL_MAX_BLOCKS, -(-nbytes // KERNEL_BLOCK_BYTES)))


def _direct(b: _Builder) -> Plan:
    """One direct kernel per rank, every step on lane 0 (``Options.kernel_bytes``).

    Each rank stores what its peers need into their ``RING`` (the kernel's SMs write
    over NVLink; no READY first: the ring is double-buffered, see ``plan.RING``),
    signals DONE to them, waits for DONE from the ranks that store into its own ring,
    then finishes locally: copies its ring into its output (all_gather, all_to_all,
    broadcast) or sums its input and its ring in rank order, so that every rank rounds
    alike (reduce_scatter, all_reduce).  One one-way signal per peer, where a handshake
    into the peers' own buffers would take two.  A broadcast's root, which hears from
    nobody else, waits for a signal each receiver sends as its kernel starts, and sends
    its DONE only then: so every rank finishes a call only after every other rank started
    it, and no rank is ever two calls ahead of any rank (the next call may store into any
    peer's ring).  A rank names only its peers' rings, so ranks that differ in form (in
    place or not) agree.

    The kernel runs this program in every one of its ``kernel_blocks`` blocks, each on
    its share of every data step (``block_range``), each signalling a slot of its own;
    a wait waits for every block of the peer.  That is this plan's order exactly, so
    ``verify`` and ``simulate`` speak for the kernel (all but the ring's parity, which
    spans calls)."""
    s, n = b.shape, b.n
    nb = s.count * s.itemsize
    kind, root = s.collective, s.root

    def slot(sender: int, receiver: int) -> int:
        """Where ``sender``'s block lies in ``receiver``'s ring."""
        return ((sender - receiver - 1) % n) * nb

    for r in range(n):
        peers = _peers(r, n)
        pushes: List[Copy] = []   # into the peers' rings, before the DONE signals
        finish: List[Union[Copy, Reduce]] = []  # from the own ring, after the DONE waits
        targets: Sequence[int] = peers   # ranks whose ring r stores into
        sources: Sequence[int] = peers   # ranks that store into r's ring
        ring = (n - 1) * nb
        if kind == "all_gather":
            own = _gather_buffers(b, r)
            pushes = [Copy(0, own, BufRef(p, RING, slot(r, p)), nb) for p in peers]
            finish = [Copy(0, BufRef(r, RING, slot(q, r)), BufRef(r, "recv", q * nb), nb)
                      for q in peers]
            finish.append(Copy(0, own, BufRef(r, "recv", r * nb), nb))
        elif kind == "all_to_all":
            b.buffer(r, "send", n * nb, inputs=[(0, n * nb)])
            b.buffer(r, "recv", n * nb, outputs=[(0, n * nb)])
            pushes = [Copy(0, BufRef(r, "send", p * nb), BufRef(p, RING, slot(r, p)), nb)
                      for p in peers]
            finish = [Copy(0, BufRef(r, RING, slot(q, r)), BufRef(r, "recv", q * nb), nb)
                      for q in peers]
            finish.append(Copy(0, BufRef(r, "send", r * nb), BufRef(r, "recv", r * nb), nb))
        elif kind == "broadcast":
            if r == root:
                if s.in_place:
                    b.buffer(r, "recv", nb, inputs=[(0, nb)])
                    own = BufRef(r, "recv", 0)
                else:
                    b.buffer(r, "send", nb, inputs=[(0, nb)])
                    b.buffer(r, "recv", nb, outputs=[(0, nb)])
                    own = BufRef(r, "send", 0)
                pushes = [Copy(0, own, BufRef(p, RING, 0), nb) for p in peers]
                finish = [Copy(0, own, BufRef(r, "recv", 0), nb)]
                sources, ring = (), 0
            else:
                b.buffer(r, "recv", nb, outputs=[(0, nb)])
                finish = [Copy(0, BufRef(r, RING, 0), BufRef(r, "recv", 0), nb)]
                targets, sources, ring = (), (root,), nb
        elif kind == "reduce_scatter":
            total = n * nb
            if s.in_place:
                b.buffer(r, "send", total, inputs=[(0, total)], outputs=[(r * nb, (r + 1) * nb)])
                out = BufRef(r, "send", r * nb)
            else:
                b.buffer(r, "send", total, inputs=[(0, total)])
                b.buffer(r, "recv", nb, outputs=[(0, nb)])
                out = BufRef(r, "recv", 0)
            pushes = [Copy(0, BufRef(r, "send", p * nb), BufRef(p, RING, slot(r, p)), nb)
                      for p in peers]
            if s.count:
                finish = [Reduce(0, tuple(BufRef(r, "send", r * nb) if q == r else
                                          BufRef(r, RING, slot(q, r)) for q in range(n)),
                                 out, s.count, s.dtype, s.op, s.scale)]
        else:  # all_reduce
            if s.in_place:
                b.buffer(r, "recv", nb, inputs=[(0, nb)], outputs=[(0, nb)])
                own = BufRef(r, "recv", 0)
            else:
                b.buffer(r, "send", nb, inputs=[(0, nb)])
                b.buffer(r, "recv", nb, outputs=[(0, nb)])
                own = BufRef(r, "send", 0)
            pushes = [Copy(0, own, BufRef(p, RING, slot(r, p)), nb) for p in peers]
            if s.count:
                finish = [Reduce(0, tuple(own if q == r else BufRef(r, RING, slot(q, r))
                                          for q in range(n)),
                                 BufRef(r, "recv", 0), s.count, s.dtype, s.op, s.scale)]
        b.buffer(r, RING, ring)
        if kind == "broadcast" and n > 1 and r != root:
            # the root hears from each receiver once per call: at the receiver's start, so
            # that the root never waits for a round trip (see plan.RING)
            b.signal(r, 0, root, GATHERED, 1)
        b.programs[r].extend(step for step in pushes if step.nbytes)
        if kind == "broadcast" and r == root:
            # before its DONE: a receiver that hears the root's DONE has then heard, through
            # the root, that every other receiver started this call (see plan.RING)
            for p in peers:
                b.wait(r, 0, p, GATHERED, 1)
        for p in targets:
            b.signal(r, 0, p, DONE, 1)
        for p in sources:
            b.wait(r, 0, p, DONE, 1)
        b.programs[r].extend(step for step in finish
                             if not isinstance(step, Copy) or (step.nbytes and step.src != step.dst))
    plan = b.plan()
    blocks = kernel_blocks_for(kernel_bytes_of(s), b.options.kernel_sms)
    return dataclasses.replace(plan, lanes=1, options=plan.options + (("kernel_blocks", blocks),))


_ALGORITHMS = {
    "all_gather": _all_gather, "all_to_all": _all_to_all,
    "broadcast": _rooted_copy, "gather": _rooted_copy, "scatter": _rooted_copy,
    "reduce_scatter": _reducing, "all_reduce": _reducing, "reduce": _reducing,
    "barrier": _barrier, "sendrecv": _sendrecv,
}


@lru_cache(maxsize=512)
def build_plan(shape: Shape, options: Options = Options()) -> Plan:
    """The plan for ``shape``; cached, so repeated calls with one shape cost a dict lookup."""
    if shape.collective not in _ALGORITHMS:
        raise ValueError(f"build_plan: collective must be one of {COLLECTIVES}, "
                         f"got {shape.collective!r}")
    if options.self_route not in SELF_ROUTES:
        raise ValueError(f"build_plan: self_route must be one of {SELF_ROUTES}, "
                         f"got {options.self_route!r}")
    if shape.world_size < 1:
        raise ValueError(f"build_plan: world_size must be >= 1, got {shape.world_size}")
    if (options.kernel_bytes and shape.collective in KERNEL_COLLECTIVES
            and 1 < shape.world_size <= KERNEL_MAX_RANKS
            and kernel_bytes_of(shape) <= options.kernel_bytes):  # 0: off, for every size
        return _direct(_Builder(shape, options))
    return _ALGORITHMS[shape.collective](_Builder(shape, options))
