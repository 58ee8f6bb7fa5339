"""torch's rendezvous variables from the launcher's: one script under torchrun, mpirun and srun.

``init_process_group`` (``env://``) reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
and training scripts read LOCAL_RANK (and LOCAL_WORLD_SIZE); torchrun sets them all.
``fill_rendezvous_env()`` sets the unset ones from the launcher's own variables::

    launcher            rank / size / local rank / local size
    Open MPI            OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
    MPICH, Intel MPI    PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
    PMIx                PMIX_RANK (the size through MPI)
    srun                SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), SLURM_LOCALID,
                        SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID

and MASTER_ADDR / MASTER_PORT: under an MPI launcher with mpi4py installed, agreed
through MPI (rank 0's host name and a port free there, broadcast to every rank: MPI is
initialised then, and stays so); else, under srun, the first host of
SLURM_STEP_NODELIST (or SLURM_NODELIST) and a port derived from SLURM_JOB_ID and
SLURM_STEP_ID (``slurm_port``).

Variables already set win.  When RANK is set (torchrun, or by hand) nothing is filled:
the rendezvous is whoever set it.  srun is recognised by SLURM_PROCID with SLURM_STEP_ID
(the tasks of a step; a batch script's own process is not one), and MPI's variables
come first (mpirun inside an sbatch script inherits the batch step's SLURM_PROCID=0).

``plan_rendezvous`` decides, without side effects; ``fill_rendezvous_env`` applies it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, MutableMapping, NamedTuple, Optional, Tuple

__all__ = ["RendezvousPlan", "plan_rendezvous", "fill_rendezvous_env", "expand_nodelist",
           "slurm_port", "tasks_per_node"]

log = logging.getLogger("hoccl")

#: the variables torch's env:// rendezvous and training scripts read
VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT")
#: the ports ``slurm_port`` picks from (below Linux's ephemeral range, 32768 on)
SLURM_PORTS = range(15000, 30000)


class _Launcher(NamedTuple):
    name: str
    rank: str
    size: Optional[str]
    local_rank: Optional[str]
    local_size: Optional[str]
    mpi: bool  # its processes are MPI ranks (MPI can agree on an address)


_LAUNCHERS = (
    _Launcher("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
              "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", True),
    _Launcher("MPICH", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", True),
    _Launcher("PMIx", "PMIX_RANK", None, None, None, True),
)


@dataclass(frozen=True)
class RendezvousPlan:
    """What ``fill_rendezvous_env`` does for an environment.

    ``launcher``: the launcher found ("Open MPI", "MPICH", "PMIx", "srun"), or None
    (torchrun, RANK set by hand, or no launcher).  ``values``: the variables to set, each
    unset before.  ``through_mpi``: the unset variables that MPI agrees on (MASTER_ADDR,
    MASTER_PORT; WORLD_SIZE under PMIx), empty when MPI is not needed."""
    launcher: Optional[str] = None
    values: Mapping[str, str] = field(default_factory=dict)
    through_mpi: Tuple[str, ...] = ()


def plan_rendezvous(environ: Mapping[str, str], mpi4py: Optional[bool] = None) -> RendezvousPlan:
    """The rendezvous variables ``environ`` lacks and where each comes from (no side
    effects).  ``mpi4py``: whether mpi4py can be imported (None: look)."""
    if "RANK" in environ:
        return RendezvousPlan()
    found = _from_mpi(environ) or _from_slurm(environ)
    if found is None:
        return RendezvousPlan()
    launcher, found_values, is_mpi = found
    values = {name: value for name, value in found_values.items()
              if value is not None and name not in environ}
    missing = [name for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if name not in environ and name not in values]
    if is_mpi and missing:
        if mpi4py is None:
            mpi4py = importlib.util.find_spec("mpi4py") is not None
        if mpi4py:
            return RendezvousPlan(launcher, values, tuple(missing))
    slurm = _slurm_address(environ)
    if slurm is not None:
        values.update({name: value for name, value in slurm.items() if name in missing})
    return RendezvousPlan(launcher, values)


def fill_rendezvous_env(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Set torch's unset rendezvous variables (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) in ``environ`` (default ``os.environ``)
    from mpirun's, mpiexec's or srun's; returns what it set.  ``import hoccl.torch``
    calls it, so that ``dist.init_process_group("hoccl")`` (env://) runs unchanged under
    torchrun, mpirun and srun.

    Collective when MPI agrees on MASTER_ADDR and MASTER_PORT (an MPI launcher, neither
    set, mpi4py installed): every rank must call it (import hoccl.torch) at its start;
    it initialises MPI, which stays initialised for the program (mpi4py finalises it at
    exit)."""
    environ = os.environ if environ is None else environ
    plan = plan_rendezvous(environ)
    values = dict(plan.values)
    if plan.through_mpi:
        agreed = _agree_through_mpi(plan.launcher, int(environ.get(
            _launcher(plan.launcher).rank, "-1")))
        values.update({name: agreed[name] for name in plan.through_mpi})
    environ.update(values)
    if values:
        log.info("hoccl.torch: %s from %s", " ".join(f"{name}={value}" for name, value
                                                    in sorted(values.items())), plan.launcher)
    return values


def _launcher(name: Optional[str]) -> _Launcher:
    return next(launcher for launcher in _LAUNCHERS if launcher.name == name)


def _from_mpi(environ: Mapping[str, str]) -> Optional[Tuple[str, Dict[str, Optional[str]], bool]]:
    for launcher in _LAUNCHERS:
        if launcher.rank in environ:
            values = {"RANK": environ[launcher.rank]}
            for name, source in (("WORLD_SIZE", launcher.size),
                                 ("LOCAL_RANK", launcher.local_rank),
                                 ("LOCAL_WORLD_SIZE", launcher.local_size)):
                if source is not None and source in environ:
                    values[name] = environ[source]
            return launcher.name, dict(values), True
    return None


def _from_slurm(environ: Mapping[str, str]) -> Optional[Tuple[str, Dict[str, Optional[str]], bool]]:
    if "SLURM_PROCID" not in environ or "SLURM_STEP_ID" not in environ:
        return None
    size = environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS"))
    local_size = None
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE"))
    if per_node and "SLURM_NODEID" in environ:
        counts = tasks_per_node(per_node)
        node = int(environ["SLURM_NODEID"])
        if node < len(counts):
            local_size = str(counts[node])
    return "srun", {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": size,
                    "LOCAL_RANK": environ.get("SLURM_LOCALID"),
                    "LOCAL_WORLD_SIZE": local_size}, False


def _slurm_address(environ: Mapping[str, str]) -> Optional[Dict[str, str]]:
    """MASTER_ADDR and MASTER_PORT of an srun step: the step's first host, a port from
    the job and step ids; None outside one."""
    nodelist = environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_NODELIST"))
    job = environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID"))
    if not nodelist or not job or "SLURM_STEP_ID" not in environ:
        return None
    return {"MASTER_ADDR": expand_nodelist(nodelist)[0],
            "MASTER_PORT": str(slurm_port(int(job), int(environ["SLURM_STEP_ID"])))}


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """The MASTER_PORT of an srun step: the same on every task of the step, different for
    the steps of a job and for jobs whose ids are close (set MASTER_PORT to choose)."""
    return SLURM_PORTS.start + (job_id * 97 + step_id) % len(SLURM_PORTS)


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_nodelist(nodelist: str) -> List[str]:
    """Slurm's compressed host list as host names, in order: ``"node[01-03,07],login"``
    is node01, node02, node03, node07, login (zero padding kept; several bracket groups
    in one name multiply out).  python-hostlist expands it (``pip install
    'hoccl[slurm]'``); without it, SLURM's own ``scontrol show hostnames`` does."""
    try:
        import hostlist
    except ImportError:
        hosts = _scontrol_hostnames(nodelist)
    else:
        try:
            hosts = hostlist.expand_hostlist(nodelist, allow_duplicates=True)
        except hostlist.BadHostlist as error:
            raise ValueError(f"expand_nodelist: {nodelist!r} is not a Slurm host list "
                             f"({error})") from None
    if not hosts:
        raise ValueError(f"expand_nodelist: no host in {nodelist!r}")
    return hosts


def _scontrol_hostnames(nodelist: str) -> List[str]:
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise RuntimeError(f"expand_nodelist: expanding {nodelist!r} needs python-hostlist "
                           f"(pip install 'hoccl[slurm]') or Slurm's scontrol on PATH")
    result = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                            text=True, timeout=30)
    if result.returncode != 0:
        raise ValueError(f"expand_nodelist: scontrol refused {nodelist!r}: "
                         f"{result.stderr.strip()}")
    return result.stdout.split()


def tasks_per_node(text: str) -> List[int]:
    """SLURM_TASKS_PER_NODE as one count per node: ``"2(x3),1"`` is 2, 2, 2, 1."""
    counts: List[int] = []
    for part in text.split(","):
        match = _TASKS.match(part.strip())
        if match is None:
            raise ValueError(f"tasks_per_node: {part!r} in {text!r} is not N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _agree_through_mpi(launcher: Optional[str], rank: int) -> Dict[str, str]:
    """Rank 0's host name and a port free there, and the world size, from MPI
    (initialising it: this is collective over MPI_COMM_WORLD)."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if rank >= 0 and world.Get_rank() != rank:
        raise RuntimeError(f"fill_rendezvous_env: {launcher}'s rank variable says rank {rank} "
                           f"but MPI_COMM_WORLD says {world.Get_rank()}")
    address = None
    if world.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            address = (socket.gethostname(), probe.getsockname()[1])
    host, port = world.bcast(address, root=0)
    return {"MASTER_ADDR": host, "MASTER_PORT": str(port), "WORLD_SIZE": str(world.Get_size())}
