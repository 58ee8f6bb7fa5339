"""The process's UCX context and worker (``inter_host="ucx"``, ``hoccl._hierarchy.ucx``):
whether ucxx loads, which transports the context may use, and which peers can be watched
through their processes instead of UCX's peer-failure mode (``ucx``'s docstring says
why)."""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import re
import sys
import threading
from typing import Any, List, Optional, Tuple

from .._errors import InvalidArgumentError
from .._mailbox import _Process
from ..config import environ

__all__ = ["available", "preload", "usable"]

log = logging.getLogger("hoccl")


def _transports() -> str:
    """The UCX_TLS of hoccl's context: ``HOCCL_UCX_TLS`` less cma, or all but cma."""
    given = environ("HOCCL_UCX_TLS") or "^"
    names = [name for name in given.lstrip("^").split(",") if name and name != "cma"]
    return "^" + ",".join(names + ["cma"]) if given.startswith("^") else ",".join(names)


def available() -> bool:
    """Whether ucxx is installed (nothing is loaded)."""
    return importlib.util.find_spec("ucxx") is not None


def usable() -> bool:
    """Whether ucxx is installed and its libraries load in this process."""
    if not available():
        return False
    try:
        _api()
    except Exception:  # noqa: BLE001 - ImportError, or an OSError from a clashing UCX
        return False
    return True


def preload() -> None:
    """Load UCX's libraries from ucxx's wheels before MPI loads its own (see the module
    docstring); nothing where ucxx is not installed or MPI is loaded already."""
    if "mpi4py.MPI" in sys.modules or not available():
        return
    try:
        _api()
    except Exception as error:  # noqa: BLE001 - only a preference: MPI works either way
        log.info("ucx: ucxx did not load before MPI (%s); inter_host='ucx' is unavailable",
                 error)


def _api() -> Tuple[Any, Any]:
    """(ucxx's low-level API module, its Array wrapper)."""
    # ucxx sets UCX variables that a newer UCX no longer reads: no warning per process
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as api
    from ucxx._lib.arr import Array
    return api, Array


class _Worker:
    """The process's UCX context and worker, shared by every transport (counted)."""

    _lock = threading.Lock()
    _one: Optional["_Worker"] = None

    def __init__(self) -> None:
        api, self.Array = _api()
        self.api = api
        # no cross-memory attach (cma) where hoccl chooses (the module docstring says why);
        # where UCX_TLS chooses, cma may be on: no peer is watched then (``_watchable``)
        self.cma = "UCX_TLS" in os.environ
        config = {} if self.cma else {"TLS": _transports()}
        mode = _progress_mode()
        features = (api.Feature.TAG,) + ((api.Feature.WAKEUP,) if mode == "thread" else ())
        self.context = api.UCXContext(config_dict=config, feature_flags=features)
        self.worker = api.UCXWorker(self.context)
        #: a thread of UCX's own progresses the worker (``HOCCL_UCX_PROGRESS``): the bytes
        #: of a large message move while Python folds or copies elsewhere
        self.threaded = mode != "caller"
        if self.threaded:
            self.worker.start_progress_thread(mode == "polling", _EPOLL_MS)
            atexit.register(self._stop)
        self.address: bytes = self.worker.address.tobytes()
        #: the context has CUDA transports (it can take CUDA memory)
        self.cuda = bool(getattr(self.context, "cuda_support", False))
        #: only endpoints in UCX's peer-failure mode: where UCX_TLS chose (cma may be on)
        self.failure_mode_only = self.cma
        self.users = 0
        #: the next channel this process would give a communicator (agreed at connect)
        self.next_channel = 1

    @classmethod
    def take(cls) -> "_Worker":
        with cls._lock:
            if cls._one is None:
                cls._one = _Worker()
            cls._one.users += 1
            return cls._one

    def release(self) -> None:
        with _Worker._lock:
            self.users -= 1
            # the worker stays for the process: a UCX context torn down and made again
            # costs more than it holds, and requests of an aborted step may still point
            # into it

    def progress(self) -> None:
        """Progress the worker, unless its own thread does (two progressing at once
        contend for its lock)."""
        if not self.threaded:
            self.worker.progress()

    def _stop(self) -> None:
        """Stop the progress thread before the interpreter goes (UCX's objects with it)."""
        if self.threaded:
            self.threaded = False
            self.worker.stop_progress_thread()

    def transports(self) -> List[str]:
        """The UCX transports and devices the context found (``tcp/eth0``, ``posix/memory``,
        ``rc_mlx5/mlx5_0:1``, ``cuda_ipc/cuda``...)."""
        info = self.context.info
        text = info() if callable(info) else str(info)
        return sorted(set(re.findall(r"resource \d+\s*:.*?flags \S*\s+(\S+)", text)))


#: the longest the progress thread sleeps for UCX's events (ms): a wait that no event ends
_EPOLL_MS = 1


#: the fewest cores this process may run on for UCX's own progress thread by default
_THREAD_CORES = 8


def _progress_mode() -> str:
    """Who progresses the worker: "caller" (each wait of hoccl's), "thread" (UCX's own
    thread, woken by the transports' events; hoccl's waits then only look) or "polling"
    (that thread spinning).  By default the thread where this process may run on
    ``_THREAD_CORES`` cores or more, else the caller: on a 2-core machine, two ranks, 64
    MiB, caller / thread / polling: all_reduce 1.28 / 0.67 / 0.45 GB/s, all_gather 1.73 /
    1.06 / 0.76, sendrecv 2.73 / 1.86 / 0.98 (``results/host/2026-12-07-ucx-progress``);
    on a 16-core H100 machine, two GPU ranks and two CPU ranks as two hosts, the thread
    took the all_reduce from 2.53 to 3.14 GB/s at 64 MiB and 2.79 to 3.47 at 256 MiB
    (``results/h100/2026-12-07c``)."""
    mode = environ("HOCCL_UCX_PROGRESS") or ("thread" if _cores() >= _THREAD_CORES
                                             else "caller")
    if mode not in ("caller", "thread", "polling"):
        raise InvalidArgumentError(f"HOCCL_UCX_PROGRESS: expected caller, thread or polling; "
                                   f"got {mode!r}")
    return mode


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _boot_id() -> Optional[str]:
    """This machine's boot id (host names and pid namespaces may repeat across machines:
    the first pid namespace has the same number everywhere), or None."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            return file.read().strip() or None
    except OSError:
        return None


def _watchable(me: Tuple[_Process, Optional[str]], peer: Tuple[_Process, Optional[str]],
               failure_mode_only: bool) -> bool:
    """Whether ``peer``'s process (with its machine's boot id) can be watched from this
    one: the same machine (host name and boot id) and pid namespace, its start time
    readable. Its endpoint can then do without UCX's peer-failure mode and use shared
    memory (``HOCCL_UCX_PEER_FAILURE=all``: never; nor where the context keeps every
    endpoint in the mode: ``_Worker.failure_mode_only``)."""
    if environ("HOCCL_UCX_PEER_FAILURE") == "all" or failure_mode_only:
        return False
    (mine, my_boot), (theirs, their_boot) = me, peer
    return (theirs.host == mine.host and my_boot is not None and their_boot == my_boot
            and theirs.namespace is not None and theirs.namespace == mine.namespace
            and theirs.start is not None)
