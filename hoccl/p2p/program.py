"""A plan compiled into one rank's program: the steps as tuples ``(kind, lane,
argument)``, independent copies merged, runs of chunk sums fused (``compile_program``),
and what issuing programs together takes (``_families``).  The executor
(``hoccl.p2p.Executor``) binds and issues them."""

from __future__ import annotations

from enum import IntEnum
from typing import Dict, Iterable, List, Optional, Tuple

from .._dtypes import ITEMSIZE
from ..backends._kernels import CHUNK_FLAGS, MAX_INPUTS
from ..sched.plan import After, Copy, Mark, Plan, Reduce, Signal, Wait

__all__ = ["StepKind", "compile_program", "marks_of", "direct_kind"]


class StepKind(IntEnum):
    """What a compiled step ``(kind, lane, argument)`` does, and its argument
    (compiled: buffers as ``BufRef`` and slots; bound: addresses)."""
    COPY = 0        #: copies on a copy engine: ((dst, src, nbytes), ...)
    LOCAL_COPY = 1  #: same-GPU copies on at most ``copy_sms`` SMs: ((dst, src, nbytes), ...)
    SIGNAL = 2      #: a value into a peer's pad slot: (peer, slot, value) / (address, value)
    WAIT = 3        #: until an own pad slot holds a value: (slot, value) / (address, value)
    REDUCE = 4      #: (inputs, output, count, dtype, op, scale, sms) on at most ``sms`` SMs
    #: (None: the communicator's ``max_sms``)
    MARK = 5        #: record an event (the mark's number) that AFTER steps wait for
    AFTER = 6       #: wait for a MARK's event
    RESET = 7       #: a graph slot back to 0, after its last wait in a captured call
    DIRECT = 8      #: a whole direct-kernel program (a ``DirectProgram``), one launch
    CHUNKS = 9      #: a lane's run of chunk waits and sums as one launch (``_chunk_runs``)


# the loops below name the kinds through module globals: no attribute lookup per step
_COPY, _LOCAL_COPY, _SIGNAL, _WAIT = (StepKind.COPY, StepKind.LOCAL_COPY, StepKind.SIGNAL,
                                      StepKind.WAIT)
_REDUCE, _MARK, _AFTER, _RESET = StepKind.REDUCE, StepKind.MARK, StepKind.AFTER, StepKind.RESET
_DIRECT, _CHUNKS = StepKind.DIRECT, StepKind.CHUNKS



def _overlap(a, a_bytes, b, b_bytes) -> bool:
    return a[:2] == b[:2] and a[2] < b[2] + b_bytes and b[2] < a[2] + a_bytes


def _independent(batch, item) -> bool:
    """True when ``item`` neither reads nor writes what a copy of ``batch`` writes, nor
    writes what one reads: then the batch may run its copies in any order."""
    dst, src, nbytes = item
    return not any(_overlap(src, nbytes, d, n) or _overlap(dst, nbytes, d, n)
                   or _overlap(dst, nbytes, s, n) for d, s, n in batch)


def _families(plans: Iterable[Plan]) -> Tuple[Dict[tuple, int], int]:
    """Each family's first lane, and the lanes all of them take.  Plans that signal the
    same slots (every collective; send/recv of one pair and direction) run one after
    another on the same lanes, each plan's lanes starting only once every lane of the one
    before has finished (``Executor._after_family``): a slot has one writer, its values
    only grow, and the plans share the rank's scratch.  Plans of different families run
    side by side."""
    widths: Dict[tuple, int] = {}
    for plan in plans:
        widths[plan.pair] = max(widths.get(plan.pair, 0), plan.lanes)
    firsts: Dict[tuple, int] = {}
    total = 0
    for family, width in widths.items():
        firsts[family] = total
        total += width
    return firsts, max(total, 1)


def _chunk_runs(ops: List[list], rank: int) -> List[list]:
    """``ops`` with every lane's run of two or more chunks that one launch can do
    (``Device.reduce_chunks``) replaced by one ``_CHUNKS`` op where the run began.  A
    chunk is a lane's waits on one or more slots (at most ``CHUNK_FLAGS``) for one value,
    then a sum; the run's chunks wait on the same slots for consecutive values, and
    their sums are alike (dtype, op, scale, inputs: at most ``MAX_INPUTS``, all in this
    rank's own buffers), each a whole number of 16-byte vectors, at least its own length,
    further along every buffer than the one before, with the same count (the last may be
    shorter).  An output may share its buffer only with an input at its very place
    (element-wise in place).  Other lanes' ops in between keep their places: a lane's
    stream order is all that orders its steps."""
    lanes: Dict[int, List[int]] = {}
    for index, (_, lane, _) in enumerate(ops):
        lanes.setdefault(lane, []).append(index)
    replaced: Dict[int, Optional[list]] = {}  # index -> the fused op (None: dropped)
    for indices in lanes.values():
        lane_ops = [ops[index] for index in indices]
        position = 0
        while position < len(indices):
            run = _chunk_run(lane_ops, position, rank)
            if run is None:
                position += 1
                continue
            fused, taken = run
            replaced[indices[position]] = fused
            for index in indices[position + 1:position + taken]:
                replaced[index] = None
            position += taken
    if not replaced:
        return ops
    kept: List[list] = []
    for index, op in enumerate(ops):
        if index not in replaced:
            kept.append(op)
        elif replaced[index] is not None:
            kept.append(replaced[index])  # type: ignore[arg-type]
    return kept


def _chunk(lane_ops: List[list], at: int) -> Optional[Tuple[tuple, int, tuple, int]]:
    """``(slots, value, sum, ops taken)`` of the chunk at ``lane_ops[at]``: waits for one
    value on distinct slots, then a sum; None if there is none there."""
    slots: List[int] = []
    value = None
    while at + len(slots) < len(lane_ops) and lane_ops[at + len(slots)][0] == _WAIT:
        slot, wanted = lane_ops[at + len(slots)][2]
        if value is not None and wanted != value or slot in slots:
            return None
        slots.append(slot)
        value = wanted
    end = at + len(slots)
    if (not slots or len(slots) > CHUNK_FLAGS or end >= len(lane_ops)
            or lane_ops[end][0] != _REDUCE):
        return None
    assert value is not None
    return tuple(slots), value, lane_ops[end][2], len(slots) + 1


def _chunk_run(lane_ops: List[list], start: int, rank: int) -> Optional[Tuple[list, int]]:
    """The ``_CHUNKS`` op of the longest run at ``lane_ops[start]`` (``lane_ops``: one
    lane's ops) and how many ops it takes, or None when fewer than two chunks qualify."""
    first = _chunk(lane_ops, start)
    if first is None:
        return None
    slots, value, (inputs, output, count, dtype, op, scale, sms), taken = first
    itemsize = ITEMSIZE.get(dtype, 0)
    refs = inputs + (output,)
    if (not itemsize or len(inputs) > MAX_INPUTS or count <= 0
            or any(ref[0] != rank for ref in refs)
            or any(ref[1] == output[1] and ref[2] != output[2] for ref in inputs)):
        return None
    chunks, stride, last_count, previous = 1, 0, count, refs
    while last_count == count:
        following = _chunk(lane_ops, start + taken)
        if following is None:
            break
        next_slots, next_value, (next_inputs, next_output, next_count, *rest), size = following
        next_refs = next_inputs + (next_output,)
        if (next_slots != slots or next_value != value + chunks
                or tuple(rest) != (dtype, op, scale, sms) or len(next_refs) != len(refs)
                or not 0 < next_count <= count
                or any(a[:2] != b[:2] for a, b in zip(previous, next_refs))):
            break
        steps = {b[2] - a[2] for a, b in zip(previous, next_refs)}
        step = steps.pop()
        if (steps or step % 16 or step < count * itemsize
                or (stride and step != stride * itemsize)):
            break
        stride, previous, last_count = step // itemsize, next_refs, next_count
        chunks += 1
        taken += size
    if chunks < 2:
        return None
    fused = [_CHUNKS, lane_ops[start][1],
             (slots, value, inputs, output, count, last_count, chunks, stride, dtype, op, scale,
              sms)]
    return fused, taken


def compile_program(plan: Plan, rank: int, fuse: bool = False,
                    sms: Optional[int] = None) -> Tuple[tuple, ...]:
    """``rank``'s steps as tuples the executor runs without isinstance checks, with runs
    of independent copies on one lane merged, and with ``fuse`` each lane's run of chunk
    waits and sums as one ``_CHUNKS`` op (``_chunk_runs``).  ``sms``: the SM cap of the
    call's reductions (a tuning table row's ``max_sms``; None: the communicator's
    ``max_sms`` when the call is issued).  Made once per prepared call
    (``hoccl._engine.prepared``), which keeps it."""
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
            ops.append([_WAIT, step.lane, (step.slot, step.value)])
        elif isinstance(step, Signal):
            ops.append([_SIGNAL, step.lane, (step.peer, step.slot, step.value)])
        elif isinstance(step, Reduce):
            ops.append([_REDUCE, step.lane, (
                tuple((ref.rank, ref.buffer, ref.offset) for ref in step.inputs),
                (step.output.rank, step.output.buffer, step.output.offset),
                step.count, step.dtype, step.op, step.scale, sms)])
        elif isinstance(step, Mark):
            ops.append([_MARK, step.lane, step.mark])
        elif isinstance(step, After):
            ops.append([_AFTER, step.lane, step.mark])
    if fuse and not plan.kernel_blocks:
        ops = _chunk_runs(ops, rank)
    return tuple((kind, lane, tuple(arg) if isinstance(arg, list) else arg)
                 for kind, lane, arg in ops)


def marks_of(program: Tuple[tuple, ...]) -> int:
    """How many events a compiled program's MARK steps record (``Executor.reserve``)."""
    return sum(1 for kind, _, _ in program if kind == _MARK)


def direct_kind(plan: Plan) -> Tuple[str, str]:
    """The (dtype, op) of a direct-kernel plan's kernel: its reductions', else any."""
    for program in plan.programs:
        for step in program:
            if isinstance(step, Reduce):
                return step.dtype, step.op
    return "uint8", "sum"
