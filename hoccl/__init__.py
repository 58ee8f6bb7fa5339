"""hoccl: collective communication on the GPUs' copy engines, with zero SMs for data.

    import hoccl
    comm = hoccl.init()                 # under mpirun: one rank per process
    comms = hoccl.init_local([0, 1])    # one process, several ranks (Jupyter, tests)
    comm.all_gather(send, recv, stream=s)

The documentation (docs/, built with Sphinx) covers the API, the architecture and what
to do when things go wrong.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Sequence, Union

from . import _build
from ._api import CommunicatorApi
from .config import DEFAULT_TIMEOUT, Config, default_copy_sms, environ
from ._errors import (AbortedError, DivergedError, DriverError, HocclError, HocclTimeoutError,
                      InvalidArgumentError, MismatchError, PeerClosedError, PeerDeadError,
                      PlanError)
from ._validate import ReduceOp, integer, integers
from .backends import cuda_device_count, pick_backend
from ._hierarchy import INTER_HOST_ENGINES, HierarchicalCommunicator, host_topology
from ._hierarchy.hosts import backend_for, host_config
from .bootstrap import Bootstrap, MPIBootstrap
from .comm import Communicator, group, group_end, group_start
from ._arrays import empty, host_empty
from ._windows import Window

__all__ = ["init", "init_local", "split_local", "shrink_local", "Config", "Communicator", "CommunicatorApi",
           "HierarchicalCommunicator",
           "ReduceOp", "group", "group_start", "group_end", "Bootstrap", "HocclError",
           "InvalidArgumentError", "PlanError", "HocclTimeoutError", "AbortedError", "DriverError", "MismatchError",
           "PeerDeadError", "PeerClosedError", "DivergedError", "Window", "empty", "host_empty",
           "DEFAULT_TIMEOUT", "default_copy_sms"]

__version__ = "0.1.0"

log = logging.getLogger("hoccl")
_level = (environ("HOCCL_DEBUG") or "").upper()
if _level in ("INFO", "DEBUG", "WARNING"):
    # only hoccl's own logger: an application's logging configuration stays its own
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("hoccl %(levelname)s %(message)s"))
    log.addHandler(_handler)
    log.setLevel(_level)
    log.propagate = False


def _config(call: str, config: Optional[Config], given: dict) -> Config:
    """``config`` (default: the environment's, ``Config.from_environment``) with the
    settings ``given`` as keywords (None: not given)."""
    if config is None:
        return Config.from_environment(call, given)
    if not isinstance(config, Config):
        raise InvalidArgumentError(f"{call}: config must be a hoccl.Config; got "
                                   f"{type(config).__name__}")
    return config.replace(call, **{name: value for name, value in given.items()
                                   if value is not None})


def init_local(n_or_devices: Union[int, Sequence[int]], *, backend: Optional[str] = None,
               config: Optional[Config] = None, timeout: Optional[float] = None,
               verify_plans: Optional[bool] = None, max_sms: Optional[int] = None,
               copy_sms: Optional[int] = None, **settings: Any) -> List[Communicator]:
    """Several ranks in this process: one communicator per rank, rank i on device i.

    Settings: ``config`` (a ``hoccl.Config``), or any of its fields as keywords (they
    override ``config``'s); unset ones come from the environment (``HOCCL_<NAME>``) or the
    defaults.

    ``n_or_devices`` is a rank count (devices 0..n-1) or a list of distinct CUDA
    ordinals.  Make each collective on every communicator (in any rank order) before
    synchronizing, or inside ``hoccl.group()``.  Every call is checked against the
    other ranks' (collective, count, dtype, op, root) before any byte moves.
    ``verify_plans`` (or ``HOCCL_VERIFY=1``) proves every plan with
    ``hoccl.sched.verify`` before its first use.
    """
    call = "init_local"
    backend = pick_backend(call, backend)
    count = integer(n_or_devices)
    if count is None and not isinstance(n_or_devices, (list, tuple)):
        raise InvalidArgumentError(f"{call}: expected a rank count or a list of device "
                                   f"ordinals; got {n_or_devices!r}")
    ordinals = integers(range(count) if count is not None else n_or_devices)
    if ordinals is None or len(set(ordinals)) != len(ordinals):
        raise InvalidArgumentError(f"{call}: devices must be distinct int ordinals; got "
                                   f"{n_or_devices!r}")
    devices = list(ordinals)
    if not devices:
        raise InvalidArgumentError(f"{call}: need at least one rank; got {n_or_devices!r}")
    if backend == "cuda":
        visible = cuda_device_count()
        if not all(0 <= d < visible for d in devices):
            raise InvalidArgumentError(f"{call}: devices must be CUDA ordinals in "
                                       f"[0, {visible}); got {devices}")
    resolved = _config(call, config, dict(settings, timeout=timeout, verify_plans=verify_plans,
                                          max_sms=max_sms, copy_sms=copy_sms))
    comms = _build.open_local(backend, devices, resolved)
    log.info("init_local: %d ranks, backend %s, devices %s", len(comms), backend, devices)
    return comms


def split_local(comms: Sequence[Communicator], colors: Sequence[Optional[int]],
                keys: Optional[Sequence[Optional[int]]] = None, *,
                timeout: Optional[float] = None, verify_plans: Optional[bool] = None,
                max_sms: Optional[int] = None, copy_sms: Optional[int] = None,
                **settings: Any) -> List[Optional[Communicator]]:
    """``Communicator.split`` for the ranks of one ``init_local``, all at once.

    ``comms`` is every communicator ``init_local`` returned, in rank order; rank r goes
    into the communicator of ``colors[r]`` (None: no communicator, ncclCommSplit's
    NCCL_SPLIT_NOCOLOR), ordered by (``keys[r]``, r) (``keys=None`` or a key of None:
    by r).  Returns each rank's new communicator (None for a color of None), on the
    rank's own device (shared with its parent), with the parent's timeout, SM caps,
    plan verification and options unless given here.  One thread drives every rank of
    ``init_local``, so the ranks cannot each call ``split`` in turn (the first could not
    know its new rank before the last had called): they split in one call.
    """
    given = dict(settings, timeout=timeout, verify_plans=verify_plans, max_sms=max_sms,
                 copy_sms=copy_sms)
    return _build.split_local(comms, colors, keys, {name: value for name, value in given.items()
                                                    if value is not None})


def shrink_local(comms: Sequence[Communicator], exclude: Sequence[int], *, wait: bool = True,
                 timeout: Optional[float] = None, verify_plans: Optional[bool] = None,
                 max_sms: Optional[int] = None, copy_sms: Optional[int] = None,
                 **settings: Any) -> List[Communicator]:
    """``Communicator.shrink`` for the ranks of one ``init_local`` that go on, all at once.

    ``comms`` are the communicators of every rank not in ``exclude``, in rank order (the
    excluded ranks' may be closed or not).  Returns their new communicators, numbered
    0..n-1 in that order, with pads, lanes and matching of their own and the parents'
    settings unless given here.  Every rank of the parent ``init_local`` (the excluded
    ones too) is left aborted: with ``wait``, once the calls in flight that can finish
    have finished.
    """
    if not isinstance(wait, bool):
        raise InvalidArgumentError(f"shrink_local: wait must be True or False; got {wait!r}")
    given = dict(settings, timeout=timeout, verify_plans=verify_plans, max_sms=max_sms,
                 copy_sms=copy_sms)
    return _build.shrink_local(comms, exclude, wait, {name: value for name, value in
                                                      given.items() if value is not None})


def init(*, backend: Optional[str] = None, mpi_comm: Any = None,
         bootstrap: Optional[Bootstrap] = None, device: Optional[int] = None,
         config: Optional[Config] = None, timeout: Optional[float] = None,
         verify_plans: Optional[bool] = None, max_sms: Optional[int] = None,
         copy_sms: Optional[int] = None, local_size: Optional[int] = None,
         inter_host: Optional[str] = None, **settings: Any) -> CommunicatorApi:
    """This process's rank of a multi-process job.

    The ranks find each other through ``bootstrap`` (any ``hoccl.Bootstrap``: rank,
    world_size, allgather, barrier, close; ``hoccl.torch`` makes one from a
    torch.distributed Store) or else through MPI (``mpi_comm``, default
    ``MPI.COMM_WORLD``).  ``device=None`` picks the local rank modulo the visible GPUs.

    Ranks on several hosts (grouped by hostname, or ``local_size`` / ``HOCCL_LOCAL_SIZE``
    consecutive ranks per simulated host) get a ``HierarchicalCommunicator``: an engine
    inside each host (the ``intra_host`` setting, ``HOCCL_INTRA_HOST`` per host: hoccl's
    "cuda" or "host" backend, or "torch"'s device library; None picks from what the host
    has; it also picks this rank's backend), ``inter_host`` ("nccl", "mpi", "gloo", "ucx"
    or "hoccl"; None picks) between hosts, behind the same API.  On one host
    ``inter_host`` and ``intra_host`` are not used.

    Settings: ``config`` (a ``hoccl.Config``), or any of its fields as keywords (they
    override ``config``'s); unset ones come from the environment (``HOCCL_<NAME>``) or the
    defaults.  Every rank should pass the same.
    """
    call = "init"
    if device is not None:
        ordinal = integer(device)
        if ordinal is None or ordinal < 0:
            raise InvalidArgumentError(f"{call}: device must be a CUDA ordinal (an int >= 0) or "
                                       f"None (the local rank's GPU); got {device!r}")
        device = ordinal
    local_size = local_size if integer(local_size) is None else integer(local_size)
    resolved = _config(call, config, dict(settings, timeout=timeout, verify_plans=verify_plans,
                                          max_sms=max_sms, copy_sms=copy_sms))
    backend = pick_backend(call, backend_for(call, resolved.intra_host, backend))
    if inter_host not in (None,) + INTER_HOST_ENGINES:
        raise InvalidArgumentError(f"{call}: inter_host must be one of {INTER_HOST_ENGINES} or "
                                   f"None; got {inter_host!r}")
    if bootstrap is None:
        if inter_host == "ucx":  # UCX's libraries before MPI's own copy (``_hierarchy.ucx``)
            from ._hierarchy.ucx import preload
            preload()
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
            return _build.connect_process(call, backend, members, ordinal,
                                          host_config(resolved, backend))
        return HierarchicalCommunicator.connect(
            call=call, backend=backend, bootstrap=bootstrap, topology=topology,
            hostnames=hostnames, grouping=grouping, device=device, inter_host=inter_host,
            mpi_comm=mpi_comm, config=resolved, connect_host=connect_host)
    return _build.connect_process(call, backend, bootstrap, device, resolved)
