"""The health monitor: host-side waits with timeouts, the watchdog, abort and diagnosis.

It works over one rank's ``Engine``: it reads the engine's calls in flight and its
signal pad, and aborts it (and, in one process, every other rank of the group,
which it gets from the group as their monitors).  Nothing here enqueues work for a
call; an abort only writes the abort value into signal pads from the host
(``SignalPad.poison``), which releases every stream-side wait.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, FrozenSet, List, Optional, Protocol, Sequence

from ._engine import Call, Engine
from ._errors import (AbortedError, DivergedError, HocclError, HocclTimeoutError,
                      PeerClosedError, PeerDeadError)
from ._mailbox import Notice
from .backends._base import DIRECT_VALUE_BITS
from .sched.algorithms import KERNEL_MAX_BLOCKS
from .sched.plan import Wait

__all__ = ["Health", "Peers"]

log = logging.getLogger("hoccl")

#: how long a wait goes on after a peer's process is seen gone, before it gives up
#: (``Health._outlasts_grace``)
_DEAD_PEER_GRACE = 1.0
#: how long a rank that finds a peer's abort value in its pad waits for the peer's word of
#: why (``Group.peer_abort``: told before the poison, so it is normally there at once)
_ABORT_NOTICE_WAIT = 0.5


class Peers(Protocol):
    """What the monitor asks of its rank's group about the peers (``hoccl._groups.Group``
    offers it: the group sits above the monitor, which never imports it)."""

    exported: bool
    world_size: int

    def siblings(self, health: "Health") -> List["Health"]:
        """The monitors of the other ranks of this process."""

    def forget_calls(self) -> None:
        """After an abort: no held call will ever be issued."""

    def dead_peer(self) -> Optional[str]:
        """A description of a peer whose process is gone, if one is."""

    def closed_peer(self, calls: Sequence[Call]) -> Optional[str]:
        """A participant of one of ``calls`` that closed without making it, if one did."""

    def gone_peers(self) -> FrozenSet[int]:
        """The peers known to have closed the communicator or exited."""

    def announce(self, kind: str, reason: str) -> None:
        """Tell the peers why this rank aborted."""

    def peer_abort(self, peer: int) -> Optional[Notice]:
        """Why ``peer`` aborted, if it has said."""

    def flush_stale(self) -> None:
        """Send the folds of calls issued without asking that waited long enough."""


class Health:
    """One rank's monitor, over its engine and its group (``group.siblings``: the monitors
    of the other ranks of this process, ``init_local``: an abort of one rank is an abort
    of all of them; the group also tells of peers that died, closed or aborted).
    ``children`` are the monitors of communicators split from this one: they share its
    device, and an abort of this rank is an abort of them (and of theirs) too; an abort
    of a child leaves its parent alone."""

    def __init__(self, engine: Engine, timeout: float, group: Peers):
        self.engine = engine
        self.timeout = timeout
        self._group = group
        self._watchdog: Optional[threading.Thread] = None
        self._pump: Optional[threading.Thread] = None  # re-poisons after an abort
        self._stop = threading.Event()
        self._peer_death: Optional[str] = None  # why, when a lost peer aborted it
        #: a peer's divergence that aborted this rank, not yet raised (``aborted_error``)
        self._peer_divergence: Optional[str] = None
        self.children: List["Health"] = []
        self._parent: Optional["Health"] = None

    def adopt(self, child: "Health") -> None:
        """``child`` monitors a communicator split from this one (until it stops)."""
        self.children.append(child)
        child._parent = self

    @property
    def rank(self) -> int:
        return self.engine.rank

    # -- waits ------------------------------------------------------------------------------
    def synchronize(self, call: str = "synchronize",
                    poll: Callable[[], None] = lambda: None) -> None:
        """Block until every call the engine enqueued has finished; abort after the timeout
        (or at once when a peer's process is gone) and raise naming what never came.
        ``poll`` runs every 0.1 s meanwhile (it may raise: the group's check of calls
        issued on registered buffers)."""
        engine = self.engine
        target = engine.calls
        deadline = time.monotonic() + self.timeout
        delay = 0.0
        next_liveness = time.monotonic() + 0.1
        while engine.completed < target:
            if engine.aborted or engine.device.failure():
                self._check_peers(call, grace=0.0)
                break
            now = time.monotonic()
            if now > deadline:
                reason = self.diagnose(call)
                self.abort(reason)
                raise HocclTimeoutError(reason)
            if now > next_liveness:
                next_liveness = now + 0.1
                poll()
                self._check_peers(call, grace=_DEAD_PEER_GRACE)
            time.sleep(delay)
            delay = min(delay * 2 + 2e-6, 1e-3)
        self.check(call)
        engine.finish()
        error = engine.take_pending_error()
        if error is not None:
            raise error

    def _check_peers(self, call: str, grace: float) -> None:
        """While this rank waits for its calls: abort and raise PeerClosedError if a peer
        closed the communicator without making one of them, PeerDeadError if a peer's
        process has exited and the calls do not finish within ``grace`` seconds."""
        engine = self.engine
        if engine.aborted:
            if self._peer_death is not None:  # the watchdog saw it first
                raise engine.abort_error(self._aborted_message(call))
            return
        closed = self._group.closed_peer(engine.unfinished())
        if closed is not None:
            self._raise_if_peer_aborted(call)
            reason = f"{call}: rank {self.rank} waited for {closed}"
            self._abort_for_lost_peer(reason, PeerClosedError)
            raise PeerClosedError(reason)
        gone = self._group.dead_peer()
        if gone is None:
            return
        self._raise_if_peer_aborted(call)
        reason = f"{call}: rank {self.rank} waited for {gone}"
        target = engine.calls
        if self._outlasts_grace(lambda: engine.completed < target, grace):
            self._abort_for_lost_peer(reason, PeerDeadError)
            raise PeerDeadError(reason)

    def _raise_if_peer_aborted(self, call: str) -> None:
        """A peer that aborted, then closed or exited, told its peers why before it went:
        its abort (a divergence: DivergedError, as it raised itself) is what this rank
        reports, not the close or the exit that followed it."""
        aborted = self.engine.pad.aborted_by()
        if aborted is None:
            aborted = next((peer for peer in range(self._group.world_size)
                            if peer != self.rank and self._group.peer_abort(peer) is not None),
                           None)
        if aborted is not None:
            self._abort_for_peer(aborted, "")
            raise self.aborted_error(call)

    def _outlasts_grace(self, waiting: Callable[[], bool], grace: float) -> bool:
        """Whether this rank is still ``waiting()`` for its calls ``grace`` seconds from now,
        a peer's process being gone: the peer may have exited once its part of the last
        call was done, with this rank's own last steps still running.  False as soon as
        the rank is aborted (by whoever saw the death first) or closed."""
        until = time.monotonic() + grace
        while waiting() and not self.engine.aborted:
            if time.monotonic() >= until:
                return True
            if self._stop.wait(0.01):
                return False
        return False

    def abort_for_lost_peer(self, reason: str, error: type) -> None:
        """Abort because a peer is gone for good (``error``: PeerDeadError, or
        PeerClosedError): later calls raise ``error`` too."""
        self._abort_for_lost_peer(reason, error)

    def _abort_for_lost_peer(self, reason: str, error: type) -> None:
        with self.engine.lock:
            if self.engine.aborted or self.engine.closed:
                return
            self._peer_death = reason
            self.engine.raise_later(error)
        self.abort(reason)

    def check(self, call: str) -> None:
        """Raise AbortedError if the device failed, this rank was aborted, or a peer was
        (DivergedError when the peer's calls had diverged)."""
        engine = self.engine
        failure = engine.device.failure()
        if failure and not engine.aborted:
            self.abort(f"{call}: rank {self.rank}: device work failed: {failure}")
        if not engine.aborted:
            poisoned = engine.pad.aborted_by()
            if poisoned is not None:
                self._abort_for_peer(poisoned, "")
        if engine.aborted:
            raise self.aborted_error(call)

    def aborted_error(self, call: str) -> HocclError:
        """The error a call on this aborted rank raises: DivergedError the first time after
        a peer aborted on finding that the ranks' calls diverged (as that peer raised
        itself), else the engine's ``abort_error`` (AbortedError, or the error of a lost
        peer), naming ``call`` and the reason."""
        with self.engine.lock:
            divergence, self._peer_divergence = self._peer_divergence, None
        if divergence is not None:
            return DivergedError(f"{call}: rank {self.rank} was aborted by {divergence}")
        return self.engine.abort_error(self._aborted_message(call))

    def _abort_for_peer(self, peer: int, head: str) -> None:
        """Abort because ``peer``'s abort value is in this rank's pad, with the peer's
        reason when it has told it (``Group.peer_abort``)."""
        notice = self._group.peer_abort(peer)
        until = time.monotonic() + (_ABORT_NOTICE_WAIT if self._group.exported else 0.0)
        while notice is None and time.monotonic() < until and not self.engine.aborted:
            time.sleep(0.005)
            notice = self._group.peer_abort(peer)
        why = f": {notice.reason}" if notice is not None and notice.reason else ""
        reason = f"{head}rank {peer} aborted the communicator{why}"
        with self.engine.lock:
            if self.engine.aborted or self.engine.closed:
                return
            if notice is not None and notice.kind == "diverged":
                self._peer_divergence = (f"rank {peer}, whose calls diverged from this "
                                         f"rank's{why}")
        self.abort(reason)

    def _aborted_message(self, call: str) -> str:
        reason = self.engine.abort_reason
        if reason.startswith(call + ":"):
            return reason
        return f"{call}: the communicator was aborted: {reason}"

    # -- abort ------------------------------------------------------------------------------
    def abort(self, reason: str, kind: str = "aborted") -> None:
        """Mark this rank and its siblings aborted (siblings first, so a thread that sees
        this rank aborted finds them aborted too), then release every wait, having told
        the peers why (``kind``: "diverged" when the ranks' calls diverged, so that the
        peers raise DivergedError too, else "aborted")."""
        marked = [health for health in self._sharing_abort()
                  if health.engine.mark_aborted(reason)]
        for health in marked:
            try:
                health._group.announce(kind, reason)
            except HocclError as error:
                log.warning("rank %d abort: could not tell the peers why: %s", health.rank,
                            error)
            health._release_waits()
        for health in marked:
            health._group.forget_calls()

    def _sharing_abort(self) -> List["Health"]:
        """Siblings first, then this rank, then every child of any of them (and the
        children's siblings), transitively."""
        found: List["Health"] = []
        waiting = [self]
        while waiting:
            health = waiting.pop(0)
            for member in health._group.siblings(health) + [health]:
                if not any(member is seen for seen in found):
                    found.append(member)
                    waiting.extend(member.children)
        return found

    def _release_waits(self) -> None:
        engine = self.engine
        log.warning("rank %d aborting: %s", self.rank, engine.abort_reason)
        try:
            engine.device.activate()
            # a device shared with a parent: only this rank's lanes, the parent goes on
            engine.device.abort(None if engine.owns_device else engine.streams.lanes)
        except HocclError as error:
            log.warning("rank %d abort: %s", self.rank, error)
        engine.pad.poison(engine.host_word, warn=True, gone=self._group.gone_peers())
        # Lanes released by the poison run on, and their signal writes (this rank's, or a
        # peer's not yet aborted) can land after it and lower a slot again: keep poisoning
        # for a while, so that no wait released once can block again.
        pump = threading.Thread(target=self._keep_poisoning, daemon=True,
                                name=f"hoccl-abort-{self.rank}")
        pump.start()
        self._pump = pump

    def _keep_poisoning(self) -> None:
        """After an abort: poison again every 50 ms until close (at most ``timeout``)."""
        engine = self.engine
        deadline = time.monotonic() + self.timeout
        try:
            engine.device.activate()
            while not self._stop.wait(0.05) and time.monotonic() < deadline:
                with engine.lock:
                    if engine.closed:
                        return
                    engine.pad.poison(engine.host_word, warn=False,
                                      gone=self._group.gone_peers())
        except Exception as error:  # a helper thread must not die loudly at exit
            log.debug("rank %d abort pump stopped: %r", self.rank, error)

    # -- diagnosis --------------------------------------------------------------------------
    def diagnose(self, call: str) -> str:
        """What the unfinished calls are waiting for, read from this rank's pad: the first
        of them (oldest first) with a peer's signal missing, else whether each caller's
        stream reached its call (its entry event) and where the completion word stands."""
        engine = self.engine
        pending = engine.unfinished()
        if not pending:
            return f"{call}: rank {self.rank} timed out after {self.timeout:g} s"
        oldest: Call = pending[0]
        sequence = "collective" if oldest.key[0] == "coll" else "pair"
        head = (f"{call}: rank {self.rank}'s {oldest.name} (call {oldest.value} on this rank, "
                f"{sequence} sequence {oldest.key[1:]}) did not finish within {self.timeout:g} s")
        try:
            words = engine.pad.words()
        except HocclError as error:
            return f"{head}; the signal pad could not be read: {error}"
        aborted = engine.pad.aborted_by()
        if aborted is not None:
            return f"{head}: rank {aborted} aborted the communicator"
        for waiting in pending:  # a group's calls finish together: any of them may wait
            try:
                missing, peers = self._missing(waiting, words)
            except HocclError as error:
                return f"{head}; the direct kernel's slots could not be read: {error}"
            if missing:
                which = "" if waiting is oldest else (
                    f"; its {waiting.name} (call {waiting.value}, issued with it) waits for "
                    f"them")
                return (f"{head}: signals missing from peers {sorted(peers)}{which}: "
                        + "; ".join(missing))
        return f"{head}: every signal from the peers arrived; {_stuck(self.engine, pending)}"

    def _missing(self, waiting: Call, words: List[int]):
        """(descriptions, peers) of the signals ``waiting``'s program waits for in vain."""
        engine = self.engine
        missing, peers = [], set()
        blocks = waiting.plan.kernel_blocks
        if blocks:  # a direct kernel: its own slots' words (all written by any kernel),
            # values over its epoch
            epoch = engine.device.peek(engine.pad.kernel_counter, 1)[0]
            for step in waiting.plan.programs[self.rank]:
                if not isinstance(step, Wait):
                    continue
                have = min(engine.device.peek(engine.pad.kernel_local(step.slot),
                                              KERNEL_MAX_BLOCKS))
                need = (epoch << DIRECT_VALUE_BITS) + step.value
                if have < need:
                    peer, channel = engine.pad.describe(step.slot)
                    peers.add(peer)
                    missing.append(f"rank {peer} {channel} (direct kernel: have {have}, "
                                   f"need {need})")
            return missing, peers
        for step in waiting.plan.programs[self.rank]:
            if isinstance(step, Wait) and words[step.slot] < waiting.base + step.value:
                peer, channel = engine.pad.describe(step.slot)
                peers.add(peer)
                missing.append(f"rank {peer} {channel} (have {words[step.slot]}, need "
                               f"{waiting.base + step.value})")
        return missing, peers

    # -- the watchdog ---------------------------------------------------------------------
    def start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name=f"hoccl-watchdog-{self.rank}")
            self._watchdog.start()

    def _watch(self) -> None:
        """Abort when the oldest issued call outlives the timeout, a peer aborted or a peer's
        process is gone, without anyone calling synchronize.  Each look is a call of its
        own, so that between looks this thread holds no call: it never keeps a finished
        call's buffers (a framework's tensors among them) alive."""
        period = max(0.05, min(0.25, self.timeout / 10))
        while not self._stop.wait(period):
            if not self._look():
                return

    def _look(self) -> bool:
        """One look at the calls in flight; False once the watchdog is done."""
        engine = self.engine
        with engine.lock:
            if engine.closed or engine.aborted:
                return False
        try:
            self._group.flush_stale()
        except HocclError as error:  # the calls' own waits say what went wrong
            log.debug("rank %d watchdog: folds not sent: %s", self.rank, error)
        pending = engine.unfinished()
        if not pending:
            return True
        try:
            engine.device.activate()
            oldest = pending[0]
            closed = self._group.closed_peer(pending)
            if closed is not None:
                self._abort_for_lost_peer(f"watchdog: rank {self.rank}'s {oldest.name} "
                                          f"(call {oldest.value}) waits for {closed}",
                                          PeerClosedError)
                return False
            gone = self._group.dead_peer()
            if gone is not None:
                if self._outlasts_grace(lambda: bool(engine.unfinished()), _DEAD_PEER_GRACE):
                    self._abort_for_lost_peer(f"watchdog: rank {self.rank}'s {oldest.name} "
                                              f"(call {oldest.value}) waits for {gone}",
                                              PeerDeadError)
                    return False
                return True
            failure = engine.device.failure()
            if failure:
                self.abort(f"watchdog: rank {self.rank}: device work failed: {failure}")
                return False
            # a peer's abort first: its poison would read as signals that arrived
            peer = engine.pad.aborted_by()
            if peer is not None:
                self._abort_for_peer(peer, f"watchdog: rank {self.rank}'s {oldest.name} "
                                           f"(call {oldest.value}): ")
                return False
            # measured from issue, not from the call: with init_local a call may wait
            # for the other ranks' calls for as long as the user likes
            if time.monotonic() - oldest.issued_at > self.timeout:
                self.abort(self.diagnose("watchdog"))
                return False
        except Exception as error:  # the watchdog must never die silently
            log.error("rank %d watchdog: %r", self.rank, error)
            return False
        return True

    def stop(self) -> None:
        """Stop the watchdog and the abort pump and wait for them (close); a split
        communicator leaves its parent's children.  Once close returns no thread of this
        rank runs on: a daemon thread that frees a call's torch tensor while the
        interpreter exits ends the process ("terminate called without an active
        exception")."""
        self._stop.set()
        parent, self._parent = self._parent, None
        if parent is not None:
            parent.children = [child for child in parent.children if child is not self]
        for thread in (self._watchdog, self._pump):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5)


def _stuck(engine: Engine, pending: Sequence[Call]) -> str:
    """Where the calls whose signals all came stand: the callers' streams that have not
    reached their calls, and the completion word against the calls' values."""
    behind = []
    for waiting in pending:
        entry = waiting.entry
        try:
            reached = entry is None or engine.device.done(entry)
        except HocclError:
            reached = True
        if not reached:
            behind.append(f"{waiting.name} (call {waiting.value})")
    try:
        completion = engine.device.peek(engine.pad.completion, 1)[0]
    except HocclError:
        completion = None
    values = f"calls {pending[0].value}..{pending[-1].value}"
    if behind:
        return (f"the caller's stream never reached {', '.join(behind)} (work enqueued "
                f"on it earlier is stuck); completion word {completion}, {values}")
    return (f"every caller's stream reached its call: the lanes' copies, reductions or "
            f"their wait for an earlier call's completion did not finish (completion "
            f"word {completion}, {values}, host word {engine.completed})")
