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

from functools import lru_cache
from typing import Optional

from ._builder import (COLLECTIVES, KERNEL_COLLECTIVES, KERNEL_MAX_BLOCKS, KERNEL_MAX_RANKS,
                       SELF_ROUTES, WORLD_ONE_KERNEL_BYTES, Options, Shape, _Builder, _chunks,
                       _gather_buffers, _peers, split)
from ._direct import _direct, kernel_blocks_for, kernel_bytes_of
from .plan import DONE, GATHERED, PAIR_DONE, PAIR_READY, READY, BufRef, Plan

__all__ = ["Shape", "Options", "build_plan", "COLLECTIVES", "KERNEL_COLLECTIVES",
           "KERNEL_MAX_BLOCKS", "KERNEL_MAX_RANKS", "SELF_ROUTES", "split", "kernel_bytes_of",
           "kernel_blocks_for", "path_of", "WORLD_ONE_KERNEL_BYTES"]


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
    path = path_of(s, b.options)
    one_shot, pull = path == "one_shot", path == "pull"
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


_ALGORITHMS = {
    "all_gather": _all_gather, "all_to_all": _all_to_all,
    "broadcast": _rooted_copy, "gather": _rooted_copy, "scatter": _rooted_copy,
    "reduce_scatter": _reducing, "all_reduce": _reducing, "reduce": _reducing,
    "barrier": _barrier, "sendrecv": _sendrecv,
}


def path_of(shape: Shape, options: Options) -> str:
    """The path ``build_plan`` takes for ``shape`` with ``options``: "direct" (one direct
    kernel), "one_shot" (an all_reduce in one phase), "pull" (a reduction that sums the
    peers' inputs where they lie) or "push".  Each threshold compares nccl-tests' size of
    the call (``kernel_bytes_of``: the largest buffer, a reduction's whole input); a
    threshold of 0 is off for every size, an empty buffer's included.  A world of one
    takes the direct kernel up to ``WORLD_ONE_KERNEL_BYTES`` whatever ``kernel_bytes`` is,
    where it has a step: out of place, or a scaled sum (else its completion alone costs
    less as two stream memory operations than as a launch)."""
    n, size = shape.world_size, kernel_bytes_of(shape)
    limit = options.kernel_bytes
    if n == 1 and not (shape.in_place and shape.scale is None
                       and shape.collective != "all_to_all"):
        limit = max(limit, WORLD_ONE_KERNEL_BYTES)  # (in place, a world of one has no step)
    if (limit and shape.collective in KERNEL_COLLECTIVES and n <= KERNEL_MAX_RANKS
            and size <= limit):
        return "direct"
    if n > 1 and shape.collective == "all_reduce" and options.one_shot_bytes \
            and size <= options.one_shot_bytes:
        return "one_shot"
    if n > 1 and shape.collective in ("reduce_scatter", "all_reduce", "reduce") \
            and options.pull_bytes and size <= options.pull_bytes:
        return "pull"
    return "push"


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
    if path_of(shape, options) == "direct":
        return _direct(_Builder(shape, options))
    return _ALGORITHMS[shape.collective](_Builder(shape, options))
