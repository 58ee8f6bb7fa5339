"""The P2P executor: issue one rank's plan steps through its device.

The executor holds no algorithm: it interprets the steps a plan gives this rank,
resolving ``BufRef`` (rank, buffer, offset) to addresses and pad slots to the
peers' mapped signal pads, and adding the communicator's signal base to every
value.  Consecutive copies on one lane with nothing between them are one batch
(no order among them is needed: the plan put no signal between them); consecutive
waits on one lane are one batched memop.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, List, Sequence, Tuple

from ..sched.plan import After, Copy, Mark, Plan, Reduce, Signal, Wait

__all__ = ["Executor", "compile_program"]

# compiled op kinds
_COPY, _LOCAL_COPY, _SIGNAL, _WAIT, _REDUCE, _MARK, _AFTER = range(7)


def _overlap(a, a_bytes, b, b_bytes) -> bool:
    return a[:2] == b[:2] and a[2] < b[2] + b_bytes and b[2] < a[2] + a_bytes


def _independent(batch, item) -> bool:
    """True when ``item`` neither reads nor writes what a copy of ``batch`` writes, nor
    writes what one reads: then the batch may run its copies in any order."""
    dst, src, nbytes = item
    return not any(_overlap(src, nbytes, d, n) or _overlap(dst, nbytes, d, n)
                   or _overlap(dst, nbytes, s, n) for d, s, n in batch)


@lru_cache(maxsize=1024)
def compile_program(plan: Plan, rank: int) -> Tuple[tuple, ...]:
    """``rank``'s steps as tuples the executor runs without isinstance checks, with
    runs of copies (and of waits) on one lane merged into one op."""
    ops: List[list] = []
    for step in plan.programs[rank]:
        if isinstance(step, Copy):
            local = step.src.rank == step.dst.rank == rank
            kind = _LOCAL_COPY if local else _COPY
            item = ((step.dst.rank, step.dst.buffer, step.dst.offset),
                    (step.src.rank, step.src.buffer, step.src.offset), step.nbytes)
            if (ops and ops[-1][0] == kind == _COPY and ops[-1][1] == step.lane
                    and _independent(ops[-1][2], item)):
                ops[-1][2].append(item)
            else:
                ops.append([kind, step.lane, [item]])
        elif isinstance(step, Wait):
            if ops and ops[-1][0] == _WAIT and ops[-1][1] == step.lane:
                ops[-1][2].append((step.slot, step.value))
            else:
                ops.append([_WAIT, step.lane, [(step.slot, step.value)]])
        elif isinstance(step, Signal):
            ops.append([_SIGNAL, step.lane, (step.peer, step.slot, step.value)])
        elif isinstance(step, Reduce):
            ops.append([_REDUCE, step.lane, (
                tuple((ref.rank, ref.buffer, ref.offset) for ref in step.inputs),
                (step.output.rank, step.output.buffer, step.output.offset),
                step.count, step.dtype, step.op)])
        elif isinstance(step, Mark):
            ops.append([_MARK, step.lane, step.mark])
        elif isinstance(step, After):
            ops.append([_AFTER, step.lane, step.mark])
    return tuple((kind, lane, tuple(arg) if isinstance(arg, list) else arg)
                 for kind, lane, arg in ops)


class Executor:
    """Issues plans for one rank.

    ``pads[peer]`` is the address (local or mapped) of ``peer``'s signal pad;
    ``pads[rank]`` is this rank's own.
    """

    def __init__(self, rank: int, device: Any, streams: Any, pads: Sequence[Any]):
        self.rank = rank
        self.device = device
        self.streams = streams
        self.pads = list(pads)

    def issue(self, plan: Plan, addresses: Dict[Tuple[int, str], Any], base: int) -> None:
        """Enqueue ``plan``'s steps for this rank; ``addresses[(rank, name)]`` are buffer bases."""
        device, lanes, pads, own_pad = self.device, self.streams.lanes, self.pads, self.pads[self.rank]
        marks: Dict[int, Any] = {}

        def at(ref):
            return addresses[(ref[0], ref[1])] + ref[2]

        try:
            for kind, lane_index, arg in compile_program(plan, self.rank):
                lane = lanes[lane_index]
                if kind == _COPY:
                    if len(arg) == 1:
                        dst, src, nbytes = arg[0]
                        device.copy(lane, at(dst), at(src), nbytes)
                    else:
                        device.copy_batch(lane, [(at(dst), at(src), n) for dst, src, n in arg])
                elif kind == _LOCAL_COPY:
                    for dst, src, nbytes in arg:
                        device.local_copy(lane, at(dst), at(src), nbytes)
                elif kind == _WAIT:
                    if len(arg) == 1:
                        device.wait_value(lane, own_pad + 8 * arg[0][0], base + arg[0][1])
                    else:
                        device.wait_values(lane, [(own_pad + 8 * slot, base + value)
                                                  for slot, value in arg])
                elif kind == _SIGNAL:
                    peer, slot, value = arg
                    device.write_value(lane, pads[peer] + 8 * slot, base + value)
                elif kind == _REDUCE:
                    inputs, output, count, dtype, op = arg
                    device.reduce(lane, at(output), [at(ref) for ref in inputs], count, dtype, op)
                elif kind == _MARK:
                    event = self.streams.event()
                    device.record(lane, event)
                    marks[arg] = event
                else:  # _AFTER
                    device.wait_event(lane, marks[arg])
        finally:
            for event in marks.values():
                self.streams.release(event)
