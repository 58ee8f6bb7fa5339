"""The direct kernel's plan: a whole small collective in one launch per rank
(``Options.kernel_bytes``)."""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Union

from .plan import DONE, GATHERED, RING, BufRef, Copy, Plan, Reduce
from ._builder import (KERNEL_BLOCK_BYTES, KERNEL_MAX_BLOCKS, Shape, _Builder, _gather_buffers,
                       _peers)

__all__ = ["kernel_bytes_of", "kernel_blocks_for"]


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
        if n == 1:  # a world of one: a sum of one input unscaled is that input
            finish = [Copy(0, step.inputs[0], step.output, nb)
                      if isinstance(step, Reduce) and step.scale is None else step
                      for step in finish]
        finish = [step for step in finish
                  if not isinstance(step, Copy) or (step.nbytes and step.src != step.dst)]
        if n == 1 and not finish:  # in place: the input is already the output
            b.buffers[r] = {name: dataclasses.replace(spec, outputs=())
                            for name, spec in b.buffers[r].items()}
        b.programs[r].extend(finish)
    plan = b.plan()
    blocks = kernel_blocks_for(kernel_bytes_of(s), b.options.kernel_sms)
    return dataclasses.replace(plan, lanes=1, options=plan.options + (("kernel_blocks", blocks),))
