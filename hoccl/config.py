"""Every setting of a communicator, in one frozen object: ``hoccl.Config``.

    comm = hoccl.init(kernel_bytes=4096)              # settings as keywords, or
    comm = hoccl.init(config=hoccl.Config(kernel_bytes=4096, max_sms=16))
    comm.config                                       # what the communicator runs with
    comm.set_options(chunk_bytes=64 << 20)            # a new Config for later calls

A setting given to ``init``, ``init_local``, ``split``, ``set_options``,
``hoccl.torch.Options`` or a benchmark's library name (``hoccl+kernel_bytes=4096``) is a
field of ``Config``, checked here and nowhere else.  Where a setting is not given, its
environment variable (``HOCCL_`` and the field's name in capitals: ``HOCCL_TIMEOUT``,
``HOCCL_KERNEL_BYTES``...) is read, once, by ``Config.from_environment``; a ``split``
inherits its parent's settings instead.  ``ENVIRONMENT`` lists every variable hoccl reads,
settings or not, and ``environ`` is the one function that reads them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, FrozenSet, Mapping, Optional, Tuple

from ._errors import InvalidArgumentError
from ._validate import integer, real
from .sched import Options

__all__ = ["Config", "DEFAULT_TIMEOUT", "ENVIRONMENT", "SETTINGS", "ACROSS_HOSTS",
           "INTRA_HOST_ENGINES", "PHASES", "environ", "host_threads", "whole_number",
           "default_copy_sms"]

#: seconds a host wait may take before it raises
DEFAULT_TIMEOUT = 300.0


def default_copy_sms(world_size: int) -> int:
    """SMs for a rank's own block in out-of-place forms (the one same-GPU copy, which
    runs beside the peers' copy-engine transfers): enough to finish within them, so the
    own block never sets the call's time.  The copy-engine time grows with the number of
    peers while the own block does not, so the share shrinks: 16 / (n - 1), at least 2
    (docs/design-notes.md)."""
    return max(2, -(-16 // max(1, world_size - 1)))


_PLANNED = Options()
#: ``intra_host`` values: hoccl's cuda backend, hoccl's host backend, a torch.distributed group
INTRA_HOST_ENGINES = ("cuda", "host", "torch")
#: ``phases`` values
PHASES = ("auto", "pipelined", "sequential")


@dataclass(frozen=True)
class Config:
    """How a communicator moves data and waits: every setting, checked on creation.

    Waiting and checking:

    - ``timeout``: seconds any host wait may take before it raises (a missing peer, a
      call the peers never make); the watchdog aborts work that runs past it.
    - ``verify_plans``: prove every plan with ``hoccl.sched.verify`` before its first use.

    SMs (the only SM work is arithmetic and the one same-GPU copy):

    - ``max_sms``: the most SMs (thread blocks) a reduction kernel takes.
    - ``copy_sms``: the most SMs the same-GPU copy of an out-of-place form's own block
      takes; None: ``default_copy_sms(world_size)``.
    - ``fuse_sums``: a pushed reduction's chunk sums as one launch that waits for each
      chunk on the device, instead of a stream wait and a launch per chunk; None: on,
      unless another rank drives this rank's GPU (the launch would spin through its
      context's time slices while the peer's context waits).

    Plans (``hoccl.sched.Options``):

    - ``copy_lanes``: copy streams per rank (None: one per peer, up to 4).
    - ``chunk_bytes``: the pipeline unit of reductions: the sum of chunk k overlaps the
      copies of chunk k+1.
    - ``self_route``: how an out-of-place form's own block reaches its place: "local" (a
      copy on at most ``copy_sms`` SMs) or "peer" (through a peer's copy engine and back:
      zero SMs, costs link bandwidth).
    - ``one_shot_bytes``: an all_reduce of at most this many bytes runs in one phase
      (every rank pushes its input to every peer and sums all of them); 0: off.
    - ``pull_bytes``: a reduce_scatter, all_reduce or reduce of at most this many input
      bytes sums the peers' inputs where they lie, with no copy before it; 0: off.
    - ``kernel_bytes``: an all_gather, all_to_all, broadcast, reduce_scatter or
      all_reduce whose largest buffer is at most this many bytes runs as one direct
      kernel per rank (stores into the peers' staging rings, no copy engine); 0: off
      (a world of one runs its out-of-place calls up to 4 MiB as one kernel whatever
      this says).
    - ``kernel_sms``: the most SMs a direct kernel takes.

    Across hosts (a ``HierarchicalCommunicator``; a communicator of one host checks these
    and has no use for them):

    - ``intra_host``: the engine inside this rank's host: "cuda" (hoccl's cuda backend),
      "host" (hoccl's host backend) or "torch" (the torch.distributed group of the host's
      ranks: the device library, NCCL or RCCL); None: chosen from what the host has.
      Every rank of a host must give the same; hosts may differ (``HOCCL_INTRA_HOST`` is
      set per host).
    - ``phases``: "pipelined" (the phases of all_reduce, broadcast and reduce overlap chunk
      by chunk, those of all_gather and reduce_scatter host by host, each level on a
      worker of its own), "sequential", or "auto" (pipelined when the call holds at
      least two chunks of ``phase_bytes``).
    - ``phase_bytes``: the chunk of pipelined phases.
    - ``stage_bytes``: the chunk of the staged engine between hosts: the device-to-host
      copy of chunk k+1 overlaps the transfer of chunk k.
    """
    timeout: float = DEFAULT_TIMEOUT
    verify_plans: bool = False
    max_sms: int = 8
    copy_sms: Optional[int] = None
    fuse_sums: Optional[bool] = None
    # the planning settings, with the scheduler's defaults (``Options``, checked there)
    copy_lanes: Optional[int] = _PLANNED.copy_lanes
    chunk_bytes: int = _PLANNED.chunk_bytes
    self_route: str = _PLANNED.self_route
    one_shot_bytes: int = _PLANNED.one_shot_bytes
    pull_bytes: int = _PLANNED.pull_bytes
    kernel_bytes: int = _PLANNED.kernel_bytes
    kernel_sms: int = _PLANNED.kernel_sms
    intra_host: Optional[str] = None
    phases: str = "auto"
    phase_bytes: int = 64 << 20
    stage_bytes: int = 16 << 20
    #: the settings the user gave (keywords, ``HOCCL_<NAME>``, or a ``Config`` made with
    #: them, where they differ from the defaults): they override a tuning table's choice;
    #: every other planning setting is the table's to choose (``hoccl.sched.select``)
    given: FrozenSet[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        _check(self)
        if not self.given:
            object.__setattr__(self, "given", frozenset(
                name for name in SETTINGS if getattr(self, name) != _DEFAULTS[name]))
        elif not self.given <= set(SETTINGS):
            raise InvalidArgumentError(f"given must name settings of {list(SETTINGS)}; got "
                                       f"{sorted(self.given)}")

    # -- making one ------------------------------------------------------------------
    @classmethod
    def make(cls, call: str, base: Optional["Config"] = None,
             changes: Optional[Mapping[str, Any]] = None) -> "Config":
        """``base`` (default: the defaults) with ``changes``; an unknown name or a bad
        value raises ``InvalidArgumentError`` naming ``call``."""
        changes = dict(changes or {})
        unknown = sorted(set(changes) - set(SETTINGS))
        if unknown:
            raise InvalidArgumentError(f"{call}: unknown settings {unknown}; expected any of "
                                       f"{list(SETTINGS)}")
        base = base if base is not None else cls()
        try:
            made = dataclasses.replace(base, **changes)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{call}: {error}") from None
        object.__setattr__(made, "given", base.given | frozenset(changes))
        return made

    @classmethod
    def from_environment(cls, call: str, given: Optional[Mapping[str, Any]] = None,
                         base: Optional["Config"] = None) -> "Config":
        """The settings ``given``; each one not given from its ``HOCCL_*`` variable where
        that is set; the rest from ``base`` (default: the defaults)."""
        given = {name: value for name, value in (given or {}).items() if value is not None}
        found: Dict[str, Any] = {}
        for name in SETTINGS:
            if name in given:
                continue
            variable = "HOCCL_" + name.upper()
            text = environ(variable)
            if text is not None and text != "":
                found[name] = _parse(call, variable, name, text)
        return cls.make(call, base, {**found, **given})

    def replace(self, call: str = "Config.replace", **changes: Any) -> "Config":
        """This config with ``changes`` (checked; errors name ``call``)."""
        return Config.make(call, self, changes)

    # -- what the parts take ---------------------------------------------------------
    @property
    def plan_options(self) -> Options:
        """The planning settings, as the scheduler takes them."""
        return Options(**{name: getattr(self, name) for name in _PLAN})

    def settings(self) -> Dict[str, Any]:
        """Every setting by name (what ``init`` would take to make this config)."""
        return {name: getattr(self, name) for name in SETTINGS}


#: every setting's name, in ``Config``'s order
SETTINGS: Tuple[str, ...] = tuple(field.name for field in fields(Config) if field.name != "given")
_PLAN = tuple(field.name for field in fields(Options))
assert set(_PLAN) <= set(SETTINGS), "every planning option is a setting"
#: the settings only a communicator across hosts uses
ACROSS_HOSTS: Tuple[str, ...] = ("intra_host", "phases", "phase_bytes", "stage_bytes")

#: every environment variable hoccl reads: the settings' (``HOCCL_<NAME>``) and these
ENVIRONMENT: Dict[str, str] = {
    **{"HOCCL_" + name.upper(): f"the {name} setting where it is not given (Config)"
       for name in SETTINGS},
    "HOCCL_DEBUG": "INFO, DEBUG or WARNING: hoccl's logger prints at that level to stderr",
    "HOCCL_LOCAL_SIZE": "ranks per (simulated) host for init's host grouping",
    "HOCCL_NCCL_BINDING": "'torch': the inter-host NCCL engine uses torch.distributed, "
                          "not nccl4py",
    "HOCCL_SPLIT_CUDA": "1: allow split_local of GPU communicators",
    "HOCCL_LANE_PRIORITY": "'normal': copy lanes at the default stream priority, not the "
                           "highest",
    "HOCCL_HOST_JITTER": "host backend, for tests: at most this many seconds of sleep "
                         "before each item of a host stream",
    "HOCCL_HOST_QUEUES": "host backend, for tests: the streams of a rank share this many "
                         "in-order workers, as a GPU's streams share its hardware queues "
                         "(CUDA_DEVICE_MAX_CONNECTIONS); 0: a worker each",
    "HOCCL_HOST_CHECK_SIGNALS": "host backend, for tests: 1 checks that no signal lowers "
                                "its word",
    "HOCCL_HOST_THREADS": "the most threads a host fold or copy of many MiB is split over "
                          "(host backend, host folds across hosts); default: 4, or fewer "
                          "where the process may run on fewer cores (1 when bound to one)",
    "HOCCL_TUNING_FILE": "a tuning table to load at init",
    "HOCCL_CROSS_MEMORY": "0: the staged engine between members on one machine moves "
                          "bytes through MPI, not by cross-memory reads",
    "HOCCL_UCX_DEVICE_MEMORY": "1: inter_host='ucx' hands CUDA arrays to UCX as they are, "
                               "not staged through pinned host memory (for GPU peers: "
                               "beside a host-memory peer it is 28x slower)",
    "HOCCL_SINGLE_MEMOPS": "the cuda backend: the most stream memory operations one step "
                           "issues as single driver calls, more going as one batch of kept "
                           "parameters (default 8; 1: two or more are one batch)",
    "HOCCL_UCX_TLS": "inter_host='ucx': the transports of hoccl's UCX context, as UCX_TLS "
                     "reads them, cross-memory attach always excluded (default: all but cma); "
                     "UCX_TLS itself overrides it",
    "HOCCL_UCX_PEER_FAILURE": "all: inter_host='ucx' puts every endpoint in UCX's "
                              "peer-failure mode, also to peers on the same machine (which "
                              "then talk over TCP, not shared memory)",
    "HOCCL_UCX_PROGRESS": "inter_host='ucx': who progresses UCX's worker: 'caller' "
                          "(hoccl's waits), 'thread' (a thread of UCX's own, woken by the "
                          "transports' events) or 'polling' (that thread spinning); "
                          "default: 'thread' where the process may run on 8 cores or more, "
                          "else 'caller'",
}


def environ(variable: str) -> Optional[str]:
    """The value of one of hoccl's environment variables (``ENVIRONMENT``), or None."""
    assert variable in ENVIRONMENT, f"{variable} is not in hoccl.config.ENVIRONMENT"
    return os.environ.get(variable)


@functools.lru_cache(maxsize=None)
def host_threads() -> int:
    """``HOCCL_HOST_THREADS``, read once: the most threads a fold or a copy of many MiB of
    host memory is split over (``hoccl._dtypes.reduce_into``, the host backend's moves).
    Default: 4, or the number of cores this process may run on where that is fewer: a
    rank that mpirun binds to one core gets no helper threads."""
    threads = whole_number("HOCCL_HOST_THREADS", 1, "host_threads",
                           "the threads a large host fold or copy is split over")
    return min(4, len(os.sched_getaffinity(0))) if threads is None else threads


def whole_number(variable: str, least: int, call: str, meaning: str) -> Optional[int]:
    """The whole number in one of hoccl's environment variables, at least ``least``; None
    where it is unset or blank. Anything else raises, naming ``call``, the variable, what
    it means and what it holds."""
    text = environ(variable)
    if text is None or not text.strip():
        return None
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        expected = "a positive int" if least == 1 else f"an int >= {least}"
        raise InvalidArgumentError(f"{call}: {variable} must be {expected} ({meaning}); got "
                                   f"{text!r}")
    return value


def _parse(call: str, variable: str, name: str, text: str) -> Any:
    """A setting's value from its variable's text: a number (sizes may end in K, M or G),
    a switch (1/0, true/false, on/off) or a word, by the field's default."""
    default = _DEFAULTS[name]
    lowered = text.strip().lower()
    if name in ("verify_plans", "fuse_sums"):
        if lowered in ("1", "true", "on", "yes"):
            return True
        if lowered in ("0", "false", "off", "no"):
            return False
        raise InvalidArgumentError(f"{call}: {variable} must be 1 or 0; got {text!r}")
    if name in ("self_route", "phases"):
        return lowered
    if name == "intra_host":
        return None if lowered == "auto" else lowered
    try:
        if name == "timeout":
            return float(lowered)
        scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(lowered[-1:], 1)
        return int(lowered[:-1] if scale > 1 else lowered) * scale
    except ValueError:
        kind = "a number of seconds" if name == "timeout" else "an int (K, M, G allowed)"
        raise InvalidArgumentError(f"{call}: {variable} must be {kind}; got {text!r} "
                                   f"(default {default!r})") from None


_DEFAULTS = {field.name: field.default for field in fields(Config) if field.name != "given"}


#: the settings that are counts (of bytes, SMs, lanes): numpy's integers and 0-dim torch
#: tensors given for them become ints before they are checked
_COUNTS = ("max_sms", "copy_sms", "copy_lanes", "chunk_bytes", "one_shot_bytes", "pull_bytes",
           "kernel_bytes", "kernel_sms", "phase_bytes", "stage_bytes")


def _check(config: Config) -> None:
    """Every field's type and range; the planning fields as ``Options`` checks them."""
    for name in _COUNTS:
        number = integer(getattr(config, name))
        if number is not None:
            object.__setattr__(config, name, number)
    timeout = real(config.timeout)
    if timeout is None or not timeout > 0:
        raise InvalidArgumentError(f"timeout must be a positive number of seconds; "
                                   f"got {config.timeout!r}")
    object.__setattr__(config, "timeout", timeout)
    if config.verify_plans not in (True, False, 0, 1) or type(config.verify_plans) not in (bool, int):
        raise InvalidArgumentError(f"verify_plans must be True or False; got "
                                   f"{config.verify_plans!r}")
    object.__setattr__(config, "verify_plans", bool(config.verify_plans))
    if not _positive_int(config.max_sms):
        raise InvalidArgumentError(f"max_sms must be a positive int; got {config.max_sms!r}")
    if config.copy_sms is not None and not _positive_int(config.copy_sms):
        raise InvalidArgumentError(f"copy_sms must be a positive int or None; got "
                                   f"{config.copy_sms!r}")
    fuse = config.fuse_sums
    if fuse is not None:
        if not (fuse is True or fuse is False or (type(fuse) is int and fuse in (0, 1))):
            raise InvalidArgumentError(f"fuse_sums must be True or False (or 1 or 0) or "
                                       f"None; got {fuse!r}")
        object.__setattr__(config, "fuse_sums", bool(fuse))
    if config.intra_host is not None and config.intra_host not in INTRA_HOST_ENGINES:
        raise InvalidArgumentError(f"intra_host must be one of {INTRA_HOST_ENGINES} or None; "
                                   f"got {config.intra_host!r}")
    if config.phases not in PHASES:
        raise InvalidArgumentError(f"phases must be one of {PHASES}; got {config.phases!r}")
    for name in ("phase_bytes", "stage_bytes"):
        if not _positive_int(getattr(config, name)):
            raise InvalidArgumentError(f"{name} must be a positive int; got "
                                       f"{getattr(config, name)!r}")
    config.plan_options  # noqa: B018 - Options checks the planning fields itself


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
