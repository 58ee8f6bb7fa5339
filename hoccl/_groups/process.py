"""``ProcessGroup``: one rank per process (under mpirun, or any launcher that gives a
``Bootstrap``).  Per call, the participants swap buffer descriptors (exported handles,
cached by the importer) and the call's signature through shared-memory mailboxes
(``hoccl._mailbox``), bounded by the communicator's timeout."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, FrozenSet, List, Optional, Sequence

from .._errors import (AbortedError, DivergedError, HocclTimeoutError, InvalidArgumentError,
                       MismatchError)
from .._mailbox import Mailboxes, Notice, made_call, wait_until
from ..bootstrap import Bootstrap
from .base import (_ABORTED, _described, _named, _raise_verdicts, _silent,
                   refused_signature)
from .folds import Due, Folds, Unasked, view
from .matching import Early, Matching, is_pair

if TYPE_CHECKING:
    from .._engine import Call, Engine
    from .._health import Health

log = logging.getLogger("hoccl")

#: the third part of a message that stands for a refused call (``ProcessGroup.refuse``)
_REFUSAL = "refused"
#: how long a group whose first calls are matched waits for more of its peers' messages
#: before it issues those alone (a peer's messages of one group come within microseconds)
_GRACE = 0.005

__all__ = ["ProcessGroup"]


class ProcessGroup(Unasked):
    """One rank per process, on one host."""

    exported = True

    def __init__(self, bootstrap: Bootstrap, timeout: float):
        self.bootstrap = bootstrap
        self.rank = bootstrap.rank
        self.world_size = bootstrap.world_size
        self.timeout = timeout
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.mailboxes = Mailboxes(self.rank, self.world_size, bootstrap.allgather,
                                   bootstrap.barrier,
                                   on_lost=getattr(bootstrap, "peer_lost", lambda gone: None))
        # per peer, in call order: the calls issued without the peer's description (on
        # registered buffers), whose description is checked when it comes (``check``)
        self._unchecked: List[deque] = [deque() for _ in range(self.world_size)]
        # per peer: this rank's calls issued without asking and not sent (``folds``), and
        # the peer's digest of its own, being compared with this rank's records
        self._folds = Folds(self.world_size)
        self._due: List[Optional[Due]] = [None] * self.world_size
        # sends come from the caller's thread and, for a fold gone stale, the watchdog's
        self._sending = threading.Lock()
        # the keys of the calls this rank refused (``refuse``): a peer's message for one of
        # them (its call, or its refusal too) is dropped when it comes
        self._refused: set = set()
        #: the peers' messages for sends and receives this rank has not made yet
        self._early = Early()
        #: how many times this rank began to shrink the communicator (``shrink``): each
        #: attempt's exchanges are told apart from an earlier one's
        self.shrinks = 0

    def local_rank(self) -> int:
        """This rank's index among the ranks on its host."""
        hosts = self.bootstrap.allgather(self.host)
        return sum(1 for host in hosts[:self.rank] if host == self.host)

    def submit(self, calls: Sequence["Call"]) -> None:
        self.post(calls)
        self.complete(calls)

    def post(self, calls: Sequence["Call"]) -> None:
        """Send (key, description) of each call to its participants: the description is
        its signature and shared buffers, pickled once per distinct description
        (``_description``).  A call issued without asking whose description a peer has
        had already is folded instead (``hoccl._groups.folds``)."""
        self.check()
        deadline = time.monotonic() + self.timeout
        fast = all(call.fast is not None for call in calls)  # as ``complete`` decides
        for call in calls:
            if _silent(call):
                continue
            prepared = call.prepared
            # issued without asking: what this rank took each peer's buffers to be, for the
            # peer to check before it issues its own (``_misplaced``)
            used = prepared.used if fast else None
            description = None
            for peer in call.plan.participants:
                if peer == self.rank:
                    continue
                if used is not None and peer in prepared.told:
                    with self._sending:
                        full = self._folds.add(peer, call.key, view(prepared, self.rank, peer))
                    if full:
                        self._flush(peer, deadline, call.name)
                    continue
                if description is None:
                    description = _description(call)
                self._send(peer, (call.key, description, used[peer] if used else None),
                           deadline, call.name)
                if used is not None:
                    prepared.told.add(peer)

    def agree(self, name: str, value: Any) -> List[Any]:
        """Every rank's ``value`` for a collective step that is not a call (``split``'s
        verdicts on its arguments), through the mailboxes: bounded by the timeout and by
        the peers' liveness, where an MPI allgather would wait for ever on a rank that
        never comes.  A peer whose next message is a call raises MismatchError."""
        deadline = time.monotonic() + self.timeout
        key = ("agree", name)
        for peer in range(self.world_size):
            if peer != self.rank:
                self._send(peer, (key, value, None), deadline, name)
        values: List[Any] = [None] * self.world_size
        values[self.rank] = value
        missing = [peer for peer in range(self.world_size) if peer != self.rank]
        while missing:
            wait_until(lambda: any(self._ready(peer) for peer in missing), deadline,
                       lambda: f"{name}: rank {self.rank} waited {self.timeout:g} s for ranks "
                               f"{missing} to call {name}; they never did",
                       check=lambda: self._check_peers(missing, name))
            for peer in [peer for peer in missing if self._ready(peer)]:
                got_key, got, payload = self.mailboxes.receive(peer)
                if self._stale(got_key):
                    continue
                self._refuse_digest(peer, got_key, payload, name)
                missing.remove(peer)
                if got_key != key:
                    raise DivergedError(f"{name}: rank {self.rank} called {name} but rank "
                                        f"{peer}'s next call was {_named(got_key)}: every rank "
                                        f"must call {name} at the same point; {_ABORTED}")
                values[peer] = got
        return values

    def complete(self, calls: Sequence["Call"]) -> None:
        """Receive every participant's message, check they agree, then issue — or release
        every call not issued yet and raise if any participant disagrees.  The calls go
        out in call order: a group's collectives together once all are matched; where a
        send or recv waits for its peer, the calls matched before it go out first
        (``hoccl._groups.matching``), so that ranks that batch their sends and receives
        differently do not wait for each other in a cycle.

        Calls that can tell their peers' buffers without asking (registered buffers,
        ``Call.fast``) are issued at once; the peers' messages for them are checked when
        they come (``check``)."""
        engine = calls[0].engine
        if all(call.fast is not None for call in calls):
            for call in calls:
                assert call.fast is not None
                call.peers = call.fast
            try:
                engine.issue(calls, imported=True)
            except MismatchError as error:  # the peers may have issued theirs: diverged
                raise DivergedError(f"{error}; the peers may have run the call, so the "
                                    f"communicator is aborted") from None
            self.issued_without_asking(calls)
            return
        matching = Matching(calls, self.rank)
        deadline = time.monotonic() + self.timeout
        for call in calls:  # the peers' messages that came before this rank's calls
            early = self._early.take(call.key)
            if early is not None:
                self._take(matching, *early)
        while matching.waiting:
            ready = matching.ready()
            if ready and len(ready) < len(matching.waiting) and self._receive(
                    matching, deadline, grace=time.monotonic() + _GRACE):
                continue  # the peers' messages of a whole group come together: take them
            if ready:
                self._issue(matching, ready, deadline)
            else:
                self._receive(matching, deadline)

    def issued_without_asking(self, calls: Sequence["Call"]) -> None:
        """The posted ``calls`` (each ``fast``) were issued at once (here, or replayed by
        their engine): check the peers' descriptions of them when they come."""
        for call in calls:
            self._expect(call)
        calls[0].engine.count_issued_fast(len(calls))

    def _issue(self, matching: Matching, ready: List["Call"], deadline: float) -> None:
        """Issue ``ready`` (matched, the first of the calls still waiting) if their
        participants agree; else release every waiting call and raise (once the messages
        of the calls still waiting that are not sends or receives have come: the ranks'
        sequences of collectives stay aligned)."""
        problem, diverged = matching.disagreement(ready, self.rank)
        if diverged is not None or problem is not None:
            while matching.missing(pairs=False):
                self._receive(matching, deadline)
            self._discard(matching.waiting)
            # a diverged peer ran its call already
            raise DivergedError(diverged) if diverged is not None else MismatchError(problem)
        for call in ready:
            theirs = matching.received[call.key]
            call.peers = {peer: theirs[peer][1] for peer in call.plan.participants
                          if peer != self.rank}
        engine = ready[0].engine
        if matching.issued:
            matching.wait_issued(self.rank, self.timeout, deadline, self._check_peers)
        engine.learn(call.peers for call in ready)
        matching.issued += len(ready)
        try:
            engine.issue(ready, imported=True)
        except MismatchError:  # ``ready`` is released; so are the calls after it
            self._discard(matching.waiting)
            raise

    def _check_peers(self, peers: Sequence[int], call: str) -> None:
        """The check of a wait for ``peers``' messages: raise if one of them has exited or
        closed (``Mailboxes.check_alive``), or aborted (DivergedError if its calls had
        diverged from a peer's, else AbortedError): it will send nothing more."""
        self.mailboxes.check_alive(peers, call)
        for peer in peers:
            notice = self.mailboxes.notice(peer, "abort")
            if notice is not None:
                error = DivergedError if notice.kind == "diverged" else AbortedError
                why = f": {notice.reason}" if notice.reason else ""
                raise error(f"{call}: rank {self.rank} waited for rank {peer}, which aborted "
                            f"the communicator{why}")

    def refuse(self, name: str, key: tuple, participants: Sequence[int], reason: str,
               rank: int) -> None:
        """This rank refused its call ``name`` of ``key`` (its arguments were wrong): tell
        every participant in its place, so that their matching calls are released with
        MismatchError (or, where already issued on registered buffers, end in
        DivergedError) and the ranks' sequences of calls stay aligned."""
        deadline = time.monotonic() + self.timeout
        description = pickle.dumps((refused_signature(name, reason), {}),
                                   protocol=pickle.HIGHEST_PROTOCOL)
        self._refused.add(key)
        for peer in participants:
            if peer != self.rank:
                self._send(peer, (key, description, _REFUSAL), deadline, name)

    def _stale(self, key: tuple) -> bool:
        """Whether a peer's message is for a call this rank refused (its call, or its
        refusal too): no call of this rank's waits for it."""
        return key in self._refused

    # -- registration -----------------------------------------------------------------
    def register(self, engine: "Engine", buffer: Any, verdict: Optional[str]) -> Any:
        """Every rank's window of the next index: exchange (export descriptor, size) with
        the peers, map theirs, and add the window.  ``verdict``: why this rank cannot
        register (then every rank raises)."""
        where = None
        if verdict is None:
            try:
                where = engine.device.export(buffer.address, buffer.nbytes)
            except InvalidArgumentError as error:
                verdict = str(error)
        index = engine.windows.next_index
        values = self.agree("register", (index, verdict, where, buffer.nbytes))
        _raise_verdicts("register", values)
        bases: List[Any] = []
        held: List[Any] = []
        try:
            for peer, (_, _, peer_where, _) in enumerate(values):
                if peer == self.rank:
                    bases.append(buffer.address)
                else:
                    bases.append(engine.device.hold_import(peer_where))
                    held.append(peer_where)
        except BaseException:
            for descriptor in held:
                engine.device.drop_import(descriptor)
            raise
        return engine.add_window(buffer.address, buffer.nbytes, buffer.owner, bases,
                                 [size for _, _, _, size in values], held)

    def deregister(self, engine: "Engine", window: Any, verdict: Optional[str]) -> None:
        """Every rank drops its window of one index (once this rank's calls have finished,
        ``Communicator.deregister``)."""
        self.settle("deregister")
        values = self.agree("deregister", (window.index if window else None, verdict, None, 0))
        _raise_verdicts("deregister", values)
        engine.forget_window(window)

    def _receive(self, matching: Matching, deadline: float,
                 grace: Optional[float] = None) -> bool:
        """Take every message come so far from the peers ``matching`` waits for; if none
        has come, wait (bounded by ``deadline``) until one does, or with a ``grace``
        (an earlier deadline) until then only; whether one came.  A message for a send or
        recv this rank has not made yet is kept for it (``Early``); one for any other call
        than the next this rank expects means the ranks' sequences of calls differ."""
        missing = matching.missing()
        if not missing:
            return False
        arrived = [peer for peer in missing if self._ready(peer)]
        if not arrived and grace is not None:
            try:
                wait_until(lambda: any(self._ready(peer) for peer in missing), grace, str)
            except HocclTimeoutError:
                return False
            arrived = [peer for peer in missing if self._ready(peer)]
        if not arrived:
            first = matching.waiting[0]
            wait_until(lambda: any(self._ready(peer) for peer in missing), deadline,
                       lambda: matching.unmatched(self.rank, self.host, self.timeout, missing,
                                                  self._early.from_peers(missing)),
                       check=lambda: self._check_peers(missing, first.name))
            arrived = [peer for peer in missing if self._ready(peer)]
        for peer in arrived:
            while peer in matching.missing() and self._ready(peer):
                message = self.mailboxes.receive(peer)
                key = message[0]
                if self._stale(key):
                    continue
                self._refuse_digest(peer, key, message[2], matching.waiting[0].name)
                if matching.expects(peer, key):
                    self._take(matching, peer, message)
                elif is_pair(key):
                    self._early.keep(peer, message)
                else:
                    # the peer's message for another call is taken: neither rank can skip
                    # its way back to calls that match, so both abort
                    keys = matching.expected_of(peer)
                    self._discard(matching.waiting)
                    raise DivergedError(
                        f"{matching.names.get(key, matching.waiting[0].name)}: rank "
                        f"{self.rank} made {[_named(k) for k in keys]} but rank {peer}'s next "
                        f"call with it was {_named(key)}: the ranks' sequences of calls "
                        f"differ; {_ABORTED}")
        return True

    def _take(self, matching: Matching, peer: int, message: tuple) -> None:
        key, description, used = message
        signature, shared = _described(matching.prepared[key], peer, description)
        matching.take(peer, key, signature, shared, None if used == _REFUSAL else used)

    def _discard(self, calls: Sequence["Call"]) -> None:
        for call in calls:
            call.engine.release(call)

    def withdraw(self, call: "Call") -> None:
        """Every call is issued or released before it returns: nothing is ever held."""

    def siblings(self, health: "Health") -> List["Health"]:
        return []  # one rank per process: peers learn of an abort from their pads

    def forget_calls(self) -> None:
        """Nothing is held between calls; the peers' early messages go."""
        self._early.clear()

    def waiting_for(self, call: "Call") -> List[int]:
        return []

    def dead_peer(self) -> Optional[str]:
        return self.mailboxes.dead(peer for peer in range(self.world_size) if peer != self.rank)

    def closed_peer(self, calls: Sequence["Call"]) -> Optional[str]:
        """A peer that closed tells how many calls it had made (``leave``): every signal of
        those had been written when it closed (its close waited for them), so only a
        call it never made waits for it in vain."""
        for call in calls:
            for peer in call.plan.participants:
                if peer == self.rank:
                    continue
                notice = self.mailboxes.notice(peer, "close")
                if notice is not None and (notice.made is None
                                           or not made_call(call.key, notice.made)):
                    return (f"rank {peer}, which closed the communicator without making "
                            f"this {call.name} (sequence {call.key[1:]}): it never will")
        return None

    def gone_peers(self) -> FrozenSet[int]:
        return frozenset(peer for peer in range(self.world_size) if peer != self.rank and (
            self.mailboxes.notice(peer, "close") is not None or not self.mailboxes.alive(peer)))

    def announce(self, kind: str, reason: str) -> None:
        self.mailboxes.announce(Notice(kind, reason))

    def peer_abort(self, peer: int) -> Optional[Notice]:
        return self.mailboxes.notice(peer, "abort")

    def barrier(self) -> None:
        self.bootstrap.barrier()

    def leave(self, engine: "Engine", leak: bool) -> None:
        """Free this rank's memory and the device unless a communicator split from this one
        (or its parent) still uses it (keep them, with ``leak``), then the mailboxes and
        the bootstrap."""
        self._unchecked = [deque() for _ in range(self.world_size)]
        self._due = [None] * self.world_size
        # the peers still waiting for this rank learn that it is gone, and which of its
        # calls they may still wait for (all of whose signals it has written)
        self.mailboxes.announce(Notice("closed", made=None if engine.aborted else engine.made()))
        # the peers that may still write into this rank's pad hold their mapping of it
        # (``Device.import_pad``): it is reused only once they have let go
        engine.leave_device(leak)
        self.mailboxes.close()
        self.bootstrap.close()


def _description(call: "Call") -> bytes:
    """``(call.signature, call.shared)`` pickled.  A repeated call (the same prepared
    call and the same descriptors) sends the bytes of the previous one; an abandoned
    call, whose signature is not its prepared call's, its own."""
    prepared = call.prepared
    if call.signature is not prepared.signature:  # abandoned (``_group_calls.group``)
        return pickle.dumps((call.signature, call.shared), protocol=pickle.HIGHEST_PROTOCOL)
    known = prepared.description
    if known is None or known[0] != call.shared:
        known = prepared.description = (call.shared, pickle.dumps(
            (call.signature, call.shared), protocol=pickle.HIGHEST_PROTOCOL))
    return known[1]

