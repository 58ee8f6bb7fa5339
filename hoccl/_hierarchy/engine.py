"""The seam between hosts: what an engine of one level of a hierarchical call is.

An engine moves one level's data: the ``"rail"`` calls (the ranks with one local rank,
one per host) and the ``"world"`` send/recv of a ``hoccl.sched.hierarchical`` plan, and,
as ``HocclEngine``, the ``"host"`` calls on the host's hoccl communicator.  Its transfer
methods mirror hoccl's API (members numbered from 0 in the level's group); ``issue``
runs one ``Call`` of a plan on them, ``batch`` a ``hoccl.group()``'s sends and receives
of the level together."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, List, Optional, Sequence, Tuple

from .._errors import InvalidArgumentError
from ..bootstrap import Bootstrap
from ..comm import Communicator
from ..config import Config
from ..sched.hierarchical import Call, Topology

__all__ = ["Setup", "InterHostEngine", "Pair", "caller_begin", "caller_end"]

#: one send or receive of a batch: ("send" or "recv", a flat array, the peer's member
#: number in the level's group)
Pair = Tuple[str, Any, int]


def caller_begin(device: Any, stream: int, ready: Any) -> int:
    """Order a phase's work on the caller's ``stream`` after the event ``ready`` (None: no
    step before it, or one already on this stream); the phase runs on ``stream``."""
    if ready is not None:
        device.wait_event(device.resolve_stream(stream, []), ready)
    return stream


def caller_end(device: Any, stream: int, work: int, done: Any) -> None:
    """Record ``done`` (None: no later step waits for this one) after the phase's work on
    the caller's ``stream``."""
    if done is not None:
        device.record(device.resolve_stream(stream, []), done)


@dataclass(frozen=True)
class Setup:
    """What ``InterHostEngine.connect`` builds from: every rank of ``bootstrap`` connects
    at the same time (as ``hoccl.init`` does), after its host communicator ``host``."""

    call: str                  #: the API call that connects (error messages start with it)
    backend: str               #: hoccl's backend inside each host ("cuda", "host")
    bootstrap: Bootstrap       #: the whole world's
    topology: Topology
    device: Optional[int]      #: this rank's GPU (None on the host backend)
    mpi_comm: Any              #: ``hoccl.init``'s ``mpi_comm=``
    host: Communicator       #: this rank's host communicator
    #: builds a hoccl communicator over a sub-bootstrap, as the host's was built
    connect_host: Callable[[Bootstrap, Optional[int]], Communicator]
    config: Config = Config()  #: the settings (the staged engine's ``stage_bytes``)
    devices: Tuple[str, ...] = ()  #: where every rank's arrays live ("cuda", "rocm", "cpu")


class InterHostEngine(abc.ABC):
    """One level's communicator of a hierarchical communicator.

    ``name`` is the ``inter_host=`` value that picks the engine; ``check_world`` refuses a
    world it cannot serve; ``connect`` builds this rank's rail engine and world engine.
    ``label`` (an instance's) says in ``describe()`` which library runs it.  Buffers are
    flat arrays of the caller's framework; ``stream`` is the caller's raw stream handle,
    or None on the host backend.  An engine either enqueues its steps on ``stream``
    (NCCL) or returns when each step is done (MPI); ``synchronize`` waits for what it
    left in flight of its own (the caller's streams are the communicator's to wait on)."""

    name: ClassVar[str]
    label: str
    #: whether its steps are enqueued on the caller's stream (NCCL) rather than done, or
    #: ordered on the host, when a method returns: such levels are not pipelined
    enqueues: ClassVar[bool] = False
    #: the library's primitives this engine found it cannot run, with why: (primitive,
    #: reason) pairs (``TorchGroupEngine`` probes its group at init)
    lacks: Tuple[Tuple[str, str], ...] = ()

    @classmethod
    def primitives(cls, collective: str) -> Tuple[str, ...]:
        """The library primitives a call of ``collective`` runs on this engine."""
        return ("send", "recv") if collective == "sendrecv" else (collective,)

    @classmethod
    def check_world(cls, call: str, backends: List[str], hostnames: List[str]) -> None:
        """Raise ``InvalidArgumentError`` (starting with ``call``) when this engine cannot
        connect these ranks (every rank's hoccl backend and hostname)."""

    @classmethod
    @abc.abstractmethod
    def connect(cls, setup: Setup) -> Tuple["InterHostEngine", "InterHostEngine"]:
        """(this rank's rail engine, the world engine)."""

    # -- transfers: hoccl's API, over the level's group -------------------------------
    @abc.abstractmethod
    def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> None: ...

    @abc.abstractmethod
    def reduce_scatter(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None: ...

    @abc.abstractmethod
    def all_reduce(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None: ...

    @abc.abstractmethod
    def all_to_all(self, send: Any, recv: Any, *, stream: Any = None) -> None: ...

    @abc.abstractmethod
    def broadcast(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None: ...

    @abc.abstractmethod
    def reduce(self, send: Any, recv: Any, root: int, op: str, *,
               stream: Any = None) -> None: ...

    @abc.abstractmethod
    def gather(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None: ...

    @abc.abstractmethod
    def scatter(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None: ...

    @abc.abstractmethod
    def send(self, buf: Any, peer: int, *, stream: Any = None) -> None: ...

    @abc.abstractmethod
    def recv(self, buf: Any, peer: int, *, stream: Any = None) -> None: ...

    @abc.abstractmethod
    def barrier(self, *, stream: Any = None) -> None: ...

    def batch(self, pairs: Sequence[Pair], *, stream: Any = None) -> None:
        """Every send and receive of ``pairs`` in flight together (as inside NCCL's
        ``ncclGroupStart``/``ncclGroupEnd``): a batch that sends to and receives from one
        peer, or a ring in either direction, never waits in a cycle.  Done (or enqueued on
        ``stream``) when it returns.  This form, for an engine without one of its own,
        takes a batch of one pair only."""
        if len(pairs) > 1:
            raise InvalidArgumentError(f"send/recv: the engine {self.label} takes one send or "
                                       f"receive at a time across hosts; got a batch of "
                                       f"{len(pairs)}")
        for kind, array, peer in pairs:
            getattr(self, kind)(array, peer, stream=stream)

    # -- state ------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Nothing of the engine's own is in flight: its steps returned when done, or are
        on the caller's streams."""

    @abc.abstractmethod
    def abort(self, reason: str = "") -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def set_options(self, **changes: Any) -> None:
        """hoccl's planning options: only hoccl's own communicators take them."""

    def begin(self, device: Any, stream: int, ready: Any) -> int:
        """The stream (a raw handle) a phase's steps on this engine take, ordered on the
        device after the event ``ready`` (None: after the work on the caller's ``stream``
        so far).  An engine that enqueues its steps, or returns when they are done, takes
        the caller's stream (``caller_begin``); the staged engine a stream of its own."""
        return caller_begin(device, stream, ready)

    def end(self, device: Any, stream: int, work: int, done: Any) -> None:
        """After a phase's steps on ``work`` (``begin``'s): record the event ``done`` when a
        later step waits for it, else order the caller's ``stream`` after them."""
        caller_end(device, stream, work, done)

    def issue(self, call: Call, send: Any, recv: Any, stream: Optional[int]) -> None:
        """One call of a plan's phase on this engine."""
        s = call.shape
        kind = s.collective
        if kind == "sendrecv":
            if send is not None:
                self.send(send, s.peer, stream=stream)
            else:
                self.recv(recv, s.root, stream=stream)
        elif kind == "barrier":
            self.barrier(stream=stream)
        elif kind in ("all_gather", "all_to_all"):
            getattr(self, kind)(send, recv, stream=stream)
        elif kind in ("reduce_scatter", "all_reduce"):
            getattr(self, kind)(send, recv, s.op, stream=stream)
        elif kind == "reduce":
            self.reduce(send, recv, s.root, s.op, stream=stream)
        else:
            getattr(self, kind)(send, recv, s.root, stream=stream)
