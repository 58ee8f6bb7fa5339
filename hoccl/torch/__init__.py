"""PyTorch on hoccl: a torch.distributed backend and FSDP2's custom collectives.

    import hoccl.torch                          # registers the "hoccl" backend
    dist.init_process_group("hoccl")            # code written for NCCL runs on hoccl
    hoccl.torch.use_for_fsdp(model, group)      # FSDP2's all-gathers into registered memory
                                                # (on any default group: NCCL's too)

Importing this module needs torch (``import hoccl`` never imports it).  The backend
bootstraps from torch's store (no MPI needed); each group, ``new_group`` and DeviceMesh
dimension included, is a hoccl Communicator of its own.  An installed hoccl registers
the backend at ``import torch`` already (``hoccl_autoload``).

Importing it also fills torch's unset rendezvous variables (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from mpirun's, mpiexec's or
srun's (``fill_rendezvous_env``), so that one script runs unchanged under torchrun,
mpirun and srun.  Under an MPI launcher with neither MASTER_ADDR nor MASTER_PORT set
and mpi4py installed, that import initialises MPI (collective: every rank imports it)
to agree on them.  Nothing is filled where RANK is set, nor once torch.distributed is
initialised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping, Optional, Tuple

try:
    import torch
    import torch.distributed as dist
except ImportError as error:  # pragma: no cover - exercised only without torch
    raise ImportError("hoccl.torch needs PyTorch (>= 2.11): pip install 'hoccl[torch]'") from error

import hoccl

from hoccl_autoload._backend import BACKEND, is_creating, register

from .. import InvalidArgumentError
from .._hierarchy import INTER_HOST_ENGINES
from .._hierarchy.topology import simulated_local_size
from ..config import SETTINGS, Config
from ._bootstrap import StoreBootstrap
from ._fsdp import AllGather, FSDPHooks, ReduceScatter, use_for_fsdp
from ._launchers import fill_rendezvous_env
from ._mixed import is_mixed, library_group, making_library_groups, needs_torch_groups
from ._pool import RegisteredPool
from ._process_group import ProcessGroupHoccl
from ._shrinking import use_python_groups
from ._work import Work

__all__ = ["Options", "ProcessGroupHoccl", "StoreBootstrap", "AllGather", "ReduceScatter",
           "Work", "use_for_fsdp", "FSDPHooks", "RegisteredPool", "communicator", "empty",
           "fill_rendezvous_env", "BACKEND"]

#: the ``hoccl.Config`` settings a group's options may give (the timeout is torch's)
_SETTINGS = tuple(name for name in SETTINGS if name != "timeout")


@dataclass(frozen=True)
class Options:
    """``pg_options`` of ``init_process_group("hoccl", ...)``, ``new_group`` or a DeviceMesh
    ``backend_override``: how the group's hoccl Communicator is made.

    ``backend``: "cuda" or "host" (None: cuda when a GPU is visible).  ``inter_host``:
    the engine between hosts when the group spans several (``hoccl.init``'s; None: picked
    from the hosts).  ``device``: the
    CUDA ordinal (None: torch's current device when one was set, else the default
    group's, else the local rank modulo the visible GPUs).  ``settings``: fields of
    ``hoccl.Config`` (every one but the timeout, which is torch's: ``timeout``), checked
    here; ``config``: a whole ``hoccl.Config`` that ``settings`` then change."""
    backend: Optional[str] = None
    device: Optional[int] = None
    inter_host: Optional[str] = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    timeout: Optional[timedelta] = None
    config: Optional[Config] = None

    def __post_init__(self) -> None:
        if self.backend not in (None, "cuda", "host"):
            raise InvalidArgumentError(f"Options: backend must be 'cuda', 'host' or None; got "
                                       f"{self.backend!r}")
        if self.inter_host not in (None,) + INTER_HOST_ENGINES:
            raise InvalidArgumentError(f"Options: inter_host must be one of "
                                       f"{INTER_HOST_ENGINES} or None; got "
                                       f"{self.inter_host!r}")
        unknown = sorted(set(self.settings) - set(_SETTINGS))
        if unknown:
            raise InvalidArgumentError(f"Options: unknown settings {unknown}; expected any of "
                                       f"{list(_SETTINGS)}")
        if self.config is not None and not isinstance(self.config, Config):
            raise InvalidArgumentError(f"Options: config must be a hoccl.Config; got "
                                       f"{type(self.config).__name__}")
        Config.make("Options", self.config, self.settings)  # every value checked now

    @property
    def _timeout(self) -> Optional[timedelta]:
        """What DeviceMesh reads from a backend's options."""
        return self.timeout


def communicator(group: Any = None) -> Any:
    """The hoccl Communicator of a hoccl process group (default: the default group)."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(group, ProcessGroupHoccl):
        raise InvalidArgumentError(f"communicator: {type(group).__name__} is not a hoccl "
                                   f"process group")
    return group.communicator


def empty(*size: Any, dtype: torch.dtype = torch.float32, group: Any = None) -> torch.Tensor:
    """A tensor registered with a hoccl process group's communicator (``hoccl.empty``;
    collective: every rank of the group, in the same order).  Collectives of that group
    on tensors carved from it at the same offsets on every rank go without a descriptor
    exchange (see "Registered buffers" in docs/guide.md).  Freed by
    ``communicator(group).deregister(tensor)``."""
    comm = communicator(group)
    shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
    return hoccl.empty(shape, str(dtype).replace("torch.", ""), comm, framework="torch")


def _device(options: Options) -> Optional[int]:
    """The GPU of a new group's communicator: ``options.device``; else torch's current
    device when one other than 0 was set (0 may be merely the default); else the GPU of
    the default group's communicator (a sub-group's ranks keep their GPUs); else None,
    and hoccl takes the local rank modulo the visible GPUs."""
    if options.device is not None:
        return options.device
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        current = torch.cuda.current_device()
        if current != 0:
            return current
    if dist.is_initialized():
        default = dist.distributed_c10d._get_default_group()
        if isinstance(default, ProcessGroupHoccl) and default.connected:
            return default.communicator.device
    return None


def _create(backend_options: Any, pg_options: Any) -> Any:
    """torch.distributed's creator (extended API): one Communicator per group, bootstrapped
    through the group's store; a gloo group beside it for CPU tensors when it is on a GPU
    (not in a job whose hosts differ).  The default group of a job whose hosts run torch
    groups connects at its first call, and groups made while it does are the device
    library's (see hoccl.torch._mixed)."""
    options = pg_options if pg_options is not None else Options()
    if not isinstance(options, Options):
        raise InvalidArgumentError(f"init_process_group: pg_options of the hoccl backend must "
                                   f"be hoccl.torch.Options; got {type(options).__name__}")
    store = backend_options.store
    rank, world_size = backend_options.group_rank, backend_options.group_size
    timeout = backend_options.timeout
    if making_library_groups():
        return library_group(store, rank, world_size, timeout)

    # a sub-group's simulated hosts are those of its ranks in the world (HOCCL_LOCAL_SIZE)
    local_size = simulated_local_size(
        "new_group", list(getattr(backend_options, "global_ranks_in_group", None) or []))

    def connect() -> Tuple[Any, Any]:
        comm = hoccl.init(backend=options.backend,
                          bootstrap=StoreBootstrap(store, rank, world_size),
                          device=_device(options), timeout=timeout.total_seconds() or None,
                          inter_host=options.inter_host, config=options.config,
                          local_size=local_size, **dict(options.settings))
        cpu_group = None
        if comm.backend == "cuda" and not (isinstance(comm, hoccl.HierarchicalCommunicator)
                                           and is_mixed(comm)):
            from torch.distributed import ProcessGroupGloo
            cpu_group = ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size,
                                         timeout)
        return comm, cpu_group
    config = Config.from_environment("init_process_group", dict(options.settings),
                                     options.config)
    if not dist.is_initialized() and needs_torch_groups(
            store, rank, world_size, config.intra_host, options.inter_host):
        return ProcessGroupHoccl(store=store, connect=connect, rank=rank, world_size=world_size)
    return ProcessGroupHoccl(*connect(), store)


register(_create)
use_python_groups(ProcessGroupHoccl)
if not is_creating() and not dist.is_initialized():
    fill_rendezvous_env()
