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
from typing import Callable, List, Optional

from ._engine import Call, Engine
from ._errors import AbortedError, HocclError, HocclTimeoutError, PeerDeadError
from .backends._base import DIRECT_VALUE_BITS
from .sched.algorithms import KERNEL_MAX_BLOCKS
from .sched.plan import Wait

__all__ = ["Health"]

log = logging.getLogger("hoccl")

#: how long a wait goes on after a peer's process is seen gone, before it gives up
#: (``Health._outlasts_grace``)
_DEAD_PEER_GRACE = 1.0


class Health:
    """One rank's monitor.  ``siblings()`` gives the monitors of the other ranks of this
    process (``init_local``): an abort of one rank is an abort of all of them.
    ``children`` are the monitors of communicators split from this one: they share its
    device, and an abort of this rank is an abort of them (and of theirs) too; an abort
    of a child leaves its parent alone."""

    def __init__(self, engine: Engine, timeout: float,
                 siblings: Callable[["Health"], List["Health"]],
                 forget_calls: Callable[[], None],
                 peers_alive: Callable[[], Optional[str]] = lambda: None):
        self.engine = engine
        self.timeout = timeout
        self._siblings = siblings
        self._forget_calls = forget_calls
        self._peers_alive = peers_alive
        self._watchdog: Optional[threading.Thread] = None
        self._pump: Optional[threading.Thread] = None  # re-poisons after an abort
        self._stop = threading.Event()
        self._peer_death: Optional[str] = None  # why, when a dead peer's process aborted it
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
        error, engine.pending_error = engine.pending_error, None
        if error is not None:
            raise error

    def _check_peers(self, call: str, grace: float) -> None:
        """While this rank waits for its calls: abort and raise PeerDeadError if a peer's
        process has exited and the calls do not finish within ``grace`` seconds."""
        gone = self._peers_alive()
        if gone is None:
            return
        reason = f"{call}: rank {self.rank} waited for {gone}"
        if self.engine.aborted:
            if self._peer_death is not None:  # the watchdog saw it first
                raise PeerDeadError(reason)
            return
        target = self.engine.calls
        if self._outlasts_grace(lambda: self.engine.completed < target, grace):
            self._abort_for_dead_peer(reason)
            raise PeerDeadError(reason)

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

    def _abort_for_dead_peer(self, reason: str) -> None:
        self._peer_death = reason
        self.engine.abort_error = PeerDeadError
        self.abort(reason)

    def check(self, call: str) -> None:
        """Raise AbortedError if the device failed, this rank was aborted, or a peer was."""
        engine = self.engine
        failure = engine.device.failure()
        if failure and not engine.aborted:
            self.abort(f"{call}: rank {self.rank}: device work failed: {failure}")
        if engine.aborted:
            raise engine.abort_error(self._aborted_message(call))
        poisoned = engine.pad.aborted_by()
        if poisoned is not None:
            self.abort(f"rank {poisoned} aborted the communicator")
            raise AbortedError(self._aborted_message(call))

    def _aborted_message(self, call: str) -> str:
        reason = self.engine.abort_reason
        if reason.startswith(call + ":"):
            return reason
        return f"{call}: the communicator was aborted: {reason}"

    # -- abort ------------------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """Mark this rank and its siblings aborted (siblings first, so a thread that sees
        this rank aborted finds them aborted too), then release every wait."""
        marked = [health for health in self._sharing_abort()
                  if health.engine.mark_aborted(reason)]
        for health in marked:
            health._release_waits()
        for health in marked:
            health._forget_calls()

    def _sharing_abort(self) -> List["Health"]:
        """Siblings first, then this rank, then every child of any of them (and the
        children's siblings), transitively."""
        found: List["Health"] = []
        waiting = [self]
        while waiting:
            health = waiting.pop(0)
            for member in health._siblings(health) + [health]:
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
        engine.pad.poison(engine.host_word, warn=True)
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
                    engine.pad.poison(engine.host_word, warn=False)
        except Exception as error:  # a helper thread must not die loudly at exit
            log.debug("rank %d abort pump stopped: %r", self.rank, error)

    # -- diagnosis --------------------------------------------------------------------------
    def diagnose(self, call: str) -> str:
        """What the oldest unfinished call is waiting for, read from this rank's pad."""
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
        missing, peers = [], set()
        blocks = oldest.plan.kernel_blocks
        if blocks:  # a direct kernel: its own slots' words (all written by any kernel),
            # values over its epoch
            try:
                epoch = engine.device.peek(engine.pad.kernel_counter, 1)[0]
                for step in oldest.plan.programs[self.rank]:
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
            except HocclError as error:
                return f"{head}; the direct kernel's slots could not be read: {error}"
        for step in () if blocks else oldest.plan.programs[self.rank]:
            if isinstance(step, Wait) and words[step.slot] < oldest.base + step.value:
                peer, channel = engine.pad.describe(step.slot)
                peers.add(peer)
                missing.append(f"rank {peer} {channel} (have {words[step.slot]}, need "
                               f"{oldest.base + step.value})")
        if not missing:
            return (f"{head}: every signal from the peers arrived; the caller's stream never "
                    f"reached the call (work enqueued on it earlier is stuck), or the copies "
                    f"or reductions did not finish")
        return f"{head}: signals missing from peers {sorted(peers)}: " + "; ".join(missing)

    # -- the watchdog ---------------------------------------------------------------------
    def start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name=f"hoccl-watchdog-{self.rank}")
            self._watchdog.start()

    def _watch(self) -> None:
        """Abort when the oldest issued call outlives the timeout, a peer aborted or a peer's
        process is gone, without anyone calling synchronize."""
        engine = self.engine
        period = max(0.05, min(0.25, self.timeout / 10))
        while not self._stop.wait(period):
            with engine.lock:
                if engine.closed or engine.aborted:
                    return
            pending = engine.unfinished()
            if not pending:
                continue
            try:
                engine.device.activate()
                oldest = pending[0]
                gone = self._peers_alive()
                if gone is not None:
                    if self._outlasts_grace(lambda: bool(engine.unfinished()), _DEAD_PEER_GRACE):
                        self._abort_for_dead_peer(f"watchdog: rank {self.rank}'s {oldest.name} "
                                                  f"(call {oldest.value}) waits for {gone}")
                        return
                    continue
                failure = engine.device.failure()
                if failure:
                    self.abort(f"watchdog: rank {self.rank}: device work failed: {failure}")
                    return
                # a peer's abort first: its poison would read as signals that arrived
                peer = engine.pad.aborted_by()
                if peer is not None:
                    self.abort(f"watchdog: rank {self.rank}'s {oldest.name} (call {oldest.value}): "
                               f"rank {peer} aborted the communicator")
                    return
                # measured from issue, not from the call: with init_local a call may wait
                # for the other ranks' calls for as long as the user likes
                if time.monotonic() - oldest.issued_at > self.timeout:
                    self.abort(self.diagnose("watchdog"))
                    return
            except Exception as error:  # the watchdog must never die silently
                log.error("rank %d watchdog: %r", self.rank, error)
                return

    def stop(self) -> None:
        """Stop the watchdog and the abort pump (close); a split communicator leaves its
        parent's children."""
        self._stop.set()
        parent, self._parent = self._parent, None
        if parent is not None:
            parent.children = [child for child in parent.children if child is not self]
        if self._pump is not None:
            self._pump.join(timeout=5)

