"""Rendezvous: how ranks find each other and match their calls.

A ``Group`` takes each rank's enqueued calls (``Engine.enqueue`` has already fenced
the caller's stream), matches them with the other participants' calls, checks that
every participant agrees on what the call is, and hands each matched call to its
rank's engine (``Engine.issue``) — or, on a disagreement, completes every
participant's call unrun (``Engine.release``) and raises ``MismatchError``.  Calls
flow one way: Communicator → Group → Engine.

* ``LocalGroup`` — several ranks in one Python process (Jupyter, tests).  All
  ranks' calls come from one thread, rank after rank, so no call may wait for
  another rank's call: a call is held until every participant has made it, then
  issued for each of them (in each rank's own call order).
* ``ProcessGroup`` — one rank per process (under mpirun, or any launcher that gives a
  ``Bootstrap``).  Per call, the participants swap buffer descriptors (exported
  handles, cached by the importer) and the call's signature through shared-memory
  mailboxes (``hoccl._mailbox``), bounded by the communicator's timeout.

A ``Bootstrap`` is the out-of-band channel a process group is built on: rank,
world size, an allgather of Python objects and a barrier.  ``MPIBootstrap`` wraps an
mpi4py communicator; ``hoccl.torch`` provides one over a torch.distributed Store.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Sequence, Tuple

from ._errors import DivergedError, InvalidArgumentError, MismatchError
from ._mailbox import Mailboxes, Notice, made_call, wait_until
from ._windows import window_ref

if TYPE_CHECKING:
    from ._engine import Call, Engine, PeerBuffer
    from ._health import Health

__all__ = ["Group", "Bootstrap", "LocalGroup", "ProcessGroup", "MPIBootstrap", "end_of_job"]

log = logging.getLogger("hoccl")

_DESCRIPTIONS = 256  # call descriptions a process group remembers each way


class Bootstrap(Protocol):
    """The out-of-band channel of a process group.

    A bootstrap may also offer ``split(color, key)``: a bootstrap over the ranks of
    ``color`` ordered by (``key``, rank), or None for ``color=None``, made collectively by
    every rank (``MPIBootstrap`` does, with MPI_Comm_split); ``Communicator.split`` needs
    it.  And ``peer_lost(description)``: a process group calls it once when it finds a
    peer's process gone without having closed (``MPIBootstrap`` then aborts the MPI job
    at exit, ``end_of_job``)."""
    rank: int
    world_size: int

    def allgather(self, value: Any) -> List[Any]:
        """Every rank's ``value`` (picklable), in rank order."""

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class Group(Protocol):
    """What the Communicator hands its calls to."""

    #: peers live in other processes: buffers travel as export descriptors
    exported: bool

    def post(self, calls: Sequence["Call"]) -> None:
        """Offer ``calls`` (one rank's enqueued calls, in call order; several inside
        ``hoccl.group()``) to the other participants."""

    def complete(self, calls: Sequence["Call"]) -> None:
        """Match the posted ``calls`` with the other participants' and issue them, now or
        when the peers' calls arrive (``LocalGroup``).  A disagreement releases the
        participants' calls and raises ``MismatchError``."""

    def repeat(self, call: "Call") -> None:
        """Post and issue at once a repeat of a call issued without asking the peers
        (``Engine.repeat``; only where ``exported``)."""

    def withdraw(self, call: "Call") -> None:
        """``call`` will never be issued (its rank closes): forget it."""

    def siblings(self, health: "Health") -> List["Health"]:
        """The monitors of the other ranks of this process."""

    def forget_calls(self) -> None:
        """After an abort: no held call will ever be issued."""

    def waiting_for(self, call: "Call") -> List[int]:
        """The participants that have not made ``call`` yet."""

    def dead_peer(self) -> Optional[str]:
        """A description of a peer whose process is gone, if one is."""

    def closed_peer(self, calls: Sequence["Call"]) -> Optional[str]:
        """A description of a participant of one of ``calls`` that closed the communicator
        without making that call (it never will), if one did."""

    def announce(self, kind: str, reason: str) -> None:
        """This rank aborted (``kind``: "diverged" or "aborted", and why): tell the peers,
        whose waits its poison releases, why."""

    def peer_abort(self, peer: int) -> Optional[Notice]:
        """Why ``peer`` aborted, if it has said (``announce``)."""

    def leave(self, engine: "Engine", leak: bool) -> None:
        """``engine``'s rank has closed its streams: free what can be freed."""

    def register(self, engine: "Engine", buffer: Any, verdict: Optional[str]) -> Any:
        """Register ``buffer`` as ``engine``'s next window (``Communicator.register``)."""

    def deregister(self, engine: "Engine", window: Any, verdict: Optional[str]) -> None:
        """Drop ``window`` (``Communicator.deregister``)."""

    def check(self) -> None:
        """Check what has come of the peers' descriptions of calls issued without them
        (registered buffers); raise DivergedError on a difference.  Never waits."""

    def settle(self, call: str) -> None:
        """Wait for, and check, every description still due for such calls."""


def _disagreement(call: "Call", rank: int, peer: int, theirs: Tuple) -> str:
    return (f"{call.name}: rank {rank} called {_describe(call.signature)} but rank {peer} "
            f"called {_describe(theirs)}")


def _silent(call: "Call") -> bool:
    """Whether ``call`` goes without a message to its peers: a direct kernel's eager call
    (on its caller's stream) whose peers' rings are known (``Call.fast``).  Its peers touch
    nothing of this rank's but its ring, within the size they learned, and its kernel
    compares the call's signature with theirs on the device (``DirectProgram``): a peer
    making another call is reported by both ranks' next call or synchronize
    (``Communicator._diverged``).  Both sides of a call always agree on this: it depends
    on the call and on what each learned of the other's ring in the calls before, the
    same on every rank while their sequences of calls agree."""
    return (call.on_caller and bool(call.plan.kernel_blocks) and call.fast is not None
            and not call.captured)


def _describe(signature: Tuple) -> str:
    return "(" + ", ".join(f"{key}={value!r}" for key, value in signature) + ")"


#: how every DivergedError ends
_ABORTED = ("the communicator is aborted (outputs undefined, nothing written outside the "
            "registered windows)")


def _where(where: Any) -> str:
    ref = window_ref(where)
    if ref is not None:
        return f"offset {ref[1]} of registered window #{ref[0]}"
    return "an unregistered buffer"


def _misplaced(name: str, taker: int, owner: int, took: tuple,
               passed: Dict[str, "PeerBuffer"]) -> Optional[str]:
    """What ``taker``, which issued call ``name`` without asking, took ``owner``'s buffers
    to be (``took``: (buffer name, where) pairs, at the same places as its own), against
    what ``owner`` passed: a description of the first difference, if any."""
    for buffer_name, where in took:
        declared = passed.get(buffer_name)
        if declared is None or declared.where != where:
            return (f"{name}: rank {taker} ran its call on registered buffers taking rank "
                    f"{owner}'s {buffer_name} to be {_where(where)} (where its own is), but "
                    f"rank {owner} passed {_where(declared.where) if declared else 'none'}; a "
                    f"call on registered buffers needs every rank's buffer at the same offset "
                    f"of the same registered window; {_ABORTED}")
    return None


def _raise_verdicts(call: str, values: List[Any]) -> None:
    """Every rank's (index, verdict, ...) of a registration step: raise on every rank if
    any rank could not take part, or if their window indices differ."""
    problems = [f"rank {rank}: {value[1]}" for rank, value in enumerate(values) if value[1]]
    if problems:
        raise InvalidArgumentError(f"{call}: " + "; ".join(problems))
    indices = {value[0] for value in values}
    if len(indices) > 1:
        raise MismatchError(f"{call}: the ranks name different windows "
                            f"({[value[0] for value in values]}): every rank must register "
                            f"and deregister its buffers in the same order")


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
        self._refused: Dict[tuple, Tuple[MismatchError, set]] = {}
        # each rank's calls in order, as batches, until every participant of a call has
        # reached it (issued or not): what the cycle check reasons about
        self._order: List[deque] = [deque() for _ in range(world_size)]

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

    def complete(self, calls: Sequence["Call"]) -> None:
        """Issue what can be issued; refuse ``calls`` if they close a cycle of waits."""
        cycle = self._cycle()  # before issuing: the calls that close a cycle are not issued
        if not cycle:
            self._progress()
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

    def _refuse(self, calls: List["Call"], error: MismatchError) -> None:
        """Nothing of the refused calls runs: every participant's matching call completes
        unrun; ranks that made theirs earlier learn of it at their next synchronize."""
        for call in calls:
            group = self._pending.pop(call.key, {})
            group[call.engine.rank] = call
            to_come = set(call.plan.participants) - set(group)
            if to_come:
                self._refused[call.key] = (error, to_come)
            for rank, member in group.items():
                self._forget(rank, member)
                if not member.issued:
                    member.engine.release(member)
                if member not in calls:
                    member.engine.pending_error = error
        self._progress()  # calls queued behind the refused ones may now run

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

    def repeat(self, call: "Call") -> None:
        raise AssertionError("repeat: calls in one process are never repeated at once")

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
        return engine.windows.add(buffer.address, buffer.nbytes, buffer.owner, None, None)

    def deregister(self, engine: "Engine", window: Any, verdict: Optional[str]) -> None:
        if verdict is not None:
            raise InvalidArgumentError(f"deregister: rank {engine.rank}: {verdict}")
        engine.windows.remove(window)

    def check(self) -> None:
        """Every call is matched before it is issued."""

    def settle(self, call: str) -> None:
        """Every call is matched before it is issued."""

    def _progress(self) -> None:
        """Issue, for every rank, the batches at the head of its queue whose calls every
        participant has made."""
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
                monitor.engine.leave_device(self._leak, peers_done=True)
            self.forget_calls()


class MPIBootstrap:
    """A ``Bootstrap`` over an mpi4py communicator (duplicated, freed by ``close``)."""

    def __init__(self, mpi_comm: Any):
        self.mpi = mpi_comm.Dup()
        self.rank: int = self.mpi.Get_rank()
        self.world_size: int = self.mpi.Get_size()

    def allgather(self, value: Any) -> List[Any]:
        return self.mpi.allgather(value)

    def barrier(self) -> None:
        self.mpi.Barrier()

    def split(self, color: Optional[int], key: int) -> Optional["MPIBootstrap"]:
        """MPI_Comm_split: the ranks of ``color`` ordered by (``key``, rank), or None for
        ``color=None`` (MPI_UNDEFINED).  Every rank must call it."""
        from mpi4py import MPI
        part = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        if part == MPI.COMM_NULL:
            return None
        try:
            return MPIBootstrap(part)
        finally:
            part.Free()

    def close(self) -> None:
        if self.mpi is not None:
            from mpi4py import MPI
            if not MPI.Is_finalized():
                self.mpi.Free()
            self.mpi = None

    @staticmethod
    def peer_lost(description: str) -> None:
        """A peer's process exited without closing: MPI_Finalize would wait for it (MPICH
        waits for ever, then crashes), so ``end_of_job`` aborts the MPI job instead."""
        if not _LOST_MPI_PEERS:
            log.warning("%s without closing the communicator: the MPI job will be aborted "
                        "at exit", description)
        _LOST_MPI_PEERS.append(description)


#: the peers' processes that process groups over MPI found gone without closing
_LOST_MPI_PEERS: List[str] = []


def end_of_job() -> None:
    """At interpreter exit, after hoccl's communicators are closed: if a peer's process was
    lost (``MPIBootstrap.peer_lost``) and MPI is still running, abort the MPI job
    (``MPI_Abort``, exit status 1): MPI_Finalize, which mpi4py runs after every Python
    exit handler, would wait for the lost process.  The launcher then ends every rank."""
    if not _LOST_MPI_PEERS:
        return
    MPI = getattr(sys.modules.get("mpi4py"), "MPI", None)
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    log.error("hoccl: aborting the MPI job at exit: %s without closing the communicator "
              "(MPI_Finalize would wait for it)", _LOST_MPI_PEERS[0])
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    MPI.COMM_WORLD.Abort(1)


class ProcessGroup:
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
        # the descriptions of calls lately sent (by signature: the shared buffers and the
        # bytes) and received (by bytes: the contents)
        self._sent: Dict[tuple, Tuple[Dict[str, "PeerBuffer"], bytes]] = {}
        self._received: Dict[bytes, Tuple[tuple, Dict[str, "PeerBuffer"]]] = {}
        # per peer, in call order: the calls issued without the peer's description (on
        # registered buffers), whose description is checked when it comes (``check``)
        self._unchecked: List[deque] = [deque() for _ in range(self.world_size)]
        self._used_cache: Dict[int, Tuple[Any, Dict[int, tuple]]] = {}

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
        (``_description``)."""
        self.check()
        deadline = time.monotonic() + self.timeout
        fast = all(call.fast is not None for call in calls)  # as ``complete`` decides
        for call in calls:
            if _silent(call):
                continue
            description = self._description(call)
            # issued without asking: what this rank took each peer's buffers to be, for the
            # peer to check before it issues its own (``_misplaced``)
            used = self._used(call.fast) if fast else None
            for peer in call.plan.participants:
                if peer != self.rank:
                    self.mailboxes.send(peer, (call.key, description,
                                               used[peer] if used else None),
                                        deadline, call.name)

    def _used(self, fast: Any) -> Dict[int, tuple]:
        """``(name, where)`` of every peer buffer in ``fast`` (``Call.fast``: one dict per
        layout, from the engine's cache, so the tuples are made once per layout)."""
        cached = self._used_cache.get(id(fast))
        if cached is None or cached[0] is not fast:
            cached = (fast, {peer: tuple((name, buffer.where) for name, buffer in buffers.items())
                             for peer, buffers in fast.items()})
            if len(self._used_cache) >= _DESCRIPTIONS:
                self._used_cache.clear()
            self._used_cache[id(fast)] = cached
        return cached[1]

    def agree(self, name: str, value: Any) -> List[Any]:
        """Every rank's ``value`` for a collective step that is not a call (``split``'s
        verdicts on its arguments), through the mailboxes: bounded by the timeout and by
        the peers' liveness, where an MPI allgather would wait for ever on a rank that
        never comes.  A peer whose next message is a call raises MismatchError."""
        deadline = time.monotonic() + self.timeout
        key = ("agree", name)
        for peer in range(self.world_size):
            if peer != self.rank:
                self.mailboxes.send(peer, (key, value, None), deadline, name)
        values: List[Any] = [None] * self.world_size
        values[self.rank] = value
        missing = [peer for peer in range(self.world_size) if peer != self.rank]
        while missing:
            wait_until(lambda: any(self._ready(peer) for peer in missing), deadline,
                       lambda: f"{name}: rank {self.rank} waited {self.timeout:g} s for ranks "
                               f"{missing} to call {name}; they never did",
                       check=lambda: self.mailboxes.check_alive(missing, name))
            for peer in [peer for peer in missing if self._ready(peer)]:
                got_key, got, _ = self.mailboxes.receive(peer)
                missing.remove(peer)
                if got_key != key:
                    raise MismatchError(f"{name}: rank {self.rank} called {name} but rank "
                                        f"{peer}'s next call was {got_key}: every rank must "
                                        f"call {name} at the same point")
                values[peer] = got
        return values

    def complete(self, calls: Sequence["Call"]) -> None:
        """Receive every participant's message, check they agree, then issue — or release
        every call and raise if any participant disagrees.

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
            for call in calls:
                self._expect(call)
            engine.issued_fast += len(calls)
            return
        received = self._receive(calls, time.monotonic() + self.timeout)
        problem: Optional[str] = None
        diverged: Optional[str] = None
        for call in calls:
            for peer, (signature, _, used) in received[call.key].items():
                if signature != call.signature and problem is None:
                    problem = _disagreement(call, self.rank, peer, signature)
                if used is not None and diverged is None:
                    diverged = _misplaced(call.name, peer, self.rank, used, call.shared)
        if diverged is not None:  # the peer ran its call already
            self._discard(calls)
            raise DivergedError(diverged)
        if problem is not None:
            self._discard(calls)
            raise MismatchError(problem)
        for call in calls:
            theirs = received[call.key]
            call.peers = {peer: theirs[peer][1] for peer in call.plan.participants
                          if peer != self.rank}
        engine.learn(calls)
        engine.issue(calls, imported=True)

    def repeat(self, call: "Call") -> None:
        """A repeat (``Engine.repeat``): its message goes first (a direct kernel's call
        goes without), which checks what has come of the peers' descriptions of earlier
        calls; then it is issued at once, and the peers' descriptions of it are checked
        when they come, as for any call on registered buffers."""
        silent = _silent(call)
        if not silent:
            self.post([call])
        call.engine.issue_repeat(call)
        if not silent:
            self._expect(call)

    # -- calls issued without the peers' descriptions ---------------------------------
    def _expect(self, call: "Call") -> None:
        """``call`` was issued without its peers' descriptions: check them when they come."""
        if _silent(call):
            return
        for peer, used in self._used(call.peers).items():
            self._unchecked[peer].append((call.key, call.name, call.signature, used))

    def _ready(self, peer: int) -> bool:
        """Whether ``peer``'s next message for a call still to be matched has come (the
        checks of calls issued without it are taken first)."""
        self._check_peer(peer)
        return not self._unchecked[peer] and self.mailboxes.ready(peer)

    def check(self) -> None:
        """Check every peer's description that has come for a call issued without it;
        raise DivergedError if one differs from what this rank took it to be.  Never
        waits."""
        for peer in range(self.world_size):
            if self._unchecked[peer]:
                self._check_peer(peer)

    def _check_peer(self, peer: int) -> None:
        pending = self._unchecked[peer]
        while pending and self.mailboxes.ready(peer):
            key, name, signature, used = pending.popleft()
            got_key, description, _ = self.mailboxes.receive(peer)
            if got_key != key:
                raise DivergedError(
                    f"{name}: rank {self.rank} ran call {key} on registered buffers, but rank "
                    f"{peer}'s call was {got_key}: the ranks' sequences of calls differ; "
                    f"{_ABORTED}")
            theirs, shared = self._described(description)
            if theirs != signature:
                raise DivergedError(
                    f"{name}: rank {self.rank} ran {_describe(signature)} on registered "
                    f"buffers, but rank {peer} called {_describe(theirs)}; {_ABORTED}")
            problem = _misplaced(name, self.rank, peer, used, shared)
            if problem is not None:
                raise DivergedError(problem)

    def settle(self, call: str) -> None:
        """Wait (bounded by the timeout and the peers' liveness) for the descriptions of
        every call issued without them, and check them (``check``)."""
        deadline = time.monotonic() + self.timeout
        waiting = [peer for peer in range(self.world_size) if self._unchecked[peer]]
        while waiting:
            wait_until(lambda: any(self.mailboxes.ready(peer) for peer in waiting), deadline,
                       lambda: f"{call}: rank {self.rank} waited {self.timeout:g} s for ranks "
                               f"{waiting} to make the calls it ran on registered buffers; they "
                               f"never did",
                       check=lambda: self.mailboxes.check_alive(waiting, call))
            self.check()
            waiting = [peer for peer in waiting if self._unchecked[peer]]

    # -- registration -----------------------------------------------------------------
    def register(self, engine: "Engine", buffer: Any, verdict: Optional[str]) -> Any:
        """Every rank's window of the next index: exchange (export descriptor, size) with
        the peers, map theirs, and add the window.  ``verdict``: why this rank cannot
        register (then every rank raises)."""
        where = None
        if verdict is None:
            try:
                where = engine.device.export(buffer.address)
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
        engine.layout_epoch += 1
        window = engine.windows.add(buffer.address, buffer.nbytes, buffer.owner, bases,
                                    [size for _, _, _, size in values])
        window.imports = held
        return window

    def deregister(self, engine: "Engine", window: Any, verdict: Optional[str]) -> None:
        """Every rank drops its window of one index (once this rank's calls have finished,
        ``Communicator.deregister``)."""
        self.settle("deregister")
        values = self.agree("deregister", (window.index if window else None, verdict, None, 0))
        _raise_verdicts("deregister", values)
        engine.forget_window(window)

    def _description(self, call: "Call") -> bytes:
        """``(call.signature, call.shared)`` pickled.  A repeated call (the same signature
        and the same descriptors) sends the bytes of the previous one."""
        known = self._sent.get(call.signature)
        if known is None or known[0] != call.shared:
            known = (call.shared, pickle.dumps((call.signature, call.shared),
                                               protocol=pickle.HIGHEST_PROTOCOL))
            if len(self._sent) >= _DESCRIPTIONS:
                self._sent.clear()
            self._sent[call.signature] = known
        return known[1]

    def _described(self, description: bytes) -> Tuple[tuple, Dict[str, "PeerBuffer"]]:
        """A peer's ``(signature, shared)`` from its description.  Equal bytes are equal
        contents, so a repeated description is unpickled once and its objects reused
        (the engine then finds the call's bound program by them)."""
        found = self._received.get(description)
        if found is None:
            found = pickle.loads(description)
            if len(self._received) >= _DESCRIPTIONS:
                self._received.clear()
            self._received[description] = found
        return found

    def _receive(self, calls: Sequence["Call"], deadline: float
                 ) -> Dict[tuple, Dict[int, Tuple[tuple, Dict[str, "PeerBuffer"], Any]]]:
        """Every participant's message for each of ``calls``.  One call alone: each peer's
        next message must be for it (the ranks' sequences of calls must agree).  Several
        (a group): each peer's messages may come in any order, but must be exactly the
        group's calls with that peer."""
        expected: Dict[int, List[tuple]] = {}
        for call in calls:
            for peer in call.plan.participants:
                if peer != self.rank:
                    expected.setdefault(peer, []).append(call.key)
        received: Dict[tuple, Dict[int, Tuple[tuple, Dict[str, "PeerBuffer"], Any]]] = {
            call.key: {} for call in calls}
        names = {call.key: call.name for call in calls}
        first = calls[0]
        mailboxes = self.mailboxes
        while expected:
            missing = sorted(expected)
            arrived = [peer for peer in missing if self._ready(peer)]
            if not arrived:
                wait_until(lambda: any(self._ready(peer) for peer in missing), deadline,
                           lambda: f"{first.name}: rank {self.rank} waited {self.timeout:g} s "
                                   f"for ranks {missing} to make the matching call "
                                   f"{first.key}; they never did: a mismatched sequence of "
                                   f"calls or a dead process",
                           check=lambda: mailboxes.check_alive(missing, first.name))
                continue
            for peer in arrived:
                key, description, used = mailboxes.receive(peer)
                keys = expected[peer]
                if (key not in keys) if len(calls) > 1 else (key != keys[0]):
                    self._discard(calls)
                    raise MismatchError(
                        f"{names.get(key, first.name)}: rank {self.rank} made call "
                        f"{keys[0] if len(calls) == 1 else keys} but rank {peer}'s next call "
                        f"with it was {key}: the ranks' sequences of calls differ (a cycle of "
                        f"send/recv must be made inside hoccl.group())")
                signature, shared = self._described(description)
                keys.remove(key)
                if not keys:
                    del expected[peer]
                received[key][peer] = (signature, shared, used)
        return received

    def _discard(self, calls: Sequence["Call"]) -> None:
        for call in calls:
            call.engine.release(call)

    def withdraw(self, call: "Call") -> None:
        """Every call is issued or released before it returns: nothing is ever held."""

    def siblings(self, health: "Health") -> List["Health"]:
        return []  # one rank per process: peers learn of an abort from their pads

    def forget_calls(self) -> None:
        """Nothing is held between calls."""

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
        # the peers still waiting for this rank learn that it is gone, and which of its
        # calls they may still wait for (all of whose signals it has written)
        self.mailboxes.announce(Notice("closed", made=None if engine.aborted else engine.made()))
        # the last rank to close knows that no peer can write into its pad any more
        peers_done = all(self.mailboxes.notice(peer, "close") is not None
                         or not self.mailboxes.alive(peer)
                         for peer in range(self.world_size) if peer != self.rank)
        engine.leave_device(leak, peers_done=peers_done)
        self.mailboxes.close()
        self.bootstrap.close()
