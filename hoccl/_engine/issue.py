"""The issue stage of a call: once its peers' buffers are known (from the group), one
pass down to the executor (``Issuing.issue``); or its completion unrun
(``Issuing.release``).  A part of the ``Engine``, which numbers and enqueues calls; here
is what it does with an enqueued call."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._errors import InvalidArgumentError, MismatchError
from ..p2p import Executor
from ..sched.plan import Plan
from ..streams import StreamManager
from .calls import ABANDONED, Call, callers_of, stream_key
from .inflight import InFlight
from .order import Order
from .prepared import Preparer
from .sequences import Sequences

__all__ = ["Issuing"]

log = logging.getLogger("hoccl")


class Issuing:
    """The engine's issue stage: what it uses of the engine is named below."""

    rank: int
    device: Any
    streams: StreamManager
    executor: Executor
    preparer: Preparer
    inflight: InFlight
    order: Order
    sequences: Sequences
    direct_calls: int

    def fence_callers(self, calls: Sequence[Call]) -> None:
        """Make every caller stream of ``calls`` (a group's, enqueued without a fence) wait
        for the last of them."""
        last = max(call.value for call in calls)
        self.device.activate()
        self.executor.reserve(self.inflight.needs())  # see ``enqueue``
        for call in calls:
            call.fenced = True
        callers = callers_of(calls)
        for caller in callers:
            self.streams.fence_out(caller, last)
        self.order.note(last, callers)

    def issue(self, calls: Sequence[Call], imported: bool) -> None:
        """Enqueue the steps of ``calls`` (one, or one rank's calls of a ``hoccl.group()``,
        which then run side by side), their peers' buffers now in ``call.peers``.
        ``imported``: the peers' ``where`` are export descriptors to map (kept by the
        device).  A peer buffer smaller than the plan reaches into raises MismatchError
        before anything is enqueued.

        One pass down: first the engine's own work (the bounds, the addresses of a call
        not bound yet, the call's signal base, its order, its state), then the executor
        (binding what is not bound yet, then the device commands), which calls only the
        stream manager and the device.  Calls enqueued without a fence (a process
        group's: the call returns only once it is issued) are fenced by the executor,
        after their peers' buffers are mapped: mapping (and unmapping a stale mapping) may
        synchronize the context, which must never happen while a caller's stream waits
        for a call not yet issued."""
        first = calls[0]
        if all(call.signature == ABANDONED for call in calls):
            for call in calls:  # every participant's group body raised: none runs it
                self.release(call)
            return
        if first.captured and not all(call.captured for call in calls):
            raise InvalidArgumentError(f"{first.name}: calls captured into a CUDA graph "
                                       f"and calls made eagerly cannot be issued together")
        try:
            if first.captured:
                with self.device.relaxed_capture():  # peers' buffers may be mapped now
                    bindings = [self.preparer.binding(call, imported) for call in calls]
            else:
                bindings = [self.preparer.binding(call, imported) for call in calls]
        except MismatchError:
            for call in calls:
                self.release(call)
            raise
        now = time.monotonic()  # the device methods make their context current themselves
        value = (0 if first.captured else first.value if len(calls) == 1
                 else max(call.value for call in calls))
        after = base = 0
        bases: List[int] = []
        reserve: Optional[List[Tuple[Plan, int]]] = None
        callers: List[Any] = []
        if first.on_caller and not first.captured:
            assert len(calls) == 1, "a call on its caller's stream is never in a group"
            program = bindings[0][0]
            if program is None:
                program = self._bind(first, bindings[0][1])
            self.issue_on_caller(first, program, now)
            return
        if first.on_caller:  # captured: one graph node on the caller's stream
            after = 0
            base = 0
        elif first.captured:
            callers = callers_of(calls)
        else:
            unfenced = [call for call in calls if not call.fenced]
            if unfenced:
                reserve = self.inflight.needs()
                callers = callers_of(unfenced)
                for call in unfenced:
                    call.fenced = True
                self.order.note(value, callers)
            bases = [self._base(call) for call in calls]
            after, self.order.lanes_after = self.order.lanes_after, 0
            if log.isEnabledFor(logging.DEBUG):
                for call in calls:
                    log.debug("rank %d issue %s call %d base %d lanes %d steps %d", self.rank,
                              call.plan.collective, call.value, call.base, call.plan.lanes,
                              len(call.prepared.compiled))
        self.inflight.issued(calls, now)
        executor = self.executor
        items = []  # (plan, program, base, entry) of each call
        for index, (call, (program, addresses)) in enumerate(zip(calls, bindings)):
            if program is None:
                program = self._bind(call, addresses)
            items.append((call.plan, program, bases[index] if bases else 0, call.entry))
        if first.on_caller:
            executor.issue_on_caller(items[0][1], first.caller, value, after, base)
        elif first.captured:
            executor.issue(items, 0, callers=callers)
            for call in calls:
                self.streams.release(call.entry)
                call.entry = None
        else:
            executor.issue(items, value, after=after, fence=callers, reserve=reserve or ())

    def issue_on_caller(self, call: Call, program: Tuple[tuple, ...], now: float) -> None:
        """Enqueue eager ``call``'s bound ``program`` on its caller's stream (a direct
        kernel, or a one-lane plan: ``Executor.issue_on_caller``), with what changes from
        one call to the next: its signal base (none for a direct kernel, which keeps its
        own epoch), its completion value, and a wait for the previous call's value where
        the caller's stream is not known to be ordered after it.  ``issue`` and a replay
        (``Engine.replay``) both end here."""
        value = call.value
        key = stream_key(call.caller)
        order = self.order
        ordered, streams = order.ordered
        after = value - 1 if value > 1 and not (ordered == value - 1 and key in streams) else 0
        direct = call.prepared.direct
        base = 0 if direct else self._base(call)
        order.ordered = (value, {key})
        order.lanes_after = value
        if direct:
            order.direct(value, call.name, call.signature)
            self.direct_calls += 1
        self.inflight.issued((call,), now)
        self.executor.issue_on_caller(program, call.caller, value, after, base)

    def _bind(self, call: Call, addresses: Optional[Dict[Tuple[int, str], Any]]
              ) -> Tuple[tuple, ...]:
        """``call``'s program bound to ``addresses`` (``Executor.bind``), kept by its
        prepared call with the peers it was bound for."""
        assert addresses is not None
        prepared = call.prepared
        program = self.executor.bind(call.plan, addresses, captured=call.captured,
                                     signature=prepared.digest, program=prepared.compiled)
        prepared.program, prepared.bound_to = program, call.peers
        return program

    def _base(self, call: Call) -> int:
        """``call``'s signal base (``Sequences.base``)."""
        call.base = base = self.sequences.base(call.plan)
        return base

    def release(self, call: Call) -> None:
        """Complete ``call`` without running it: the caller's stream goes on; its output is
        not written."""
        if call.captured:  # nothing waits for it: the capture simply lacks the call
            if call.entry is not None:
                self.streams.release(call.entry)
                call.entry = None
            call.issued = True
            return
        self.device.activate()
        self.streams.ensure_lanes(1)
        self.device.memops(self.streams.lanes[0],
                           self.streams.completion_writes(call.value, self.order.lanes_after))
        self.order.lanes_after = 0
        self.inflight.issued((call,), time.monotonic())
