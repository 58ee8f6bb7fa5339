"""Running a rank's steps of a hierarchical call: in sequence, or pipelined.

Sequential: each phase after the one before, on the calling thread.  Pipelined (a
``hoccl.sched.hierarchical`` ``PipelinedPlan``): one worker thread per level, each
taking its level's steps in the plan's order (so each level's engine sees its calls in
the order the peers make them), each step after its chunk's previous phase; the caller
waits for the last step::

    host worker   RS c0 | RS c1 | RS c2 | AG c0 | AG c1 ...
    rail worker         | AR c0 | AR c1 | AR c2 ...
                          (AR c0 waits for RS c0, AG c0 for AR c0)

A failed step fails the steps that depend on it, and the call raises its error once
every step queued has returned.  The workers live as long as the communicator.

On a GPU a step returns once its work is enqueued, so the order between a step and the
one it waits for is the device's too: each step is handed ``ready``, an event recorded
after the work of the step before it (None: there is none, or the steps run on the
host), and ``done``, an event to record after its own work when a later step waits for
it (None: nothing does; the step orders the caller's stream after its work).  The events
come from a pool (``make_event``): every wait on them has been enqueued when the call
returns, so the next call records them again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .._errors import HocclTimeoutError
from ..sched import Shape
from ..sched.hierarchical import (BY_HOST, PIPELINED, HierarchicalPlan, PipelinedPlan, Topology,
                                  build_hierarchical, pipeline_hierarchical)

__all__ = ["Entry", "PhaseRunner", "plan_of"]

log = logging.getLogger("hoccl")

#: one phase of one chunk on this rank: (level, what runs it given its ``ready`` and
#: ``done`` events, the index of the entry it waits for: its chunk's previous phase, or
#: None)
Entry = Tuple[str, Callable[[Any, Any], None], Optional[int]]


def plan_of(shape: Shape, topology: Topology, phases: str, phase_bytes: int,
            stream_ordered: bool) -> Union[HierarchicalPlan, PipelinedPlan]:
    """A call's plan: pipelined (the ``phases`` and ``phase_bytes`` settings) for an
    all_reduce, broadcast or reduce of at least two chunks, and for an all_gather or
    reduce_scatter across hosts of several ranks (a chunk per host) whose share of each
    host holds a chunk's bytes, or any of them with ``phases="pipelined"``, unless a level
    enqueues on the caller's stream (``stream_ordered``: NCCL, whose phases are ordered
    there already); else the sequential plan.  A host's share is a rail broadcast (or
    reduce) of H − 1 network steps: below a chunk a share, the H shares' latencies cost
    more than the overlap saves (``hoccl.sched.cost``: a 1 GiB all_gather over 64 hosts ×
    8 GPUs, 42 ms pipelined against 13 ms sequential)."""
    chunk = max(1, phase_bytes // shape.itemsize)
    chunk = max(topology.local_size, chunk - chunk % topology.local_size)
    by_host = shape.collective in BY_HOST and topology.hosts > 1 and topology.local_size > 1
    if by_host:
        large = shape.count * shape.itemsize * topology.world_size >= topology.hosts * phase_bytes
    else:
        large = shape.count >= 2 * chunk
    if ((shape.collective in PIPELINED or by_host) and phases != "sequential"
            and (phases == "pipelined" or large) and not stream_ordered):
        return pipeline_hierarchical(shape, topology, chunk)
    return build_hierarchical(shape, topology)


class _Call:
    """The state of one pipelined call shared by the workers."""

    def __init__(self, count: int):
        self.done = [threading.Event() for _ in range(count)]
        self.error: Optional[BaseException] = None

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error


class PhaseRunner:
    """Runs entries in sequence or on one worker per level (the module docstring);
    ``timeout`` bounds each wait of a worker and of the caller.  ``make_event``: a new
    device event (None: the steps run on the host, and take none)."""

    def __init__(self, timeout: float, make_event: Optional[Callable[[], Any]] = None,
                 drop_event: Callable[[Any], None] = lambda event: None):
        self.timeout = timeout
        self._make_event, self._drop_event = make_event, drop_event
        self._events: List[Any] = []  # the pool
        self._queues: Dict[str, "queue.Queue[Any]"] = {}
        self._threads: List[threading.Thread] = []
        #: a list to append each pipelined step's times to (tools/profile_phase.py): (its
        #: index, level, taken by its worker, its wait done, it returned), monotonic s
        self.trace: Optional[List[Tuple[int, str, float, float, float]]] = None

    def sequential(self, entries: Sequence[Entry]) -> None:
        for _, run, _ in entries:
            run(None, None)

    def _handoffs(self, entries: Sequence[Entry]) -> Dict[int, Any]:
        """An event for every entry that another waits for (``make_event``'s pool)."""
        waited = sorted({after for _, _, after in entries if after is not None})
        if self._make_event is None:
            return {}
        while len(self._events) < len(waited):
            self._events.append(self._make_event())
        return dict(zip(waited, self._events))

    def pipelined(self, what: str, entries: Sequence[Entry]) -> None:
        state = _Call(len(entries))
        events = self._handoffs(entries)
        for index, (level, run, after) in enumerate(entries):
            ready = events.get(after) if after is not None else None
            self._queue(level).put((state, index, run, after, ready, events.get(index)))
        deadline = time.monotonic() + self.timeout * max(1, len(entries))
        for index, event in enumerate(state.done):
            if not event.wait(max(0.0, deadline - time.monotonic())):
                raise HocclTimeoutError(
                    f"{what}: pipelined step {index} of {len(entries)} ({entries[index][0]} "
                    f"level) did not return within {self.timeout:g} s per step")
        if state.error is not None:
            raise state.error

    def _queue(self, level: str) -> "queue.Queue[Any]":
        if level not in self._queues:
            self._queues[level] = queue.Queue()
            thread = threading.Thread(target=self._work, args=(self._queues[level],),
                                      name=f"hoccl-{level}-phases", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self._queues[level]

    def _work(self, items: "queue.Queue[Any]") -> None:
        while True:
            item = items.get()
            if item is None:
                return
            state, index, run, after, ready, done = item
            taken = waited = time.monotonic()
            try:
                if after is not None and not state.done[after].wait(self.timeout):
                    raise HocclTimeoutError(f"a pipelined step waited {self.timeout:g} s for "
                                            f"step {after} before it")
                waited = time.monotonic()
                if state.error is None:
                    run(ready, done)
            except BaseException as error:  # the caller raises it
                state.fail(error)
            finally:
                trace = self.trace
                if trace is not None:
                    trace.append((index, threading.current_thread().name, taken, waited,
                                  time.monotonic()))
                state.done[index].set()

    def close(self) -> None:
        """Stop the workers (after the steps already queued), then drop the events."""
        for items in self._queues.values():
            items.put(None)
        for thread in self._threads:
            thread.join(self.timeout)
        self._queues.clear()
        self._threads.clear()
        for event in self._events:
            try:
                self._drop_event(event)
            except Exception as error:  # a close goes on: the device frees what it made
                log.debug("dropping a pipeline's event: %r", error)
        self._events.clear()
