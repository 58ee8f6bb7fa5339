"""hoccl: collective communication on the GPUs' copy engines, with zero SMs for data.

    import hoccl
    comm = hoccl.init()                 # under mpirun: one rank per process
    comms = hoccl.init_local([0, 1])    # one process, several ranks (Jupyter, tests)
    comm.all_gather(send, recv, stream=s)

See the README for the API, the architecture and what to do when things go wrong.
"""

from __future__ import annotations

import logging
import os
from typing import Any, List, Optional, Sequence, Union

from . import _validate as check
from ._engine import Engine
from ._errors import (AbortedError, DriverError, HocclError, HocclTimeoutError,
                      InvalidArgumentError, MismatchError, PeerDeadError, PlanError)
from ._health import Health
from ._validate import ReduceOp
from .backends import cuda_device_count, open_device, pick_backend
from ._hierarchy import INTER_HOST_ENGINES, HierarchicalCommunicator, host_topology
from .bootstrap import Bootstrap, LocalGroup, MPIBootstrap, ProcessGroup
from .comm import Communicator, group, group_end, group_start
from .sched import Options

__all__ = ["init", "init_local", "Communicator", "HierarchicalCommunicator", "ReduceOp", "group",
           "group_start", "group_end", "Bootstrap", "HocclError", "InvalidArgumentError",
           "PlanError", "HocclTimeoutError", "AbortedError", "DriverError", "MismatchError",
           "PeerDeadError",
           "DEFAULT_TIMEOUT", "default_copy_sms"]

__version__ = "0.1.0"

#: seconds a host wait may take before it raises (``HOCCL_TIMEOUT`` overrides)
DEFAULT_TIMEOUT = 300.0

log = logging.getLogger("hoccl")
_level = os.environ.get("HOCCL_DEBUG", "").upper()
if _level in ("INFO", "DEBUG", "WARNING"):
    # only hoccl's own logger: an application's logging configuration stays its own
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("hoccl %(levelname)s %(message)s"))
    log.addHandler(_handler)
    log.setLevel(_level)
    log.propagate = False


def default_copy_sms(world_size: int) -> int:
    """SMs for a rank's own block in out-of-place forms (the one same-GPU copy, which
    runs beside the peers' copy-engine transfers): enough to finish within them.  On 2 ×
    H200 a 1 GiB all_gather's 512 MiB own block took 1.49 ms on 8 SMs, longer than the
    1.36 ms NVLink copy beside it (busbw 372 GB/s); on 16 it fit (380).  The copy-engine
    time grows with the number of peers while the own block does not: 16 / (n - 1)."""
    return max(2, -(-16 // max(1, world_size - 1)))


class _Settings:
    """What ``init`` and ``init_local`` take besides the ranks, checked once."""

    def __init__(self, call: str, world_size: int, timeout: Optional[float],
                 check_plans: Optional[bool], max_sms: int, copy_sms: Optional[int],
                 options: dict):
        self.timeout = check.timeout_setting(call, timeout, DEFAULT_TIMEOUT)
        check.positive_int(call, "max_sms", max_sms)
        check.positive_int(call, "copy_sms", copy_sms, optional=True)
        self.max_sms = max_sms
        self.copy_sms = copy_sms or default_copy_sms(world_size)
        self.verify_plans = check.flag_setting(check_plans, "HOCCL_VERIFY")
        self.options = check.plan_options(call, Options(), options)

    def engine(self, rank: int, world_size: int, device: Any) -> Engine:
        return Engine(rank=rank, world_size=world_size, device=device, options=self.options,
                      verify_plans=self.verify_plans)


def init_local(n_or_devices: Union[int, Sequence[int]], *, backend: Optional[str] = None,
               timeout: Optional[float] = None, verify_plans: Optional[bool] = None,
               max_sms: int = 8, copy_sms: Optional[int] = None,
               **options: Any) -> List[Communicator]:
    """Several ranks in this process: one communicator per rank, rank i on device i.

    ``n_or_devices`` is a rank count (devices 0..n-1) or a list of distinct CUDA
    ordinals.  Make each collective on every communicator (in any rank order) before
    synchronizing, or inside ``hoccl.group()``.  Every call is checked against the
    other ranks' (collective, count, dtype, op, root) before any byte moves.
    ``verify_plans`` (or ``HOCCL_VERIFY=1``) proves every plan with
    ``hoccl.sched.verify`` before its first use.
    """
    call = "init_local"
    backend = pick_backend(call, backend)
    if isinstance(n_or_devices, bool) or not isinstance(n_or_devices, (int, list, tuple)):
        raise InvalidArgumentError(f"{call}: expected a rank count or a list of device "
                                   f"ordinals; got {n_or_devices!r}")
    devices = list(range(n_or_devices)) if isinstance(n_or_devices, int) else list(n_or_devices)
    if not devices:
        raise InvalidArgumentError(f"{call}: need at least one rank; got {n_or_devices!r}")
    if any(isinstance(d, bool) or not isinstance(d, int) for d in devices) \
            or len(set(devices)) != len(devices):
        raise InvalidArgumentError(f"{call}: devices must be distinct int ordinals; got "
                                   f"{devices}")
    if backend == "cuda":
        visible = cuda_device_count()
        if not all(0 <= d < visible for d in devices):
            raise InvalidArgumentError(f"{call}: devices must be CUDA ordinals in "
                                       f"[0, {visible}); got {devices}")
    settings = _Settings(call, len(devices), timeout, verify_plans, max_sms, copy_sms, options)
    group = LocalGroup(len(devices))
    handles = [open_device(backend, ordinal, max_sms=settings.max_sms,
                           copy_sms=settings.copy_sms) for ordinal in devices]
    for handle in handles:
        for peer in handles:
            if peer is not handle:
                handle.enable_peer_access(peer)
    engines = [settings.engine(rank, len(devices), handle) for rank, handle in enumerate(handles)]
    for engine in engines:
        engine.pad.connect([other.pad.address for other in engines])
    monitors = [Health(engine, settings.timeout, group.siblings, group.forget_calls)
                for engine in engines]
    group.monitors = monitors
    comms = [Communicator(engine=engine, group=group, health=health)
             for engine, health in zip(engines, monitors)]
    log.info("init_local: %d ranks, backend %s, devices %s", len(comms), backend, devices)
    return comms


def init(*, backend: Optional[str] = None, mpi_comm: Any = None,
         bootstrap: Optional[Bootstrap] = None, device: Optional[int] = None,
         timeout: Optional[float] = None, verify_plans: Optional[bool] = None,
         max_sms: int = 8, copy_sms: Optional[int] = None, local_size: Optional[int] = None,
         inter_host: Optional[str] = None, **options: Any) -> Communicator:
    """This process's rank of a multi-process job.

    The ranks find each other through ``bootstrap`` (any ``hoccl.Bootstrap``: rank,
    world_size, allgather, barrier, close; ``hoccl.torch`` makes one from a
    torch.distributed Store) or else through MPI (``mpi_comm``, default
    ``MPI.COMM_WORLD``).  ``device=None`` picks the local rank modulo the visible GPUs.

    Ranks on several hosts (grouped by hostname, or ``local_size`` / ``HOCCL_LOCAL_SIZE``
    consecutive ranks per simulated host) get a ``HierarchicalCommunicator``: hoccl
    inside each host, ``inter_host`` ("nccl", "mpi" or "hoccl"; None picks) between
    hosts, behind the same API.  On one host ``inter_host`` is not used.
    """
    call = "init"
    backend = pick_backend(call, backend)
    if inter_host not in (None,) + INTER_HOST_ENGINES:
        raise InvalidArgumentError(f"{call}: inter_host must be one of {INTER_HOST_ENGINES} or "
                                   f"None; got {inter_host!r}")
    if bootstrap is None:
        try:
            from mpi4py import MPI
        except ImportError:
            raise InvalidArgumentError(
                f"{call}: mpi4py is needed to find the other ranks (pip install "
                f"'hoccl[mpi]'), or pass bootstrap= (e.g. from hoccl.torch)") from None
        bootstrap = MPIBootstrap(mpi_comm if mpi_comm is not None else MPI.COMM_WORLD)
    topology, hostnames, grouping = host_topology(call, bootstrap, local_size)
    if topology.hosts > 1:
        def connect_host(members: Bootstrap, ordinal: Optional[int]) -> Communicator:
            return _connect(call, backend, members, ordinal, timeout, verify_plans, max_sms,
                            copy_sms, options)
        return HierarchicalCommunicator.connect(
            call=call, backend=backend, bootstrap=bootstrap, topology=topology,
            hostnames=hostnames, grouping=grouping, device=device, inter_host=inter_host,
            mpi_comm=mpi_comm, verify_plans=check.flag_setting(verify_plans, "HOCCL_VERIFY"),
            connect_host=connect_host)
    return _connect(call, backend, bootstrap, device, timeout, verify_plans, max_sms, copy_sms,
                    options)


def _connect(call: str, backend: str, bootstrap: Bootstrap, device: Optional[int],
             timeout: Optional[float], verify_plans: Optional[bool], max_sms: int,
             copy_sms: Optional[int], options: dict) -> Communicator:
    """The communicator of ``bootstrap``'s ranks, all on one host."""
    group = ProcessGroup(bootstrap, check.timeout_setting(call, timeout, DEFAULT_TIMEOUT))
    world_size = group.world_size
    settings = _Settings(call, world_size, timeout, verify_plans, max_sms, copy_sms, options)
    local_rank = group.local_rank()  # an exchange every rank makes, device given or not
    if backend == "cuda" and device is None:
        device = local_rank % cuda_device_count()
    handle = open_device(backend, device, max_sms=settings.max_sms, copy_sms=settings.copy_sms)
    engine = settings.engine(group.rank, world_size, handle)
    identity = (group.host, group.pid, handle.ordinal, handle.export(engine.pad.address))
    everyone = bootstrap.allgather(identity)
    pads = []
    for rank, (host, _, _, pad) in enumerate(everyone):
        if host != group.host:
            raise InvalidArgumentError(f"{call}: rank {rank} runs on host {host}, rank "
                                       f"{group.rank} on {group.host}; hoccl connects the GPUs "
                                       f"of one host (one NVLink domain)")
        pads.append(engine.pad.address if rank == group.rank else handle.import_(pad))
    engine.pad.connect(pads)
    health = Health(engine, settings.timeout, group.siblings, group.forget_calls,
                    peers_alive=group.dead_peer)
    comm = Communicator(engine=engine, group=group, health=health)
    bootstrap.barrier()
    log.info("init: rank %d/%d backend %s device %s", group.rank, world_size, backend,
             handle.ordinal)
    return comm
