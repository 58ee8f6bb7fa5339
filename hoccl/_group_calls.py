"""``hoccl.group()``: calls held on a thread until the outermost ``group_end``, then
handed to their groups together (``hand_over``), so that cycles of calls cannot block
each other.  ``Communicator`` hands its single calls over the same way."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

from ._engine import ABANDONED, Call, Matcher
from ._errors import DivergedError, HocclError, InvalidArgumentError, MismatchError, fatal

__all__ = ["group", "group_start", "group_end", "held_calls", "hand_over", "fatal", "Holder"]

log = logging.getLogger("hoccl")

_GROUPS = threading.local()


class Holder(Protocol):
    """A communicator whose calls a group holds (``hoccl.Communicator``, or one across
    hosts, whose held calls are its pairs): its group matches them at the group's end,
    and ``_fail`` aborts it when that fails for good.  Only one whose group is not
    ``exported`` has an engine whose callers ``group_end`` fences."""

    @property
    def _group(self) -> Matcher:
        """What matches its calls with the peers'."""

    def _fail(self, calls: List[Any], error: BaseException) -> None:
        """Matching ``calls`` failed for good: abort the communicator."""


def held_calls() -> Optional[List[Tuple[Holder, Any]]]:
    return getattr(_GROUPS, "calls", None) if getattr(_GROUPS, "depth", 0) else None


def group_start() -> None:
    """Begin a group (nestable): calls made on this thread until the matching
    ``group_end`` are held, then matched with their peers together."""
    depth = getattr(_GROUPS, "depth", 0)
    if depth == 0:
        _GROUPS.calls = []
    _GROUPS.depth = depth + 1


def group_end() -> None:
    """End a group; the outermost end hands every held call over.

    Each communicator's held calls go to the device side by side (they do not wait for
    each other), so a ring of send/recv, or one thread driving several ranks'
    calls (``init_local``), cannot deadlock.  Errors (a mismatch, a timeout) are raised
    here."""
    depth = getattr(_GROUPS, "depth", 0)
    if depth == 0:
        raise InvalidArgumentError("group_end: no group_start on this thread")
    _GROUPS.depth = depth - 1
    if depth > 1:
        return
    held, _GROUPS.calls = _GROUPS.calls, []
    batches: Dict[int, Tuple[Holder, List[Call]]] = {}
    for comm, call in held:
        batches.setdefault(id(comm), (comm, []))[1].append(call)
    if not batches:
        return
    try:
        hand_over(list(batches.values()))
    finally:
        # a call issued during the hand-over had its callers fenced by the issue, after
        # its lanes' steps (``Executor.issue``: a caller's wait enqueued before them can
        # hold them behind it on a GPU's hardware queue); the rest (a process group
        # fences its calls as it issues them; in one process, calls still held for ranks
        # that have not made theirs, or released) are fenced now
        for comm, calls in batches.values():
            if comm._group.exported:
                continue
            unfenced = [call for call in calls if not call.fenced]
            if unfenced:
                calls[0].engine.fence_callers(unfenced)


@contextlib.contextmanager
def group() -> Iterator[None]:
    """``with hoccl.group(): ...`` — ``group_start()`` ... ``group_end()``.

    If the body raises, the calls it made are offered to their peers as abandoned: every
    participant's matching call is completed unrun (outputs not written, callers'
    streams released; the peers get MismatchError naming the abandoned call, unless they
    abandoned it too), so the ranks' sequences of calls stay aligned; then the body's
    error propagates.
    """
    group_start()
    try:
        yield
    except BaseException:
        _GROUPS.depth -= 1
        if _GROUPS.depth == 0:
            held, _GROUPS.calls = _GROUPS.calls, []
            for _, call in held:
                call.signature = ABANDONED
                if isinstance(call, Call):  # matched by message, never issued without
                    call.fast = None        # asking: a peer must see it abandoned
            _GROUPS.depth, _GROUPS.calls = 1, held
            try:
                group_end()
            except MismatchError:
                pass  # expected: the peers disagree with an abandoned call
            except HocclError as error:
                log.warning("group: handing over the abandoned calls failed: %s", error)
        raise
    group_end()


def hand_over(batches: Sequence[Tuple[Holder, List[Call]]]) -> None:
    """Offer every batch to its group, then complete each: no batch's completion can
    wait for a peer's offer that is queued behind it.  A mismatch has already
    released the calls (the callers' streams go on, the outputs are not written) and
    the communicator stays usable; any other failure aborts it."""
    failures: List[BaseException] = []

    def attempt(comm: Holder, step: Callable[[List[Call]], None],
                calls: List[Call]) -> bool:
        try:
            step(calls)
            return True
        except BaseException as error:
            # a plain mismatch released the calls; a divergence (an earlier registered
            # call ran differently) or anything else leaves nothing to match up
            if isinstance(error, DivergedError) or not isinstance(error, MismatchError):
                comm._fail(calls, error)
            failures.append(error)
            return False
    posted = [(comm, calls) for comm, calls in batches
              if attempt(comm, comm._group.post, calls)]
    for comm, calls in posted:
        attempt(comm, comm._group.complete, calls)
    if failures:
        raise failures[0]
