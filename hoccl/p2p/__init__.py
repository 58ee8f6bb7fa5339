"""The P2P executor: issue one rank's plan steps through its device.

The executor holds no algorithm: it interprets the steps a plan gives this rank, in
three stages, the first two kept by the caller's prepared call (``hoccl._engine``)::

    compile_program(plan, rank)      steps as tuples, independent copies merged (per plan;
                                     ``hoccl.p2p.program``)
    executor.bind(plan, addresses)   BufRef (rank, buffer, offset) and pad slots resolved
                                     to addresses through the rank's SignalPad's tables
                                     (own slots for waits, the peers' pads for signals)
    executor.issue(items, value)     the call's signal base added to every value, the
                                     steps enqueued in one pass (``issue``: from there
                                     only the stream manager and the device are called)

Stream memory operations are buffered per lane and flushed as one list before the
lane's next copy, kernel or event (``Device.memops``, in order: single calls or one
``cuStreamBatchMemOp``, as the device finds cheaper); consecutive independent copies
on one lane become one batch.  A rank's whole collective on two GPUs is then a handful
of driver calls.

A lane's run of chunk waits and sums (a pushed reduce_scatter or reduce: wait for chunk
k's copies, sum chunk k, for every chunk) is one launch instead (``fuse_sums``, the
default): its blocks wait on the device for each chunk's signal (``Device.reduce_chunks``).
The plan is unchanged (the same waits, in the same order, now kept by the kernel), so
ranks that fuse and ranks that do not still meet.

A direct-kernel plan (``Plan.kernel_blocks``) binds to one ``DirectProgram`` instead:
its signals and waits address the pads' direct-kernel slots, and the whole program is
one launch (``Device.direct``) on lane 0.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..backends._base import (DIRECT_COPY, DIRECT_REDUCE, DIRECT_SIGNAL, DIRECT_WAIT,
                              DirectProgram, MemOp, SmCaps)
from ..sched.plan import RING, Plan
from .program import (_AFTER, _CHUNKS, _COPY, _DIRECT, _LOCAL_COPY, _MARK, _REDUCE, _RESET,
                      _SIGNAL, _WAIT, StepKind, _families, compile_program, direct_kind,
                      marks_of)

__all__ = ["Executor", "StepKind", "compile_program", "marks_of"]


class Executor:
    """Issues plans for one rank.

    ``pad`` is the rank's ``SignalPad``: its tables ``pad.waits[slot]`` (where its lanes
    wait) and ``pad.signals[peer][slot]`` (where they signal ``peer``), and their
    direct-kernel twins, are the only addresses of slots the executor uses.
    """

    def __init__(self, rank: int, device: Any, streams: Any, pad: Any, sms: SmCaps):
        self.rank = rank
        self.device = device
        self.streams = streams
        self.pad = pad
        self.sms = sms  # the communicator's caps (its device may serve other communicators)
        #: chunk sums issued as one launch that waits on the device (``_CHUNKS``), in all
        self.fused_launches = 0

    def compile(self, plan: Plan, captured: bool = False,
                sms: Optional[int] = None) -> Tuple[tuple, ...]:
        """This rank's compiled steps of ``plan`` as ``bind`` takes them (chunk sums fused
        as the caps say, never in a captured call; ``sms``: the call's own SM cap for its
        reductions, ``compile_program``)."""
        return compile_program(plan, self.rank,
                               fuse=not captured and self.sms is not None and self.sms.fuse_sums,
                               sms=sms)

    def bind(self, plan: Plan, addresses: Dict[Tuple[int, str], Any],
             captured: bool = False, signature: int = 0,
             program: Optional[Tuple[tuple, ...]] = None) -> Tuple[tuple, ...]:
        """This rank's compiled steps of ``plan`` (``program``: from ``compile``, made now
        if not given) with every address resolved: ``addresses[(rank, name)]`` are the
        buffers' bases, slots become addresses in this rank's pad (waits) or a peer's
        (signals).  Signal values stay relative to the call; ``issue`` adds its base.

        ``captured`` (a call captured into a CUDA graph, ``issue`` with callers): the graph
        slots instead, and after the last wait on each slot a reset of it to 0 on the
        same lane (``hoccl.sched.replay``), so that every replay starts from zeros.

        ``signature``: a direct kernel's digest of the call, which its peers' kernels
        compare with theirs (``DirectProgram``; 0: unchecked)."""
        pad = self.pad
        if program is None:
            program = self.compile(plan, captured)
        if plan.kernel_blocks:
            return ((_DIRECT, 0, self._direct(plan, program, addresses, signature)),)
        offset = pad.graph_offset if captured else 0
        waits, signals = pad.waits, pad.signals
        last: Dict[int, int] = {}  # slot -> index of its last wait
        if captured:
            for index, (kind, _, arg) in enumerate(program):
                if kind == _WAIT:
                    last[arg[0]] = index

        def at(ref):
            return addresses[(ref[0], ref[1])] + ref[2]

        bound = []
        for index, (kind, lane_index, arg) in enumerate(program):
            if kind == _SIGNAL:
                peer, slot, value = arg
                arg = (signals[peer][slot + offset], value)
            elif kind == _WAIT:
                slot, value = arg
                arg = (waits[slot + offset], value)
                if captured and last[slot] == index:
                    bound.append((kind, lane_index, arg))
                    kind, arg = _RESET, waits[slot + offset]
            elif kind == _COPY or kind == _LOCAL_COPY:
                arg = tuple((at(dst), at(src), nbytes) for dst, src, nbytes in arg)
            elif kind == _REDUCE:
                inputs, output, count, dtype, op, scale, cap = arg
                arg = (tuple(at(ref) for ref in inputs), at(output), count, dtype, op, scale,
                       cap)
            elif kind == _CHUNKS:
                slots, value, inputs, output, *rest = arg
                arg = (tuple(waits[slot] for slot in slots), value,
                       tuple(at(ref) for ref in inputs), at(output), *rest)
            bound.append((kind, lane_index, arg))
        return tuple(bound)

    def _direct(self, plan: Plan, program: Tuple[tuple, ...],
                addresses: Dict[Tuple[int, str], Any], signature: int) -> DirectProgram:
        """``program`` (a direct-kernel plan's, every step on lane 0) as one DirectProgram.
        Its values need no base and no graph slots: the kernel adds its own epoch.  An
        address in a ring (``plan.RING``: ``addresses`` holds its base and the size of a
        half) carries that size as its shift, which the kernel adds in odd epochs."""
        pad = self.pad

        def at(ref) -> Tuple[Any, int]:
            if ref[1] == RING:
                base, half = addresses[(ref[0], ref[1])]
                return base + ref[2], half
            return addresses[(ref[0], ref[1])] + ref[2], 0

        ops: List[tuple] = []
        dtype, op, scale = "uint8", "sum", None
        for kind, _, arg in program:
            if kind == _SIGNAL:
                peer, slot, value = arg
                ops.append((DIRECT_SIGNAL, pad.kernel_signals[peer][slot], value))
            elif kind == _WAIT:
                slot, value = arg
                ops.append((DIRECT_WAIT, pad.kernel_waits[slot], value))
            elif kind == _COPY or kind == _LOCAL_COPY:
                for dst, src, nbytes in arg:
                    (dst_address, dst_shift), (src_address, src_shift) = at(dst), at(src)
                    ops.append((DIRECT_COPY, dst_address, src_address, nbytes, dst_shift,
                                src_shift))
            elif kind == _REDUCE:
                inputs, output, count, dtype, op, scale, _ = arg
                out_address, out_shift = at(output)
                ops.append((DIRECT_REDUCE, out_address, tuple(at(ref) for ref in inputs), count,
                            out_shift))
            else:
                raise ValueError(f"bind: a direct-kernel plan has no {kind} steps")
        return DirectProgram(plan.kernel_blocks, pad.kernel_counter, tuple(ops), dtype, op, scale,
                             self.streams.completion, self.streams.host_word,
                             self.streams.error_word, signature, pad.signature_shift,
                             pad.signature_half)

    def issue_on_caller(self, program: Tuple[tuple, ...], caller: Any, value: int,
                        after: int, base: int = 0) -> None:
        """A one-lane plan's program (``bind``) on the caller's stream itself: no lane, no
        entry event, no fence.  A direct kernel's is one launch; a copy-engine plan's
        steps are its memory operations and copies, signal values offset by ``base``.
        ``value`` (an eager call) is written into the completion words at the end (by
        the kernel, or by the last memory operations; 0: a call captured into a graph
        writes none); ``after``: a completion value the caller's stream must reach first
        (the previous call's, when this stream is not yet ordered after it), so that
        completion values keep growing in call order."""
        device = self.device
        if program and program[0][0] == _DIRECT:
            ((_, _, direct),) = program
            if after:
                device.wait_value(caller, self.streams.completion, after)
            device.direct(caller, direct, value)
            return
        # one stream, no lanes to fork or join: the steps in order, memory operations
        # gathered until the next other step (as ``issue`` does on each lane)
        pending = self.streams.reach(after)
        marks: Dict[Any, Any] = {}
        write, wait = MemOp.WRITE, MemOp.WAIT
        try:
            for kind, _, arg in program:
                if kind == _SIGNAL:
                    pending.append((write, arg[0], base + arg[1]))
                elif kind == _WAIT:
                    pending.append((wait, arg[0], base + arg[1]))
                elif kind == _RESET:
                    pending.append((write, arg, 0))
                else:
                    if pending:
                        device.memops(caller, pending)
                        pending = []
                    self._step(caller, kind, arg, base, marks, 0, True)
            if value:
                pending.extend(self.streams.completion_writes(value))
            if pending:
                device.memops(caller, pending)
        finally:
            for event in marks.values():
                self.streams.release(event)

    def issue(self, items: Sequence[Tuple[Plan, Tuple[tuple, ...], int, Any]],
              value: int, callers: Optional[Sequence[Any]] = None, after: int = 0,
              fence: Sequence[Any] = (),
              reserve: Sequence[Tuple[Plan, int]] = ()) -> None:
        """Enqueue each ``(plan, program, base, entry)`` of ``items`` (``program``: the
        plan's steps for this rank from ``bind``) and end with the completion value
        ``value``.  ``after``: the value of a call that ran on its caller's stream, not
        on the lanes (``issue_on_caller``); every lane waits for the completion word to
        reach it before its first step, so that this rank's signals into a peer's slot
        keep their call order (a later call's value is never overwritten by an earlier
        call's, which the peer would then wait past for ever) and completion values grow.

        ``fence``: caller streams to make wait for ``value`` (calls enqueued without a
        fence, once what they need is known), once every step that leads to its write is
        enqueued (a GPU's hardware queue would hold the lanes' steps behind a caller's
        wait enqueued before them), after creating every lane and event that
        ``reserve`` (``(plan, marks)`` of every call not yet issued) will take: a caller
        must never wait while a driver call that may synchronize the context runs.

        Each plan's lanes wait for its caller's ``entry`` event, then run its steps
        (signal values offset by ``base``).  Several items (a ``hoccl.group()``) run
        side by side, each family of them (the collectives; the send/recv of one pair and
        direction) on lanes of its own, so that calls of one group never wait for each
        other (a ring of send/recv); lane 0 then joins every lane used and writes the
        completion value once.

        ``callers`` (calls captured into a CUDA graph, bound with ``captured``, base 0):
        their lanes are the capture lanes (every lane a capture forks stays in it until
        the capture ends, so eager calls must not share them), copies go one by one
        (``cuMemcpyBatchAsync`` cannot be captured), no completion value is written (a
        replay is not a call the host counts), and the exit is an event every caller's
        stream waits for: the lanes join the capture back, as a graph needs.

        The one pass down: from here only the stream manager's and the device's methods
        are called.  A lane's memory operations are kept until its next other step and go
        as one list (``Device.memops`` keeps their order); independent copies go as one
        batched call, except in a capture (``cuMemcpyBatchAsync`` cannot be captured).
        """
        firsts, total = _families(plan for plan, _, _, _ in items)
        needs = _needs(reserve) if fence else None
        device, streams = self.device, self.streams
        pending: List[list] = [[] for _ in range(total)]
        marks: Dict[Any, Any] = {}
        batch = callers is None
        write, wait = MemOp.WRITE, MemOp.WAIT
        if needs is not None:  # see ``reserve``
            streams.ensure_lanes(needs[0])
            streams.reserve_events(needs[1])
        if callers is not None:
            streams.ensure_capture_lanes(total)
            lanes = streams.capture_lanes
        else:
            streams.ensure_lanes(total)  # made by ``reserve`` already, unless skipped
            lanes = streams.lanes
        start = streams.reach(0 if callers is not None else after)
        if start:
            for waiting in pending:
                waiting.extend(start)
        used: Dict[Any, int] = {}  # family -> the lanes its items so far have taken
        try:
            for item, (plan, program, base, entry) in enumerate(items):
                family = plan.pair if plan is not None else None
                first = firsts[family]
                if family in used:
                    span = max(used[family], plan.lanes)
                    self._after_family(lanes, pending, first, used[family], span, marks, item)
                    used[family] = span
                elif plan is not None:
                    used[family] = plan.lanes
                if entry is not None:
                    for lane_index in range(first, first + plan.lanes):
                        if pending[lane_index]:
                            device.memops(lanes[lane_index], pending[lane_index])
                            pending[lane_index] = []
                        device.wait_event(lanes[lane_index], entry)
                for kind, lane_index, arg in program:
                    lane_index += first
                    if kind == _SIGNAL:
                        pending[lane_index].append((write, arg[0], base + arg[1]))
                        continue
                    if kind == _WAIT:
                        pending[lane_index].append((wait, arg[0], base + arg[1]))
                        continue
                    if kind == _RESET:
                        pending[lane_index].append((write, arg, 0))
                        continue
                    lane = lanes[lane_index]
                    if pending[lane_index]:
                        device.memops(lane, pending[lane_index])
                        pending[lane_index] = []
                    self._step(lane, kind, arg, base, marks, item, batch)
            # join: lane 0 continues only after every other lane's last step
            for lane_index in range(1, total):
                for index in (lane_index, 0):
                    if pending[index]:
                        device.memops(lanes[index], pending[index])
                        pending[index] = []
                event = marks[(-1, lane_index)] = streams.event()
                device.record(lanes[lane_index], event)
                device.wait_event(lanes[0], event)
            if callers is None and value:
                pending[0].extend(streams.completion_writes(value))
            if pending[0]:
                device.memops(lanes[0], pending[0])
            # the callers wait for the completion value only now, after every step that
            # leads to its write: a GPU runs its streams' work through a few hardware
            # queues in the order it was enqueued, and a caller's wait enqueued before a
            # lane's steps can hold those steps behind it (the lane shares its queue), so
            # that the value it waits for is never written
            for caller in fence:
                streams.fence_out(caller, value)
            if callers is not None:
                end = marks[(-2, 0)] = streams.event()
                device.record(lanes[0], end)
                for caller in callers:
                    device.wait_event(caller, end)
        finally:
            for event in marks.values():
                streams.release(event)

    def load(self, plan: Plan) -> None:
        """Have ``plan``'s direct kernel loaded (before any caller waits for its call)."""
        if plan.kernel_blocks:  # the device loads each kernel once
            self.device.prepare_direct(*direct_kind(plan))

    def reserve(self, plans: Iterable[Tuple[Plan, int]], captured: bool = False) -> None:
        """Create now every lane and event that issuing ``plans`` (each ``(plan, marks)``:
        ``marks_of`` its program) together will take (``captured``: the capture lanes).

        Called before a caller's stream is fenced: creating a stream (or an event) may
        synchronize the context, and once a caller's stream waits for a call that is not
        yet issued, such a driver call would wait for itself (FSDP2's first backward
        reduce-scatter, which needs a second lane, hung so)."""
        total, events = _needs(plans)
        if captured:
            self.streams.ensure_capture_lanes(total)
        else:
            self.streams.ensure_lanes(total)
        self.streams.reserve_events(events)

    def _step(self, lane: Any, kind: int, arg: Any, base: int, marks: Dict[Any, Any],
              item: int, batch: bool) -> None:
        """One step other than a memory operation on ``lane`` (``item``: its plan's index
        among the issued ones, which names its marks; ``batch``: independent copies may
        go as one batched call)."""
        device, sms = self.device, self.sms
        if kind == _COPY:
            if len(arg) == 1 or not batch:
                for copy in arg:
                    device.copy(lane, *copy)
            else:
                device.copy_batch(lane, arg)
        elif kind == _LOCAL_COPY:
            for dst, src, nbytes in arg:
                device.local_copy(lane, dst, src, nbytes, sms.copy_sms)
        elif kind == _REDUCE:
            inputs, output, count, dtype, op, scale, cap = arg
            device.reduce(lane, output, inputs, count, dtype, op, sms=cap or sms.max_sms,
                          scale=scale)
        elif kind == _CHUNKS:
            self.fused_launches += 1
            flags, chunk_value, inputs, output, count, last_count, chunks, stride, dtype, op, \
                scale, cap = arg
            device.reduce_chunks(lane, flags, base + chunk_value, output, inputs, count,
                                 last_count, chunks, stride, dtype, op, sms=cap or sms.max_sms,
                                 scale=scale)
        elif kind == _MARK:
            event = marks[(item, arg)] = self.streams.event()
            device.record(lane, event)
        elif kind == _AFTER:
            device.wait_event(lane, marks[(item, arg)])
        else:  # _DIRECT
            device.direct(lane, arg)

    def _after_family(self, lanes: Any, pending: List[list], first: int, used: int, span: int,
                      marks: Dict[Any, Any], item: int) -> None:
        """Make lanes ``first .. first + span`` wait until the ``used`` lanes from ``first``
        that earlier plans of the family took have run every step so far: the next plan
        of a family (a ``hoccl.group()`` of collectives, or of sends in one direction)
        runs as if called alone after them.  Side by side, a later plan's signals
        (larger values into the same slots) would release the earlier plan's waits too
        soon on the peers, and its copies into the shared scratch would overwrite what
        an earlier lane still reads::

            lane first   ─ plan A ─┬─ wait ── record ──┬─ plan B
            lane first+1 ─ plan A ─ record ─┘           └─ wait ── plan B
        """
        device, streams = self.device, self.streams
        _flush(device, lanes, pending, first)  # its own steps stay before the waits
        for lane_index in range(first + 1, first + used):
            _flush(device, lanes, pending, lane_index)
            joined = marks[(-3, item, lane_index)] = streams.event()
            device.record(lanes[lane_index], joined)
            device.wait_event(lanes[first], joined)
        if span > 1:
            released = marks[(-3, item, first)] = streams.event()
            device.record(lanes[first], released)
            for lane_index in range(first + 1, first + span):
                _flush(device, lanes, pending, lane_index)
                device.wait_event(lanes[lane_index], released)

def _flush(device: Any, lanes: Any, pending: List[list], lane_index: int) -> None:
    """Issue ``lane_index``'s buffered memory operations (before an event or a copy)."""
    if pending[lane_index]:
        device.memops(lanes[lane_index], pending[lane_index])
        pending[lane_index] = []


def _needs(plans: Iterable[Tuple[Plan, int]]) -> Tuple[int, int]:
    """(lanes, events) that issuing ``plans`` (each ``(plan, marks)``) together takes: the
    lanes as ``_families`` counts them; the events for marks, joins, entries, a captured
    call's exit, and the barriers between plans of one family (``_after_family``: at
    most the family's width each)."""
    widths: Dict[tuple, int] = {}
    members: Dict[tuple, int] = {}
    marks = count = 0
    for plan, plan_marks in plans:
        widths[plan.pair] = max(widths.get(plan.pair, 0), plan.lanes)
        members[plan.pair] = members.get(plan.pair, 0) + 1
        marks += plan_marks
        count += 1
    total = max(sum(widths.values()), 1)
    barriers = sum((members[family] - 1) * widths[family] for family in widths)
    return total, marks + total + count + barriers
