"""Sends and receives inside ``hoccl.group()`` on a communicator across hosts.

A send or receive made inside a group is held (``HeldPair``, after the argument checks
of any call) until the outermost ``group_end``, which hands the communicator's held
pairs to its ``PairGroup``; the batch then runs as one batch per level, each on its
level's engine (``InterHostEngine.batch``)::

    held:     send(a, 1)  recv(b, 3)  send(c, 2)  recv(d, 1)     (rank 0; hosts of 2)
    host:     batch[send(a, 1), recv(d, 1)]  on the engine inside the host
    world:    batch[recv(b, 3), send(c, 2)]  on the engine over every rank

The levels run side by side (one worker each, ``PhaseRunner.pipelined``) and every
engine between hosts posts a batch's pairs before it waits for any, so no batch waits in
a cycle: not one that sends to and receives from the same peer, nor a ring in either
direction, nor ranks that batch the same pairs differently.  A pair of ranks on one host still
moves its bytes on that host's engine, one along a rail on the rail engine.

The pairs of several communicators in one group run one communicator's batch after
another (``hoccl.group()`` completes each communicator's calls in turn).  Between ranks
on one host (and on ``inter_host="hoccl"``) the engine is a hoccl communicator, whose
groups match sends and receives call by call (``hoccl._groups.matching``): there too
ranks may batch their pairs differently.

The calls of one group on one communicator take one stream (or None on the host
backend): the batch is ordered after the work on it so far, and the work enqueued on it
later after the batch.  A pair left unmatched ends in the engines' timeout, which names
this rank and the peers of the batch with their hosts; the communicator is then aborted,
as after any step across hosts left in flight.  Collectives are not held: inside a
group a communicator across hosts refuses them at once.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .._buffers import Buffer
from .._errors import HocclTimeoutError, InvalidArgumentError
from ..sched import Shape
from .arrays import Arrays, framework_array
from .engine import InterHostEngine, Pair
from .phases import Entry, PhaseRunner

__all__ = ["HeldPair", "PairGroup", "PairCalls"]


class HeldPair:
    """A send (``kind="send"``) or receive of ``array`` with ``peer`` made inside a group,
    on ``stream`` (the caller's argument).  ``signature`` is set when the group's body
    raised (``hoccl.group()`` abandons what it held): the pair is then not run."""

    __slots__ = ("kind", "array", "peer", "stream", "signature")

    def __init__(self, kind: str, array: Any, peer: int, stream: Any):
        self.kind, self.array, self.peer, self.stream = kind, array, peer, stream
        self.signature: Optional[Tuple[Any, ...]] = None

    def __repr__(self) -> str:
        return f"{self.kind} with rank {self.peer}"


class PairGroup:
    """What ``hoccl.group()`` hands a communicator's held calls to (its ``post`` for
    every communicator of the group, then its ``complete``): ``post`` starts nothing,
    ``complete`` runs the pairs not abandoned as one batch (``run``).  ``exported``:
    the batch orders itself on the caller's stream, with no fence of the group's."""

    exported = True

    def __init__(self, run: Callable[[List[HeldPair]], None]):
        self._run = run

    def post(self, calls: List[HeldPair]) -> None:
        """Nothing to start before ``complete``: the batch goes out whole."""

    def complete(self, calls: List[HeldPair]) -> None:
        self._run([call for call in calls if call.signature is None])


class PairCalls:
    """``HierarchicalCommunicator``'s sends and receives inside ``hoccl.group()``: held
    (``_hold``), then run as a batch per level when the group ends (``_batch``)."""

    rank: int
    topology: Any
    _levels: Dict[str, InterHostEngine]
    _runner: PhaseRunner
    _host: Any
    _hosts: List[Any]
    _blocking: bool
    #: the communicator's checks and abort (``HierarchicalCommunicator``'s methods)
    _usable: Callable[[str], None]
    _stream: Callable[[str, Any, List[Any]], Optional[int]]
    abort: Callable[[str], None]

    def _hold(self, name: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
              stream: Any, held: List[Tuple[Any, Any]]) -> None:
        """Hold a checked send or recv until the group ends; refuse at once a collective,
        and a stream other than the one the group's earlier pairs on this communicator
        took."""
        if shape.collective != "sendrecv":
            raise InvalidArgumentError(
                f"{name}: a communicator across hosts takes only send and recv inside "
                f"hoccl.group() (a collective's phases mix engines); make collectives "
                f"outside the group")
        buffer = buffers[name]
        assert buffer is not None
        array = framework_array(buffer.owner)
        self._stream(name, stream, [array])  # the host backend's refusal of a stream
        earlier = next((call for comm, call in held if comm is self), None)
        if earlier is not None and earlier.stream is not stream and earlier.stream != stream:
            raise InvalidArgumentError(
                f"{name}: the sends and receives of one hoccl.group() on a communicator "
                f"across hosts take one stream; this group's first took {earlier.stream!r}, "
                f"this one {stream!r}")
        peer = shape.peer if name == "send" else shape.root
        held.append((self, HeldPair(name, Arrays.of(array).flat(array), peer, stream)))

    def _batch(self, calls: List[HeldPair]) -> None:
        """A group's held pairs: one batch per level, the levels side by side (pairs.py)."""
        if not calls:
            return
        self._usable("send/recv")
        handle = self._stream("send/recv", calls[0].stream, [call.array for call in calls])
        levels: Dict[str, List[Pair]] = {}
        for call in calls:
            level = self._pair_level(call.peer)
            levels.setdefault(level, []).append(
                (call.kind, call.array, self.topology.index_in(level, call.peer)))

        def runner(level: str, pairs: List[Pair]) -> Callable[[Any, Any], None]:
            return lambda ready, done: self._batch_level(level, pairs, handle, ready, done)
        entries: List[Entry] = [(level, runner(level, pairs), None)
                                for level, pairs in levels.items()]
        with self._naming_peers("send/recv", [(call.kind, call.peer) for call in calls]):
            if len(entries) == 1:
                self._runner.sequential(entries)
            else:
                self._runner.pipelined("send/recv", entries)

    def _pair_level(self, peer: int) -> str:
        """The level whose engine joins this rank and ``peer`` (the plans' rule)."""
        t = self.topology
        if t.host_of(peer) == t.host_of(self.rank):
            return "host"
        return "rail" if t.local_of(peer) == t.local_of(self.rank) else "world"

    def _batch_level(self, level: str, pairs: List[Pair], handle: Optional[int],
                     ready: Any, done: Any) -> None:
        self._usable("send/recv")
        engine, device = self._levels[level], self._host.device_handle
        work = handle if handle is None else engine.begin(device, handle, ready)
        try:
            engine.batch(pairs, stream=work)
        except HocclTimeoutError as error:  # a pair left to its engine: no more calls
            self.abort(f"rank {self.rank}: send/recv: {error}")
            raise
        if handle is not None and work is not None:
            engine.end(device, handle, work, done)
        if self._blocking:
            engine.synchronize()

    def _fail(self, calls: List[HeldPair], error: BaseException) -> None:
        """``hoccl.group()``'s hook for a batch that failed: a pair left in flight has
        aborted the communicator already (``_batch_level``); anything else left it usable."""

    @staticmethod
    def _peers_of(name: str, shape: Shape) -> List[Tuple[str, int]]:
        """A send's or recv's (kind, peer) outside a group; none for a collective."""
        if shape.collective != "sendrecv":
            return []
        return [(name, shape.peer if name == "send" else shape.root)]

    @contextlib.contextmanager
    def _naming_peers(self, name: str, pairs: List[Tuple[str, int]]) -> Iterator[None]:
        """A timeout of sends and receives (``pairs``: (kind, peer)) re-raised naming this
        rank, its peers and their hosts; any other error, or one of no pairs, as it is."""
        try:
            yield
        except HocclTimeoutError as error:
            if not pairs:
                raise

            def who(rank: int) -> str:
                host = self.topology.host_of(rank)
                return f"rank {rank} (host {host}, {self._hosts[host].hostname})"
            peers = ", ".join(f"{kind} with {who(peer)}" for kind, peer in pairs)
            raise HocclTimeoutError(f"{name}: {who(self.rank)}, {peers}: not matched within "
                                    f"{self._host.timeout:g} s: {error}") from None
