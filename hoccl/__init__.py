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

from ._errors import (AbortedError, DriverError, HocclError, HocclTimeoutError,
                      InvalidArgumentError, MismatchError, PlanError)
from .backends import cuda_device_count, open_device, pick_backend
from .bootstrap import LocalGroup, MPIGroup
from .comm import Communicator, ReduceOp, _options
from .sched import Options

__all__ = ["init", "init_local", "Communicator", "ReduceOp", "HocclError",
           "InvalidArgumentError", "PlanError", "HocclTimeoutError", "AbortedError",
           "DriverError", "MismatchError", "DEFAULT_TIMEOUT", "default_copy_sms"]

__version__ = "0.1.0"

#: seconds a host wait may take before it raises (``HOCCL_TIMEOUT`` overrides)
DEFAULT_TIMEOUT = 300.0

log = logging.getLogger("hoccl")
_level = os.environ.get("HOCCL_DEBUG", "").upper()
if _level in ("INFO", "DEBUG", "WARNING"):
    logging.basicConfig(format="hoccl %(levelname)s %(message)s")
    log.setLevel(_level)


def default_copy_sms(world_size: int) -> int:
    """SMs for a rank's own block in out-of-place forms (the one same-GPU copy, which
    runs beside the peers' copy-engine transfers): enough to finish within them.  On 2 ×
    H200 a 1 GiB all_gather's 512 MiB own block took 1.49 ms on 8 SMs, longer than the
    1.36 ms NVLink copy beside it (busbw 372 GB/s); on 16 it fit (380).  The copy-engine
    time grows with the number of peers while the own block does not: 16 / (n - 1)."""
    return max(2, -(-16 // max(1, world_size - 1)))


def _sms(call: str, name: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{call}: {name} must be a positive int"
                                   f"{' or None' if optional else ''}; got {value!r}")


def _settings(call: str, timeout: Optional[float], check: Optional[bool], max_sms: int,
              copy_sms: Optional[int], options: dict) -> tuple:
    if timeout is None:
        timeout = float(os.environ.get("HOCCL_TIMEOUT", DEFAULT_TIMEOUT))
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise InvalidArgumentError(f"{call}: timeout must be a positive number of seconds; "
                                   f"got {timeout!r}")
    if check is None:
        check = os.environ.get("HOCCL_CHECK", "0") not in ("", "0")
    _sms(call, "max_sms", max_sms)
    _sms(call, "copy_sms", copy_sms, optional=True)
    verify_plans = os.environ.get("HOCCL_VERIFY", "0") not in ("", "0")
    return float(timeout), bool(check), verify_plans, _options(Options(), call, **options)


def init_local(n_or_devices: Union[int, Sequence[int]], *, backend: Optional[str] = None,
               timeout: Optional[float] = None, check: Optional[bool] = None,
               max_sms: int = 8, copy_sms: Optional[int] = None,
               **options: Any) -> List[Communicator]:
    """Several ranks in this process: one communicator per rank, rank i on device i.

    ``n_or_devices`` is a rank count (devices 0..n-1) or a list of CUDA ordinals.  Make
    each collective on every communicator (in any rank order) before synchronizing.
    """
    call = "init_local"
    backend = pick_backend(call, backend)
    if isinstance(n_or_devices, bool) or not isinstance(n_or_devices, (int, list, tuple)):
        raise InvalidArgumentError(f"{call}: expected a rank count or a list of device "
                                   f"ordinals; got {n_or_devices!r}")
    devices = list(range(n_or_devices)) if isinstance(n_or_devices, int) else list(n_or_devices)
    if not devices:
        raise InvalidArgumentError(f"{call}: need at least one rank; got {n_or_devices!r}")
    if backend == "cuda":
        visible = cuda_device_count()
        bad = [d for d in devices if not isinstance(d, int) or not 0 <= d < visible]
        if bad or len(set(devices)) != len(devices):
            raise InvalidArgumentError(f"{call}: devices must be distinct CUDA ordinals in "
                                       f"[0, {visible}); got {devices}")
    timeout, check, verify_plans, plan_options = _settings(call, timeout, check, max_sms,
                                                           copy_sms, options)
    group = LocalGroup(len(devices))
    handles = [open_device(backend, ordinal, max_sms=max_sms) for ordinal in devices]
    for handle in handles:
        handle.copy_sms = copy_sms or default_copy_sms(len(devices))
    for handle in handles:
        for peer in handles:
            if peer is not handle:
                handle.enable_peer_access(peer)
    comms = [Communicator(rank=rank, world_size=len(devices), device=handle, group=group,
                          options=plan_options, timeout=timeout, check=check,
                          verify_plans=verify_plans)
             for rank, handle in enumerate(handles)]
    group.comms = comms
    pads = [comm.pad_address for comm in comms]
    for comm in comms:
        comm._connect(pads)
    log.info("init_local: %d ranks, backend %s, devices %s", len(comms), backend, devices)
    return comms


def init(*, backend: Optional[str] = None, mpi_comm: Any = None, bootstrap: Any = None,
         device: Optional[int] = None, timeout: Optional[float] = None,
         check: Optional[bool] = None, max_sms: int = 8, copy_sms: Optional[int] = None,
         **options: Any) -> Communicator:
    """This process's rank of an mpirun job (``mpi_comm`` defaults to ``MPI.COMM_WORLD``).

    ``bootstrap`` replaces MPI for the rendezvous: an object with ``rank``,
    ``world_size``, ``allgather(value) -> list`` (every rank gets all ranks' values in
    rank order), ``barrier()`` and ``close()``, such as ``hoccl.torch.StoreBootstrap``.
    ``device=None`` picks the local rank modulo the visible GPUs.
    """
    call = "init"
    if bootstrap is not None and mpi_comm is not None:
        raise InvalidArgumentError(f"{call}: pass mpi_comm or bootstrap, not both")
    backend = pick_backend(call, backend)
    timeout, check, verify_plans, plan_options = _settings(call, timeout, check, max_sms,
                                                           copy_sms, options)
    if bootstrap is None and mpi_comm is None:
        from mpi4py import MPI
        mpi_comm = MPI.COMM_WORLD
    group = MPIGroup(bootstrap if bootstrap is not None else mpi_comm, timeout)
    if backend == "cuda" and device is None:
        device = group.local_rank() % cuda_device_count()
    handle = open_device(backend, device, max_sms=max_sms)
    handle.copy_sms = copy_sms or default_copy_sms(group.world_size)
    comm = Communicator(rank=group.rank, world_size=group.world_size, device=handle, group=group,
                        options=plan_options, timeout=timeout, check=check,
                        verify_plans=verify_plans)
    identity = (group.host, group.pid, handle.ordinal, handle.export(comm.pad_address))
    everyone = group.allgather(identity)
    pads = []
    for rank, (host, pid, ordinal, pad) in enumerate(everyone):
        if host != group.host:
            raise InvalidArgumentError(f"{call}: rank {rank} runs on host {host}, rank "
                                       f"{group.rank} on {group.host}; hoccl connects the GPUs "
                                       f"of one host (one NVLink domain)")
        pads.append(comm.pad_address if rank == group.rank else handle.import_(pad))
    comm._connect(pads)
    group.barrier()
    log.info("init: rank %d/%d backend %s device %s", group.rank, group.world_size, backend,
             handle.ordinal)
    return comm
