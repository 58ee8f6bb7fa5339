"""What every algorithm is built from: a call's ``Shape``, the ``Options`` it is
planned with, and ``_Builder``, which collects each rank's buffers and steps into a
``Plan``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from .._errors import InvalidArgumentError
from .plan import (CHANNELS, DONE, GATHERED, PAIR_DONE, READY, After, BufferSpec, BufRef, Copy,
                   Mark, Plan, Reduce, Signal, Step, Wait)

__all__ = ["Shape", "Options", "COLLECTIVES", "SELF_ROUTES", "KERNEL_COLLECTIVES",
           "KERNEL_MAX_BLOCKS", "KERNEL_MAX_RANKS", "KERNEL_BLOCK_BYTES", "WORLD_ONE_KERNEL_BYTES",
           "split"]

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
#: a world of one's calls up to this size that have a step run as one direct kernel
#: whatever ``kernel_bytes`` says: no byte leaves the GPU, and that step (a same-GPU copy,
#: or a scaled sum of one input) takes SMs on any path; in one launch, which also writes
#: the completion, it costs the host one driver call instead of three
WORLD_ONE_KERNEL_BYTES = 4 << 20


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
        #: (rank, buffer, start, end) of outputs that already hold their result (a reduction
        #: of one input in place): not written, so not outputs
        self.kept: List[Tuple[int, str, int, int]] = []
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
        """``output`` = ``op`` over ``inputs``.  Over one input without a scale the result is
        that input, whatever the op (an average divides by one): a copy, or nothing in
        place, so a world of one reduces nothing."""
        if count:
            s, inputs = self.shape, tuple(inputs)
            if len(inputs) == 1 and s.scale is None:
                nbytes = count * s.itemsize
                if inputs[0] == output:
                    self.kept.append((rank, output.buffer, output.offset, output.offset + nbytes))
                self.copy(rank, lane, inputs[0], output, nbytes)
                return
            self.programs[rank].append(Reduce(lane, inputs, output, count, s.dtype, s.op,
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
        for rank, name, start, end in self.kept:
            spec = self.buffers[rank][name]
            self.buffers[rank][name] = replace(spec, outputs=_without(spec.outputs, start, end))
        used = {step.lane for program in self.programs for step in program}
        if len(used) == 1 and lanes > 1:
            # every step on one lane (a world of one): a one-lane plan, which runs on its
            # caller's stream with no lane to fork or join
            self.programs = [[replace(step, lane=0) for step in program]
                             for program in self.programs]
            lanes = 1
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


def _without(ranges: Tuple[Tuple[int, int], ...], start: int, end: int
             ) -> Tuple[Tuple[int, int], ...]:
    """``ranges`` less the bytes [start, end)."""
    left = []
    for a, b in ranges:
        for piece in ((a, min(b, start)), (max(a, end), b)):
            if piece[1] > piece[0]:
                left.append(piece)
    return tuple(left)


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
