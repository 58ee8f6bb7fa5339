"""``LocalGroup``: several ranks in one Python process (Jupyter, tests).  All ranks'
calls come from one thread, rank after rank, so no call may wait for another rank's
call: a call is held until every participant has made it, then issued for each of
them (in each rank's own call order).  A call captured into a CUDA graph is issued
into its rank's capture then too, so every rank's capture stays open until the last
rank has made the call (begin every capture, make the calls, end the captures)."""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from .._errors import HocclError, InvalidArgumentError, MismatchError
from .._mailbox import Notice
from .base import _disagreement

if TYPE_CHECKING:
    from .._engine import Call, Engine
    from .._health import Health

log = logging.getLogger("hoccl")

__all__ = ["LocalGroup"]


class LocalGroup:
    """In-process rendezvous of several ranks.

    Each rank's queue holds *batches*: one call, or that rank's calls of one
    ``hoccl.group()``, which are issued together (side by side on the device).  A
    batch is issued when it is at the head of its rank's queue and every participant
    has made each of its calls.  All ranks' calls are known to this one process, so a
    set of calls that can never all run (each rank first waits, on the device, for a
    call another rank makes only later) is refused when its last call is made.
    """

    exported = False

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.monitors: List["Health"] = []
        self._closed: set = set()
        self._leak = False  # a rank closed with work stuck behind its caller's stream
        self._pending: Dict[tuple, Dict[int, "Call"]] = {}
        self._queues: List[deque] = [deque() for _ in range(world_size)]
        # refused calls whose other participants have yet to make them: key -> (error,
        # the ranks still to come), so that their calls are refused too when they come
        self._refused: Dict[tuple, Tuple[HocclError, set]] = {}
        # each rank's calls in order, as batches, until every participant of a call has
        # reached it (issued or not): what the cycle check reasons about
        self._order: List[deque] = [deque() for _ in range(world_size)]
        # calls refused while issuing (a capture ended before its call could be issued
        # into it), with the error: ``complete`` raises it where the current call is one
        self._refusals: List[Tuple[HocclError, List["Call"]]] = []

    def submit(self, calls: Sequence["Call"]) -> None:
        self.post(calls)
        self.complete(calls)

    def post(self, calls: Sequence["Call"]) -> None:
        """Check ``calls`` against the participants that made them already and queue them."""
        for call in calls:
            refused = self._refused.get(call.key)
            if refused is not None:
                error, to_come = refused
                to_come.discard(call.engine.rank)
                if not to_come:
                    del self._refused[call.key]
                for member in calls:
                    member.engine.release(member)
                reason = str(error).split(": ", 1)[-1]
                raise MismatchError(f"{call.name}: rank {call.engine.rank}'s call {call.key[1:]} "
                                    f"was refused: {reason}")
            group = self._pending.get(call.key, {})
            for peer, theirs in group.items():
                if theirs.signature != call.signature:
                    error = MismatchError(_disagreement(call, call.engine.rank, peer,
                                                        theirs.signature))
                    self._refuse(list(calls), error)
                    raise error
        for call in calls:
            self._pending.setdefault(call.key, {})[call.engine.rank] = call
        self._queues[calls[0].engine.rank].append(tuple(calls))
        self._order[calls[0].engine.rank].append(list(calls))

    def issued_without_asking(self, calls: Sequence["Call"]) -> None:
        """Never so in one process: every call waits for its peers' (``Engine.replay``
        replays only calls whose peers live in other processes)."""
        raise AssertionError(f"{calls[0].name}: one process issues no call without asking")

    def complete(self, calls: Sequence["Call"]) -> None:
        """Issue what can be issued; refuse ``calls`` if they close a cycle of waits."""
        cycle = self._cycle()  # before issuing: the calls that close a cycle are not issued
        if not cycle:
            self._refusals.clear()
            self._progress(calls)
            refusals, self._refusals = self._refusals, []
            for error, refused in refusals:
                if any(call in refused for call in calls):
                    raise error
        else:
            waits = "; ".join(f"rank {rank}'s {call.name} {call.key[1:]} waits for rank {peer}"
                              for rank, call, peer in cycle)
            error = MismatchError(
                f"{calls[-1].name}: these calls can never all run, each rank first waiting for "
                f"a call another rank makes only later: {waits}; they are refused, not run.  "
                f"Make calls in the same order on every rank, or make a cycle of send/recv "
                f"inside hoccl.group()")
            # a call already on the device cannot be taken back: refuse the others, which
            # breaks the cycle (the calls that closed it are among them)
            self._refuse([call for _, call, _ in cycle if not any(
                member.issued for member in self._pending.get(call.key, {call.engine.rank: call})
                .values())], error)
            raise error

    def _refuse(self, calls: List["Call"], error: HocclError) -> None:
        """Nothing of the refused calls runs: every participant's matching call completes
        unrun; ranks that made theirs earlier learn of it at their next synchronize."""
        for call in calls:
            self._refuse_key(call.key, call.plan.participants, error, {call.engine.rank},
                             {call.engine.rank: call}, calls)
        self._progress()  # calls queued behind the refused ones may now run

    def _refuse_key(self, key: tuple, participants: Sequence[int], error: HocclError,
                    come: set, own: Dict[int, "Call"], raised: Sequence["Call"] = ()) -> None:
        """Refuse the call of ``key``: every participant's call made already completes
        unrun (``own``: those of the refusing ranks; the others, and none of ``raised``,
        raise at their rank's next synchronize), and the participants not yet come
        (neither in ``come`` nor made) are refused when they make it."""
        group = self._pending.pop(key, {})
        group.update(own)
        to_come = set(participants) - set(group) - come
        if to_come:
            self._refused[key] = (error, to_come)
        for rank, member in group.items():
            self._forget(rank, member)
            if not member.issued:
                member.engine.release(member)
            if member not in raised:
                member.engine.fail_later(error)

    def refuse(self, name: str, key: tuple, participants: Sequence[int], reason: str,
               rank: int) -> None:
        """Rank ``rank`` refused its call ``name`` of ``key`` (wrong arguments): the
        participants' matching calls are refused with it, those made already (they raise
        at their rank's next synchronize) and those to come (at once), so that the
        ranks' sequences of calls stay aligned."""
        known = self._refused.get(key)
        if known is not None and rank in known[1]:  # a peer refused it first
            known[1].discard(rank)
            if not known[1]:
                del self._refused[key]
            return
        error = MismatchError(f"{name}: rank {rank} refused this call ({reason}); the "
                              f"communicator stays usable")
        self._refuse_key(key, participants, error, {rank}, {})
        self._progress()

    def _forget(self, rank: int, call: "Call") -> None:
        """Take ``call`` out of ``rank``'s queue and order."""
        self._queues[rank] = deque(remaining for remaining in
                                   (tuple(queued for queued in batch if queued is not call)
                                    for batch in self._queues[rank]) if remaining)
        self._order[rank] = deque(remaining for remaining in
                                  ([queued for queued in batch if queued is not call]
                                   for batch in self._order[rank]) if remaining)

    def _cycle(self) -> List[Tuple[int, "Call", int]]:
        """A cycle of ranks each waiting for another's later call, as (rank, its waiting
        call, the rank it waits for).

        On the device a rank runs its calls (batches) in order, and a call completes only
        once every participant has reached it.  So first every call that all its
        participants have reached (it is in each one's head batch) is settled; then rank
        r waits for rank s when a call of r's head batch has participant s and s's own
        head batch does not hold that call: s reaches it only after its head batch
        completes.  A cycle of such waits can never progress (the device would block for
        ever)."""
        order = self._order
        settled = True
        while settled:
            settled = False
            for rank, batches in enumerate(order):
                if not batches:
                    continue
                for call in list(batches[0]):
                    participants = call.plan.participants
                    if all(order[peer] and any(theirs.key == call.key for theirs in order[peer][0])
                           for peer in participants):
                        for peer in participants:
                            head = order[peer][0]
                            head[:] = [theirs for theirs in head if theirs.key != call.key]
                            if not head:
                                order[peer].popleft()
                        settled = True
                        break
        heads = {rank: batches[0] for rank, batches in enumerate(order) if batches}
        waits: Dict[int, Tuple[int, "Call"]] = {}
        for rank, batch in heads.items():
            for call in batch:
                for peer in call.plan.participants:
                    if peer == rank or peer not in heads:
                        continue
                    if not any(theirs.key == call.key for theirs in heads[peer]):
                        waits.setdefault(rank, (peer, call))
        for start in waits:
            seen: List[int] = []
            current: Optional[int] = start
            while current is not None and current not in seen:
                seen.append(current)
                current = waits[current][0] if current in waits else None
            if current is not None:
                loop = seen[seen.index(current):]
                return [(member, waits[member][1], waits[member][0]) for member in loop]
        return []

    def withdraw(self, call: "Call") -> None:
        """``call``'s rank closes with it never issued: forget it (the other ranks'
        matching calls then wait for ever, and their ``synchronize`` names this rank)."""
        rank = call.engine.rank
        self._forget(rank, call)
        group = self._pending.get(call.key)
        if group is not None and group.get(rank) is call:
            del group[rank]
            if not group:
                del self._pending[call.key]

    def siblings(self, health: "Health") -> List["Health"]:
        return [monitor for monitor in self.monitors if monitor is not health]

    def forget_calls(self) -> None:
        self._pending.clear()
        self._refused.clear()
        for queue in self._queues + self._order:
            queue.clear()

    def waiting_for(self, call: "Call") -> List[int]:
        group = self._pending.get(call.key, {})
        return [rank for rank in call.plan.participants if rank not in group]

    def dead_peer(self) -> Optional[str]:
        return None  # every rank lives in this process

    def closed_peer(self, calls: Sequence["Call"]) -> Optional[str]:
        """A rank closes once its calls have finished, and withdraws those still held: a
        call is never issued with a participant that has closed, and a held one never
        will be."""
        for call in calls:
            for rank in call.plan.participants:
                if rank in self._closed and not call.issued:
                    return f"rank {rank}, which closed the communicator"
        return None

    def gone_peers(self) -> FrozenSet[int]:
        return frozenset(self._closed)

    def announce(self, kind: str, reason: str) -> None:
        """The ranks of this process share every abort, and its reason (``Health.abort``)."""

    def peer_abort(self, peer: int) -> Optional[Notice]:
        return None

    def register(self, engine: "Engine", buffer: Any, verdict: Optional[str]) -> Any:
        """A window of a rank whose peers live in this process: buffers travel by address,
        so nothing is exchanged and calls are matched as ever; the window is only
        recorded."""
        if verdict is not None:
            raise InvalidArgumentError(f"register: rank {engine.rank}: {verdict}")
        return engine.add_window(buffer.address, buffer.nbytes, buffer.owner, None, None)

    def deregister(self, engine: "Engine", window: Any, verdict: Optional[str]) -> None:
        if verdict is not None:
            raise InvalidArgumentError(f"deregister: rank {engine.rank}: {verdict}")
        engine.remove_window(window)

    def check(self) -> None:
        """Every call is matched before it is issued."""

    def settle(self, call: str) -> None:
        """Every call is matched before it is issued."""

    def flush_stale(self) -> None:
        """Every call is matched before it is issued: nothing is folded."""

    def _progress(self, current: Sequence["Call"] = ()) -> None:
        """Issue, for every rank, the batches at the head of its queue whose calls every
        participant has made.  A batch captured into CUDA graphs whose participants' calls
        are not all still in an open capture is refused on every participant, none of it
        issued (``current``: the calls being made, which raise; the others at their
        rank's next synchronize)."""
        moved = True
        while moved:
            moved = False
            for rank, queue in enumerate(self._queues):
                while queue:
                    batch = queue[0]
                    groups = [self._pending.get(call.key, {}) for call in batch]
                    if any(len(group) < len(call.plan.participants)
                           for call, group in zip(batch, groups)):
                        break
                    ended = _ended_capture(batch, groups) if batch[0].captured else None
                    if ended is not None:
                        refused = [member for group in groups for member in group.values()]
                        for call in batch:
                            self._refuse_key(call.key, call.plan.participants, ended, set(),
                                             {}, raised=current)
                        self._refusals.append((ended, refused))
                        moved = True
                        continue
                    queue.popleft()
                    for call, group in zip(batch, groups):
                        call.peers = {peer: group[peer].shared for peer in call.plan.participants
                                      if peer != rank}
                    batch[0].engine.issue(batch, imported=False)
                    for call, group in zip(batch, groups):
                        if all(member.issued for member in group.values()):
                            self._pending.pop(call.key, None)
                    moved = True

    def leave(self, engine: "Engine", leak: bool) -> None:
        """A rank closed its streams.  Its pad and scratch stay mapped by the other ranks'
        lanes until they have closed theirs too: free them (and every device no other
        communicator uses) only then, or none, if any rank's work was left stuck: its
        lanes may still write into every peer."""
        self._closed.add(engine.rank)
        self._leak = self._leak or leak
        if len(self._closed) == len(self.monitors):
            for monitor in self.monitors:  # every writer of the pads has closed
                monitor.engine.leave_device(self._leak)
            self.forget_calls()


def _ended_capture(batch: Sequence["Call"], groups: Sequence[Dict[int, "Call"]]
                   ) -> Optional[MismatchError]:
    """The error for captured ``batch`` if a participant's call of it can no longer be
    issued into the capture it was made in (that capture ended, or was invalidated);
    else None.  A mismatch (the communicators stay usable), as a capture on some ranks
    only is.  Every participant is checked before any is issued: a capture holding the
    call on some ranks only would wait for ever on the others in each replay."""
    for call, group in zip(batch, groups):
        for rank, member in sorted(group.items()):
            if not member.engine.still_captured(member):
                return MismatchError(
                    f"{call.name}: rank {rank}'s call {call.key[1:]} was made while its "
                    f"stream was being captured into a CUDA graph, but that capture ended "
                    f"before every rank had made the call; in one process, begin every "
                    f"rank's capture, make the call on every rank, then end the captures.  "
                    f"The call is refused on every rank, not run")
    return None
