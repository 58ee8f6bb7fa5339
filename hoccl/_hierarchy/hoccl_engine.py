"""hoccl's own communicators as a level's engine: the host's, and, between simulated
hosts on one machine (``inter_host="hoccl"``), the rails' and the world's."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from .._errors import InvalidArgumentError
from .._group_calls import group
from ..comm import Communicator
from .engine import InterHostEngine, Pair, Setup
from .topology import SubBootstrap

__all__ = ["HocclEngine"]


class HocclEngine(InterHostEngine):
    """A hoccl ``Communicator`` behind the engine interface: every call goes to it as it
    is, with its argument checks."""

    name = "hoccl"

    def __init__(self, comm: Communicator, label: str):
        self.comm, self.label = comm, label

    @classmethod
    def check_world(cls, call: str, backends: List[str], hostnames: List[str]) -> None:
        if len(set(backends)) != 1:
            raise InvalidArgumentError(f"{call}: inter_host='hoccl' needs one hoccl backend on "
                                       f"every rank; these ranks use {backends} (use 'mpi' or "
                                       f"'gloo')")
        if len(set(hostnames)) != 1:
            raise InvalidArgumentError(f"{call}: inter_host='hoccl' connects simulated hosts on "
                                       f"one machine; these ranks run on {sorted(set(hostnames))}")

    @classmethod
    def connect(cls, setup: Setup) -> Tuple["HocclEngine", "HocclEngine"]:
        topology, bootstrap = setup.topology, setup.bootstrap
        local = topology.local_of(bootstrap.rank)
        rail = setup.connect_host(SubBootstrap(bootstrap, topology.groups("rail")[local]),
                                  setup.device)
        world = setup.connect_host(SubBootstrap(bootstrap, range(topology.world_size)),
                                   setup.device)
        label = f"hoccl ({setup.backend})"
        return cls(rail, label), cls(world, label)

    def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self.comm.all_gather(send, recv, stream=stream)

    def reduce_scatter(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None:
        self.comm.reduce_scatter(send, recv, op, stream=stream)

    def all_reduce(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None:
        self.comm.all_reduce(send, recv, op, stream=stream)

    def all_to_all(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self.comm.all_to_all(send, recv, stream=stream)

    def broadcast(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        self.comm.broadcast(send, recv, root, stream=stream)

    def reduce(self, send: Any, recv: Any, root: int, op: str, *, stream: Any = None) -> None:
        self.comm.reduce(send, recv, root, op, stream=stream)

    def gather(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        self.comm.gather(send, recv, root, stream=stream)

    def scatter(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        self.comm.scatter(send, recv, root, stream=stream)

    def send(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        self.comm.send(buf, peer, stream=stream)

    def recv(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        self.comm.recv(buf, peer, stream=stream)

    def barrier(self, *, stream: Any = None) -> None:
        self.comm.barrier(stream=stream)

    def batch(self, pairs: Sequence[Pair], *, stream: Any = None) -> None:
        """The pairs in one ``hoccl.group()``: a hoccl group matches its sends and
        receives call by call and issues each, in call order, once it and those before it
        are matched (``hoccl._groups.matching``), so peers that batch their pairs
        differently still match."""
        with group():
            for kind, array, peer in pairs:
                getattr(self.comm, kind)(array, peer, stream=stream)

    def synchronize(self) -> None:
        self.comm.synchronize()

    def abort(self, reason: str = "") -> None:
        self.comm.abort(reason)

    def close(self) -> None:
        self.comm.close()

    def set_options(self, **changes: Any) -> None:
        self.comm.set_options(**changes)
