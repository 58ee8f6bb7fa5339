"""``shrink`` of a communicator across hosts: the survivors meet through the mailboxes of
the parent's world communicator and connect anew::

    parent stopped ─► MailboxBootstrap over the survivors (the world level's mailboxes)
        ─► the survivors' topology ─► HierarchicalCommunicator.connect   (several hosts)
                                   ─► connect_process                    (one host left)

The meeting needs a channel between every pair of survivors that does not count the lost
ranks: hoccl's world communicator between simulated hosts on one machine
(``inter_host="hoccl"``) has one (its mailboxes), and so has UCX between real hosts
(``inter_host="ucx"``: its endpoints, ``UcxBootstrap``).  MPI, gloo and NCCL meet through
MPI or a torch store, whose exchanges wait for every rank of the job, so those
communicators (and those with torch groups inside hosts) refuse to shrink, saying so."""

from __future__ import annotations

import logging
import socket
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

from .._api import CommunicatorApi
from .._build import check_exclude, connect_process
from .._errors import HocclError, InvalidArgumentError, MismatchError
from .._groups import ProcessGroup
from .._groups.survivors import MailboxBootstrap
from ..bootstrap import Bootstrap
from ..comm import Communicator
from ..sched.hierarchical import Topology
from .hoccl_engine import HocclEngine
from .hosts import host_config
from .ucx import UcxBootstrap, UcxStagedEngine, UcxTransport

__all__ = ["shrink", "survivors_topology"]

log = logging.getLogger("hoccl")


def survivors_topology(topology: Topology, survivors: Sequence[int]) -> Topology:
    """The hosts of ``survivors`` (ranks of ``topology``, in order): the hosts that keep a
    rank, each with as many ranks as it kept when every such host kept as many; else one
    rank per host (a host's ranks must be as many on every host), so that every step
    runs between the survivors' hosts.  ``hosts == 1``: one host is left."""
    kept = Counter(topology.host_of(rank) for rank in survivors)
    sizes = set(kept.values())
    if len(sizes) == 1:
        return Topology(len(kept), sizes.pop())
    return Topology(len(survivors), 1)


def _world_group(parent: Any, call: str) -> Any:
    """The level that joins every pair of ranks: the process group of ``parent``'s world
    level (its mailboxes), or its UCX transport; refused for any other world level."""
    world = parent._levels["world"]
    torch_hosts = [index for index, report in enumerate(parent._hosts) if report.engine == "torch"]
    if isinstance(world, UcxStagedEngine) and not torch_hosts:
        return world.transport
    if not isinstance(world, HocclEngine) or torch_hosts:
        raise InvalidArgumentError(
            f"{call}: not supported across hosts that meet through {parent.inter_host!r}"
            f"{' and torch groups inside hosts ' + str(torch_hosts) if torch_hosts else ''}: "
            f"their exchanges wait for every rank of the job, the lost ones too; shrinking "
            f"across hosts needs inter_host='ucx', or 'hoccl' (simulated hosts on one machine). "
            f"Make a "
            f"new communicator of the processes that go on (hoccl.init over their own MPI "
            f"communicator or store)")
    group = world.comm._group
    assert isinstance(group, ProcessGroup)
    return group


def _stop(parent: Any, call: str, wait: bool, reason: str) -> None:
    """Leave ``parent`` aborted: with ``wait``, once its calls in flight have finished
    (or failed: the error is logged, the shrink goes on)."""
    if wait and not parent.aborted:
        try:
            parent.synchronize()
        except HocclError as error:
            log.warning("rank %d %s: the calls in flight ended with %s", parent.rank, call,
                        error)
    parent.abort(reason)


def shrink(parent: Any, exclude: Any, wait: bool, overrides: Dict[str, Any]
           ) -> CommunicatorApi:
    """``CommunicatorApi.shrink`` of ``parent``, a ``HierarchicalCommunicator`` (see its
    docstring): a communicator across the survivors' hosts, or a ``Communicator`` when
    they are on one host."""
    call = "shrink"
    if parent.closed:
        raise InvalidArgumentError(f"{call}: the communicator is closed")
    exclude = check_exclude(call, exclude, parent.world_size)
    if parent.rank in exclude:
        raise InvalidArgumentError(f"{call}: rank {parent.rank} is in exclude {list(exclude)}; "
                                   f"only the ranks that go on call shrink")
    group = _world_group(parent, call)
    config = parent.config.replace(call, **overrides)
    survivors = [rank for rank in range(parent.world_size) if rank not in exclude]
    _stop(parent, call, wait, f"{call}: rank {parent.rank} shrank the communicator to ranks "
                              f"{survivors}, excluding {list(exclude)}")
    bootstrap: Any
    if isinstance(group, UcxTransport):
        # a channel of the meeting's own: the parent's channel with a shrink count above it
        parent._shrinks = getattr(parent, "_shrinks", 0) + 1
        bootstrap = UcxBootstrap(group, survivors, group.channel + (parent._shrinks << 12),
                                 config.timeout, call)
    else:
        group.dead_peer()  # an excluded process found gone is told to the bootstrap (MPI's)
        group.shrinks += 1
        bootstrap = MailboxBootstrap(group.mailboxes, survivors, (call, group.shrinks),
                                     config.timeout, call,
                                     peer_lost=getattr(group.bootstrap, "peer_lost",
                                                       lambda gone: None))
    theirs = bootstrap.allgather((exclude, socket.gethostname()))
    if any(other != exclude for other, _ in theirs):
        raise MismatchError(f"{call}: the ranks that go on excluded different ranks: "
                            + ", ".join(f"rank {survivors[index]} excluded {list(other)}"
                                        for index, (other, _) in enumerate(theirs)))
    hostnames: List[str] = [name for _, name in theirs]
    topology = survivors_topology(parent.topology, survivors)
    backend: str = parent.backend
    device: Optional[int] = parent.device
    if topology.hosts == 1:
        child: CommunicatorApi = connect_process(call, backend, bootstrap, device, config)
    else:
        def connect_host(members: Bootstrap, ordinal: Optional[int]) -> Communicator:
            return connect_process(call, backend, members, ordinal, host_config(config, backend))
        child = type(parent).connect(
            call=call, backend=backend, bootstrap=bootstrap, topology=topology,
            hostnames=hostnames, grouping=f"survivors of {parent._grouping}", device=device,
            inter_host=parent.inter_host, mpi_comm=None, config=config,
            connect_host=connect_host)
    log.info("%s: rank %d is rank %d of %d (excluded %s; %d hosts x %d)", call, parent.rank,
             child.rank, child.world_size, list(exclude), topology.hosts, topology.local_size)
    return child
