"""What each host has and which engine runs inside it.

At init every rank reports (hostname, device kind, engine inside its host, hoccl
backend, the engine's label) in one allgather over the bootstrap; the ranks of a host
must agree.  The engine inside a host is the ``intra_host`` setting (``HOCCL_INTRA_HOST``,
set per host) or else chosen from what the host has:

* "cuda": hoccl's cuda backend (NVIDIA GPUs; zero SMs for data);
* "torch": the torch.distributed group of the host's ranks, torch's device library
  (ProcessGroupNCCL; RCCL in ROCm builds of torch), chosen where torch sees GPUs that
  hoccl has no backend for (AMD);
* "host": hoccl's host backend (CPU-only hosts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._errors import InvalidArgumentError
from ..sched.hierarchical import Topology

__all__ = ["HostReport", "SHARED_SETTINGS", "intra_host_engine", "backend_for", "local_report", "agree",
           "refusal"]


@dataclass(frozen=True)
class HostReport:
    """One rank's report at init."""
    hostname: str
    device: str      #: where the rank's data lives: "cuda", "rocm" or "cpu"
    engine: str      #: the engine inside its host: "cuda", "host" or "torch"
    backend: str     #: hoccl's backend on the rank: "cuda" or "host"
    label: str       #: the engine as ``describe()`` names it
    #: the settings every rank must share (their plans and chunks follow from them)
    shared: Tuple[Tuple[str, Any], ...] = ()
    #: the primitives the engine's library cannot run, with why (found after the report)
    lacks: Tuple[Tuple[str, str], ...] = ()

    def describe(self, host: int, ranks: Sequence[int]) -> Dict[str, Any]:
        described = {"host": host, "hostname": self.hostname, "ranks": list(ranks),
                     "device": self.device, "engine": self.label}
        if self.lacks:
            described["lacks"] = [primitive for primitive, _ in self.lacks]
        return described


def _torch_accelerator() -> Optional[str]:
    """"rocm" or "cuda" where an imported-able torch sees GPUs, else None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def backend_for(call: str, intra_host: Optional[str], backend: Optional[str]) -> Optional[str]:
    """The hoccl backend ``init`` asks for, given the ``intra_host`` setting: "cuda" and
    "host" name it; "torch" and None leave ``backend`` (None: pick)."""
    if intra_host in ("cuda", "host"):
        if backend is not None and backend != intra_host:
            raise InvalidArgumentError(f"{call}: intra_host={intra_host!r} runs hoccl's "
                                       f"{intra_host} backend inside the host, but "
                                       f"backend={backend!r} was given")
        return intra_host
    return backend


def intra_host_engine(intra_host: Optional[str], backend: str) -> str:
    """The engine inside this rank's host: the setting, else hoccl's backend, or torch's
    device library where torch sees GPUs that hoccl does not."""
    if intra_host is not None:
        return intra_host
    if backend == "host" and _torch_accelerator() == "rocm":
        return "torch"
    return backend


#: the settings that shape the steps of a call across hosts: every rank must share them
SHARED_SETTINGS = ("phases", "phase_bytes", "stage_bytes")
#: ``pull_bytes`` of hoccl's host backend inside a host: every reduction pulls
HOST_PULL_BYTES = 1 << 50


def host_config(config: Any, backend: str) -> Any:
    """The settings of this rank's hoccl communicators inside a hierarchy: on the host
    backend a reduction sums the peers' inputs where they lie (``pull_bytes``), unless
    the user set ``pull_bytes``.  A CPU has no copy engine: pushing a peer's block into
    scratch before the sum is one more pass over memory, and where the peers map each
    other's memory (``hoccl.host_empty``) the pulled sum reads it with plain loads, one
    pass fewer."""
    if backend != "host" or "pull_bytes" in config.given:
        return config
    return config.replace("init", pull_bytes=HOST_PULL_BYTES)


def local_report(hostname: str, engine: str, backend: str,
                 shared: Tuple[Tuple[str, Any], ...] = ()) -> HostReport:
    """This rank's report (the torch engine's label names its default group's backend)."""
    if engine == "torch":
        accelerator = _torch_accelerator()
        # hoccl's backend says where the rank's arrays are, except on GPUs hoccl lacks
        on_gpu = accelerator == "rocm" or (accelerator == "cuda" and backend == "cuda")
        device = accelerator if on_gpu and accelerator is not None else "cpu"
        import torch.distributed as dist
        label = (f"torch ({dist.get_backend()})" if dist.is_available() and dist.is_initialized()
                 else "torch (not initialised)")
        return HostReport(hostname, device, engine, backend, label, shared)
    return HostReport(hostname, "cuda" if backend == "cuda" else "cpu", engine, backend,
                      f"hoccl ({backend})", shared)


def agree(call: str, reports: List[HostReport], topology: Topology) -> List[HostReport]:
    """Every host's report (the ranks of a host must report the same engine and device
    kind, and every rank the same ``shared`` settings: a call's chunks follow from them,
    and ranks that cut it differently would wait for each other), in host order."""
    for rank, report in enumerate(reports):
        if report.shared != reports[0].shared:
            differ = sorted(name for (name, mine), (_, theirs)
                            in zip(reports[0].shared, report.shared) if mine != theirs)
            raise InvalidArgumentError(
                f"{call}: every rank must have the same {list(SHARED_SETTINGS)}; rank 0 has "
                f"{dict(reports[0].shared)}, rank {rank} {dict(report.shared)} (differ: "
                f"{differ})")
    hosts = []
    for host, ranks in enumerate(topology.groups("host")):
        first = reports[ranks[0]]
        for rank in ranks[1:]:
            theirs = reports[rank]
            if (theirs.engine, theirs.device) != (first.engine, first.device):
                raise InvalidArgumentError(
                    f"{call}: the ranks of host {host} ({first.hostname}) must use one engine "
                    f"inside it; rank {ranks[0]} has {first.label} on {first.device}, rank "
                    f"{rank} {theirs.label} on {theirs.device} (set HOCCL_INTRA_HOST alike "
                    f"on every rank of a host)")
        hosts.append(first)
    return hosts


def refusal(name: str, hosts: Sequence[HostReport], steps: Sequence[Tuple[int, Any]],
            primitives: Dict[str, Any]) -> Optional[str]:
    """Why a call cannot run, or None: ``steps`` are (host, collective) of the call's
    steps inside hosts, ``primitives[engine]`` what a collective runs on that engine
    kind.  Every rank holds the same reports and plan, so every rank finds the same
    answer before any data moves."""
    for host, collective in steps:
        report = hosts[host]
        lacks = dict(report.lacks)
        for primitive in primitives[report.engine](collective):
            if primitive in lacks:
                return (f"{name}: host {host} ({report.hostname}) runs {report.label} inside, on "
                        f"{report.device}, which cannot run {primitive} (its {collective} "
                        f"step): {lacks[primitive]}; refused on every rank before any data "
                        f"moved")
    return None
