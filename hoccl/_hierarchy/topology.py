"""Which ranks share a host, and a bootstrap over some of them.

``host_topology`` finds the hosts (by hostname, or ``local_size`` consecutive ranks per
simulated host); ``SubBootstrap`` lets a host's or a rail's communicator be built over
the parent bootstrap's exchanges."""

from __future__ import annotations

import socket
from typing import Any, List, Optional, Sequence, Tuple

from ..config import environ
from .._errors import InvalidArgumentError
from ..bootstrap import Bootstrap
from ..sched.hierarchical import Topology

__all__ = ["SubBootstrap", "host_topology", "simulated_local_size"]


class SubBootstrap:
    """A ``Bootstrap`` over ``members`` (parent ranks, in order) of ``parent``.

    Exchanges go through the parent's: every parent rank must make the same exchanges
    at the same time (as ``init`` does, building every host's and every rail's
    communicator at once), each keeping its own members' values.  ``close`` leaves the
    parent open."""

    def __init__(self, parent: Bootstrap, members: Sequence[int]):
        self.parent = parent
        self.members = tuple(members)
        self.rank = self.members.index(parent.rank)
        self.world_size = len(self.members)

    def allgather(self, value: Any) -> List[Any]:
        everyone = self.parent.allgather(value)
        return [everyone[member] for member in self.members]

    def barrier(self) -> None:
        self.parent.barrier()

    def peer_lost(self, description: str) -> None:
        """Tell the parent (an MPI job is aborted at exit, ``MPIBootstrap.peer_lost``)."""
        getattr(self.parent, "peer_lost", lambda gone: None)(description)

    def close(self) -> None:
        """The parent belongs to the hierarchical communicator."""


def host_topology(call: str, bootstrap: Bootstrap, local_size: Optional[int]
                  ) -> Tuple[Topology, List[str], str]:
    """The world's hosts: ``local_size`` (or ``HOCCL_LOCAL_SIZE``) consecutive ranks per
    simulated host, or else the ranks grouped by hostname (they must be consecutive and
    as many on every host).  Returns (topology, every rank's hostname, how it was found)."""
    names = bootstrap.allgather(socket.gethostname())
    world_size = len(names)
    source = "local_size"
    if local_size is None and environ("HOCCL_LOCAL_SIZE"):
        text, source = environ("HOCCL_LOCAL_SIZE") or "", "HOCCL_LOCAL_SIZE"
        try:
            local_size = int(text)
        except ValueError:
            raise InvalidArgumentError(f"{call}: HOCCL_LOCAL_SIZE must be a positive int; "
                                       f"got {text!r}") from None
    if local_size is not None:
        if (isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1
                or world_size % local_size):
            raise InvalidArgumentError(f"{call}: {source} must be a positive int that divides "
                                       f"the world size {world_size}; got {local_size!r}")
        for first in range(0, world_size, local_size):
            group = names[first:first + local_size]
            if len(set(group)) != 1:
                raise InvalidArgumentError(
                    f"{call}: {source}={local_size} puts ranks {first}..{first + local_size - 1} "
                    f"on one host, but they run on {sorted(set(group))}")
        return Topology(world_size // local_size, local_size), names, f"{source}={local_size}"
    order = list(dict.fromkeys(names))
    size = names.count(order[0])
    expected = [host for host in order for _ in range(size)]
    if names != expected:
        raise InvalidArgumentError(
            f"{call}: ranks must be placed in blocks of equal size per host (rank = host * "
            f"ranks_per_host + local rank); got hosts {names}. Launch with block placement "
            f"(mpirun --map-by slot, torchrun) or pass local_size=")
    return Topology(len(order), size), names, "hostname"


def simulated_local_size(call: str, global_ranks: Sequence[int]) -> Optional[int]:
    """The ranks per simulated host of a group of the world's ranks ``global_ranks`` (in
    group order), under ``HOCCL_LOCAL_SIZE=L``: the world's hosts are its blocks of L
    consecutive ranks, so the group's ranks [0, 2] of L=2 sit on two hosts of one rank,
    [0, 1] on one host of two.  None without ``HOCCL_LOCAL_SIZE``, or for the world
    itself (no ranks given): ``host_topology`` reads it then."""
    text = environ("HOCCL_LOCAL_SIZE")
    if not text or not global_ranks:
        return None
    try:
        world_local = int(text)
    except ValueError:
        raise InvalidArgumentError(f"{call}: HOCCL_LOCAL_SIZE must be a positive int; got "
                                   f"{text!r}") from None
    if world_local < 1:
        raise InvalidArgumentError(f"{call}: HOCCL_LOCAL_SIZE must be a positive int; got "
                                   f"{text!r}")
    hosts = [rank // world_local for rank in global_ranks]
    order = list(dict.fromkeys(hosts))
    size = hosts.count(order[0])
    if hosts != [host for host in order for _ in range(size)]:
        raise InvalidArgumentError(
            f"{call}: the group's ranks {list(global_ranks)} sit on the simulated hosts "
            f"{hosts} (HOCCL_LOCAL_SIZE={world_local}): a group's ranks must be placed in "
            f"blocks of equal size per host")
    return size
