"""How communicators are put together: ``init``, ``init_local`` and ``split`` end here.

A rank's communicator is an ``Engine`` (on a device it opened, or borrowed from the
communicator it was split from: a ``DeviceShare``), a ``Group`` that matches its calls
with its peers', a ``Health`` monitor and the ``Communicator`` in front of them::

    init        bootstrap ─► ProcessGroup ─► open device ─► Engine ─► swap pads ─► Communicator
    init_local  LocalGroup ─► open devices ─► Engines ─► pads ─► Communicators
    split       parent's bootstrap.split ─► ProcessGroup ─► parent's device ─► Engine ─► ...
    split_local parents' LocalGroup: one new LocalGroup per color, parents' devices ─► ...
    shrink      parent aborted ─► MailboxBootstrap over the survivors ─► ProcessGroup ─► ...
    shrink_local parents aborted ─► a new LocalGroup of the survivors ─► ...
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._engine import DeviceShare, Engine
from ._errors import HocclError, InvalidArgumentError, MismatchError
from ._validate import integer
from ._health import Health
from .backends import cuda_device_count, open_device
from .backends._base import SmCaps
from ._groups import LocalGroup, ProcessGroup
from ._groups.survivors import MailboxBootstrap
from .bootstrap import Bootstrap
from .comm import _Builders, Communicator
from .config import Config, default_copy_sms, environ
from .sched.select import Table
from .tuning import load_table, machine_of, shared_table

__all__ = ["make_engine", "connect_local", "open_local", "connect_process", "check_color_key",
           "members", "split", "split_local", "check_exclude", "shrink", "shrink_local"]

log = logging.getLogger("hoccl")

#: largest color and key MPI_Comm_split takes (a C int)
_INT_MAX = (1 << 31) - 1


def make_engine(config: Config, rank: int, world_size: int, share: DeviceShare,
                owns_device: bool) -> Engine:
    """A rank's engine with ``config``'s settings (``copy_sms`` None: by world size)."""
    engine = Engine(rank=rank, world_size=world_size, share=share, options=config.plan_options,
                    verify_plans=config.verify_plans, owns_device=owns_device,
                    sms=SmCaps(config.max_sms, config.copy_sms or default_copy_sms(world_size),
                               True if config.fuse_sums is None else config.fuse_sums),
                    given=config.given)
    return engine


def _use_table(engines: Sequence[Engine], machine: Dict[str, Any],
               found: Tuple[Optional[Table], str]) -> None:
    for engine in engines:
        engine.use_table(machine, *found)


def connect_local(shares: Sequence[DeviceShare], config: Config, owns_devices: bool
                  ) -> List[Communicator]:
    """One communicator per device of ``shares`` (rank i on ``shares[i]``), all driven
    from this process through one ``LocalGroup``."""
    group = LocalGroup(len(shares))
    engines = [make_engine(config, rank, len(shares), share, owns_devices)
               for rank, share in enumerate(shares)]
    for engine in engines:
        engine.pad.connect([other.pad.address for other in engines])
    machine = machine_of(engines[0].device, len(engines), 1)
    _use_table(engines, machine, load_table(machine, "init_local"))
    monitors = [Health(engine, config.timeout, group) for engine in engines]
    group.monitors = monitors
    return [Communicator(engine=engine, group=group, health=health, builders=_BUILDERS)
            for engine, health in zip(engines, monitors)]


def open_local(backend: str, devices: List[int], config: Config) -> List[Communicator]:
    """``init_local``'s ranks: device ``devices[i]`` opened for rank i."""
    copy_sms = config.copy_sms or default_copy_sms(len(devices))
    handles = [open_device(backend, ordinal, max_sms=config.max_sms, copy_sms=copy_sms)
               for ordinal in devices]
    for handle in handles:
        for peer in handles:
            if peer is not handle:
                handle.enable_peer_access(peer)
    return connect_local([DeviceShare(handle) for handle in handles], config,
                         owns_devices=True)


def connect_process(call: str, backend: str, bootstrap: Bootstrap, device: Optional[int],
                    config: Config, share: Optional[DeviceShare] = None,
                    owns_device: bool = False) -> Communicator:
    """The communicator of ``bootstrap``'s ranks, all on one host: on ``share``'s device
    (borrowed, ``split``, unless ``owns_device``: opened for it, ``shrink``) or else on
    ``device`` (opened; None: the local rank's GPU)."""
    group = ProcessGroup(bootstrap, config.timeout)
    world_size = group.world_size
    local_rank = group.local_rank()  # an exchange every rank makes, device given or not
    if share is None:
        if backend == "cuda" and device is None:
            device = local_rank % cuda_device_count()
        share = DeviceShare(open_device(
            backend, device, max_sms=config.max_sms,
            copy_sms=config.copy_sms or default_copy_sms(world_size)))
        owns_device = True
    handle = share.device
    engine = make_engine(config, group.rank, world_size, share, owns_device)
    identity = (group.host, group.pid, handle.ordinal, engine.pad.export(),
                handle.physical)
    everyone = bootstrap.allgather(identity)
    if config.fuse_sums is None and shares_device(everyone, group.rank):
        # a launch that waits for a peer on its own GPU spins through its context's time
        # slices while the peer's context, which must run to send the signal, waits for
        # its turn: fused sums are slower there than a stream wait per chunk
        engine.set_fuse_sums(False)
    physical = [identity[-1] for identity in everyone]
    per_gpu = max(physical.count(one) for one in physical) if None not in physical else 1
    machine = machine_of(handle, world_size, per_gpu)
    _use_table([engine], machine, shared_table(call, group.rank, machine, bootstrap.allgather))
    for rank, (host, _, _, _, _) in enumerate(everyone):
        if host != group.host:
            raise InvalidArgumentError(f"{call}: rank {rank} runs on host {host}, rank "
                                       f"{group.rank} on {group.host}; hoccl connects the GPUs "
                                       f"of one host (one NVLink domain)")
    engine.pad.import_peers([pad for _, _, _, pad, _ in everyone])
    health = Health(engine, config.timeout, group)
    comm = Communicator(engine=engine, group=group, health=health, builders=_BUILDERS)
    bootstrap.barrier()
    log.info("%s: rank %d/%d backend %s device %s", call, group.rank, world_size, backend,
             handle.ordinal)
    return comm


def shares_device(identities: Sequence[tuple], rank: int) -> bool:
    """Whether another rank's identity (``connect_process``'s: last, the device's physical
    id) names ``rank``'s device."""
    mine = identities[rank][-1]
    return mine is not None and any(other[-1] == mine for index, other in enumerate(identities)
                                    if index != rank)


# -- split ----------------------------------------------------------------------------------
def check_color_key(call: str, color: Any, key: Any) -> Tuple[Optional[int], Optional[int]]:
    """``color``: an int in [0, 2**31) or None (no communicator); ``key``: an int in
    [-2**31, 2**31) or None (the parent rank).  Numpy's integers and 0-dim torch tensors
    are ints; both are returned as ints."""
    number = integer(color)
    if color is not None and (number is None or not 0 <= number <= _INT_MAX):
        raise InvalidArgumentError(f"{call}: color must be an int in [0, 2**31) or None (no "
                                   f"communicator for this rank); got {color!r}")
    order = integer(key)
    if key is not None and (order is None or not -_INT_MAX - 1 <= order <= _INT_MAX):
        raise InvalidArgumentError(f"{call}: key must be an int in [-2**31, 2**31) or None "
                                   f"(order by parent rank); got {key!r}")
    return number, order


def members(colors: Sequence[Optional[int]], keys: Sequence[Optional[int]]
            ) -> Dict[int, List[int]]:
    """color -> the parent ranks of that color in child rank order: by (key, parent rank),
    a key of None being the parent rank (MPI_Comm_split's order)."""
    order: Dict[int, List[Tuple[int, int]]] = {}
    for rank, (color, key) in enumerate(zip(colors, keys)):
        if color is not None:
            order.setdefault(color, []).append((rank if key is None else key, rank))
    return {color: [rank for _, rank in sorted(ranked)] for color, ranked in order.items()}


def _refuse_cuda(call: str, backend: str, instead: str) -> None:
    """``split_local`` on GPUs has not run on GPUs yet (``split`` under mpirun has, since
    stale IPC mappings are closed and callers fenced after imports), so it is refused
    there rather than offered untried; ``HOCCL_SPLIT_CUDA=1`` lifts the refusal."""
    if backend == "cuda" and environ("HOCCL_SPLIT_CUDA") != "1":
        raise InvalidArgumentError(
            f"{call}: split_local of GPU communicators has not been validated on GPUs yet; "
            f"{instead} (HOCCL_SPLIT_CUDA=1 allows it)")


def split(parent: Communicator, color: Any, key: Any, overrides: Dict[str, Any]
          ) -> Optional[Communicator]:
    """``Communicator.split`` of a rank of a process group (see its docstring).

    The arguments are checked on every rank and the verdicts swapped through the parent's
    mailboxes first (``ProcessGroup.agree``: bounded by the timeout and the peers'
    liveness), so that a bad argument, or a rank that never calls ``split``, raises on
    all of them instead of leaving the others waiting in MPI_Comm_split."""
    call = "split"
    engine, group, health = parent._engine, parent._group, parent._health
    if not isinstance(group, ProcessGroup):
        raise InvalidArgumentError(
            f"{call}: the ranks of init_local live in one process and split together: "
            f"hoccl.split_local(comms, colors, keys)")
    split_bootstrap = getattr(group.bootstrap, "split", None)
    if split_bootstrap is None:
        raise InvalidArgumentError(
            f"{call}: this communicator's bootstrap ({type(group.bootstrap).__name__}) cannot "
            f"split; split needs an MPI bootstrap (hoccl.init under mpirun or with mpi_comm=)")
    problem: Optional[str] = None
    try:
        color, key = check_color_key(call, color, key)
        config = parent.config.replace(call, **overrides)
    except InvalidArgumentError as error:
        problem = str(error)
    verdicts = group.agree(call, problem)
    wrong = [(rank, verdict) for rank, verdict in enumerate(verdicts) if verdict is not None]
    if wrong:
        rank, verdict = wrong[0]
        raise InvalidArgumentError(verdict if rank == engine.rank
                                   else f"{call}: rank {rank} was refused: {verdict}")
    bootstrap = split_bootstrap(color, engine.rank if key is None else key)
    if bootstrap is None:
        return None
    try:
        child = connect_process(call, engine.device.backend, bootstrap, None, config,
                                share=engine.share.borrow(call))
    except BaseException:
        bootstrap.close()
        raise
    health.adopt(child._health)
    return child


def split_local(parents: Sequence[Communicator], colors: Sequence[Any],
                keys: Optional[Sequence[Any]], overrides: Dict[str, Any]
                ) -> List[Optional[Communicator]]:
    """``hoccl.split_local`` (see its docstring): the children of ``init_local`` ranks."""
    call = "split_local"
    parents = list(parents)
    group = parents[0]._group if parents else None
    if (not isinstance(group, LocalGroup) or len(parents) != group.world_size
            or any(comm._group is not group or comm.rank != rank
                   for rank, comm in enumerate(parents))):
        raise InvalidArgumentError(
            f"{call}: comms must be every communicator of one hoccl.init_local, in rank "
            f"order; got {parents!r}")
    keys = [None] * len(parents) if keys is None else list(keys)
    colors = list(colors)
    if len(colors) != len(parents) or len(keys) != len(parents):
        raise InvalidArgumentError(f"{call}: expected one color and one key per rank "
                                   f"({len(parents)}); got {len(colors)} colors and "
                                   f"{len(keys)} keys")
    checked = [check_color_key(call, color, key) for color, key in zip(colors, keys)]
    colors, keys = [color for color, _ in checked], [key for _, key in checked]
    for comm in parents:
        comm._usable(call)
    _refuse_cuda(call, parents[0].backend, "make communicators of their own with "
                 "hoccl.init_local over the GPUs of each group")
    config = parents[0].config.replace(call, **overrides)
    children: List[Optional[Communicator]] = [None] * len(parents)
    for color, ranks in sorted(members(colors, keys).items()):
        shares = [parents[rank]._engine.share.borrow(call) for rank in ranks]
        built = connect_local(shares, config, owns_devices=False)
        for rank, child in zip(ranks, built):
            parents[rank]._health.adopt(child._health)
            children[rank] = child
        log.info("%s: color %d: parent ranks %s", call, color, ranks)
    return children


# -- shrink ---------------------------------------------------------------------------------
def check_exclude(call: str, exclude: Any, world_size: int) -> Tuple[int, ...]:
    """``exclude`` (a sequence or set of ranks, each an int in [0, world_size), some rank
    left out) as a sorted tuple without repeats."""
    try:
        ranks = sorted({operator.index(rank) for rank in exclude})
    except TypeError:
        raise InvalidArgumentError(f"{call}: exclude must be a sequence of ranks (ints); got "
                                   f"{exclude!r}") from None
    if not ranks or ranks[0] < 0 or ranks[-1] >= world_size or len(ranks) >= world_size:
        raise InvalidArgumentError(f"{call}: exclude must name at least one rank, each in "
                                   f"[0, {world_size}), and leave at least one; got {exclude!r}")
    return tuple(ranks)


def _stop(parent: Communicator, call: str, wait: bool, reason: str) -> None:
    """Leave ``parent`` aborted: with ``wait``, once its calls in flight have finished
    (or failed: a lost peer, the timeout; the error is logged, the shrink goes on)."""
    engine, health = parent._engine, parent._health
    if wait and not engine.aborted and engine.unfinished() and not engine.held():
        try:
            health.synchronize(call)
        except HocclError as error:
            log.warning("rank %d %s: the calls in flight ended with %s", engine.rank, call,
                        error)
    if not engine.aborted:
        health.abort(reason)


def _survivor_share(parent: Communicator, call: str) -> Tuple[DeviceShare, bool]:
    """The survivor's device and whether it was opened for it (``Device.fresh``)."""
    engine = parent._engine
    fresh = engine.device.fresh()
    if fresh is not None:
        return DeviceShare(fresh), True
    return engine.share.borrow(call), False


def shrink(parent: Communicator, exclude: Any, wait: bool, overrides: Dict[str, Any]
           ) -> Communicator:
    """``Communicator.shrink`` of a rank of a process group (see its docstring)."""
    call = "shrink"
    engine, group = parent._engine, parent._group
    if engine.closed:
        raise InvalidArgumentError(f"{call}: the communicator is closed")
    if not isinstance(group, ProcessGroup):
        raise InvalidArgumentError(
            f"{call}: the ranks of init_local live in one process and shrink together: "
            f"hoccl.shrink_local(comms, exclude)")
    exclude = check_exclude(call, exclude, engine.world_size)
    if engine.rank in exclude:
        raise InvalidArgumentError(f"{call}: rank {engine.rank} is in exclude {list(exclude)}; "
                                   f"only the ranks that go on call shrink")
    config = parent.config.replace(call, **overrides)
    survivors = [rank for rank in range(engine.world_size) if rank not in exclude]
    _stop(parent, call, wait, f"{call}: rank {engine.rank} shrank the communicator to ranks "
                              f"{survivors}, excluding {list(exclude)}")
    group.dead_peer()  # an excluded process found gone is told to the bootstrap (MPI's exit)
    group.shrinks += 1
    bootstrap = MailboxBootstrap(group.mailboxes, survivors, (call, group.shrinks),
                                 config.timeout, call,
                                 peer_lost=getattr(group.bootstrap, "peer_lost",
                                                   lambda gone: None))
    theirs = bootstrap.allgather(exclude)
    if any(other != exclude for other in theirs):
        raise MismatchError(f"{call}: the ranks that go on excluded different ranks: "
                            + ", ".join(f"rank {survivors[index]} excluded {list(other)}"
                                        for index, other in enumerate(theirs)))
    share, opened = _survivor_share(parent, call)
    try:
        child = connect_process(call, engine.device.backend, bootstrap, None, config,
                                share=share, owns_device=opened)
    except BaseException:
        share.leave(leak=False)
        raise
    log.info("%s: rank %d is rank %d of %d (excluded %s)", call, engine.rank, child.rank,
             child.world_size, list(exclude))
    return child


def shrink_local(parents: Sequence[Communicator], exclude: Any, wait: bool,
                 overrides: Dict[str, Any]) -> List[Communicator]:
    """``hoccl.shrink_local`` (see its docstring): the survivors of ``init_local`` ranks."""
    call = "shrink_local"
    parents = list(parents)
    group = parents[0]._group if parents else None
    if not isinstance(group, LocalGroup) or any(comm._group is not group for comm in parents):
        raise InvalidArgumentError(f"{call}: comms must be communicators of one "
                                   f"hoccl.init_local; got {parents!r}")
    exclude = check_exclude(call, exclude, group.world_size)
    survivors = [rank for rank in range(group.world_size) if rank not in exclude]
    if [comm.rank for comm in parents] != survivors:
        raise InvalidArgumentError(f"{call}: comms must be the communicators of ranks "
                                   f"{survivors} (every rank not excluded), in rank order; got "
                                   f"ranks {[comm.rank for comm in parents]}")
    for comm in parents:
        if comm.closed:
            raise InvalidArgumentError(f"{call}: rank {comm.rank}'s communicator is closed")
    _refuse_cuda(call, parents[0].backend, "make a communicator of the GPUs that go on with "
                 "hoccl.init_local")
    config = parents[0].config.replace(call, **overrides)
    reason = f"{call}: shrunk to ranks {survivors}, excluding {list(exclude)}"
    for comm in parents:
        _stop(comm, call, wait, reason)
    shares = [_survivor_share(comm, call) for comm in parents]
    children = connect_local([share for share, _ in shares], config,
                             owns_devices=all(opened for _, opened in shares))
    log.info("%s: ranks %s go on as ranks 0..%d", call, survivors, len(children) - 1)
    return children


#: what every communicator built here makes its children and survivors with
_BUILDERS = _Builders(split=split, shrink=shrink)
