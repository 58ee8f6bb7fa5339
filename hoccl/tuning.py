"""Where a communicator's tuning table comes from, and which machine it is for.

At init rank 0 looks for a table of its machine (``machine_of``), in this order:

1. ``HOCCL_TUNING_FILE``: a table the user names (a file that cannot be read or parsed is
   an error; a table of another machine is logged and not used);
2. the cache directory (``$XDG_CACHE_HOME/hoccl/tuning``, else ``~/.cache/hoccl/tuning``),
   where ``python -m hoccl.tune`` writes: the file named for the machine (``table_name``);
3. a table shipped with hoccl (``hoccl/tuning_tables/*.json``) whose machine is this one;

else, on the cuda backend, the cost model's table (``hoccl.sched._path_model``:
conservative constants from the recorded 2 × H200 runs), and on the host backend the
defaults (copy engines, no small-message path); hoccl says which once at INFO.  Rank 0's
table (or its error) goes to every rank, so all plan alike (``hoccl.sched.select``).
Each call's settings then come from the user, else the table's row (a measured table's
or the model's), else the defaults.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from ._errors import InvalidArgumentError
from .config import environ
from .sched._path_model import model_table
from .sched.select import MACHINE_KEYS, Table, TableError

__all__ = ["machine_of", "cache_dir", "table_name", "load_table", "shared_table",
           "SHIPPED"]

log = logging.getLogger("hoccl")

#: the tables shipped with hoccl
SHIPPED = Path(__file__).parent / "tuning_tables"


def machine_of(device: Any, world_size: int, ranks_per_gpu: int) -> Dict[str, Any]:
    """The properties a table is keyed by (``select.MACHINE_KEYS``) of a communicator on
    ``device`` among ``world_size`` ranks, ``ranks_per_gpu`` of them on one GPU."""
    from . import __version__
    backend = device.backend
    if backend == "host":
        gpu, link, links = "host", "host", 0
    else:
        gpu = getattr(device, "model", None) or "unknown"
        link = "shared-gpu" if ranks_per_gpu > 1 else getattr(device, "link", None) or "unknown"
        links = getattr(device, "peers", 0)
    machine = {"backend": backend, "gpu": gpu, "world_size": world_size,
               "ranks_per_gpu": ranks_per_gpu, "link": link, "links": links,
               "driver": getattr(device, "driver", "none"), "hoccl": __version__}
    assert tuple(machine) == MACHINE_KEYS
    return machine


def cache_dir() -> Path:
    """Where ``python -m hoccl.tune`` writes and ``init`` looks for tables."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hoccl" / "tuning"


def table_name(machine: Dict[str, Any]) -> str:
    """The file name of ``machine``'s table in the cache directory."""
    words = [str(machine[key]) for key in MACHINE_KEYS]
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "_".join(words)) + ".json"


def load_table(machine: Dict[str, Any], call: str = "init") -> Tuple[Optional[Table], str]:
    """``machine``'s table and where it came from: a file's path, ``"model"`` (the cost
    model's table) or ``"defaults"`` (none).  A named file (``HOCCL_TUNING_FILE``) that
    cannot be used raises; a table in the cache or shipped that cannot be used is logged
    and passed over."""
    named = environ("HOCCL_TUNING_FILE")
    if named:
        path = Path(named)
        try:
            table = Table.from_json(path.read_text(), str(path))
        except (OSError, TableError) as error:
            raise InvalidArgumentError(f"{call}: HOCCL_TUNING_FILE={named}: {error}") from None
        mismatch = table.mismatch(machine)
        if mismatch is None:
            return table, str(path)
        log.warning("%s: HOCCL_TUNING_FILE=%s is a table of another machine (%s): not used",
                    call, named, mismatch)
        return _unmeasured(machine, call)
    for path in [cache_dir() / table_name(machine)] + sorted(SHIPPED.glob("*.json")):
        if not path.is_file():
            continue
        try:
            table = Table.from_json(path.read_text(), str(path))
        except (OSError, TableError) as error:
            log.warning("%s: the tuning table %s cannot be used (%s): passed over", call,
                        path, error)
            continue
        if table.mismatch(machine) is None:
            return table, str(path)
    return _unmeasured(machine, call)


def _unmeasured(machine: Dict[str, Any], call: str) -> Tuple[Optional[Table], str]:
    """The cost model's table for a machine with no measured one (None: the defaults),
    said once at INFO."""
    table = model_table(machine)
    facts = ", ".join(f"{key}={value}" for key, value in machine.items())
    if table is None:
        log.info("%s: no tuning table for this machine (%s): the defaults stand (copy "
                 "engines, no small-message path); python -m hoccl.tune measures one", call,
                 facts)
        return None, "defaults"
    log.info("%s: no tuning table for this machine (%s): the cost model's table (%s); "
             "python -m hoccl.tune measures one", call, facts, table.note)
    return table, "model"


def shared_table(call: str, rank: int, machine: Dict[str, Any],
                 allgather: Any) -> Tuple[Optional[Table], str]:
    """Rank 0's table, on every rank: rank 0 loads it, ``allgather`` (the bootstrap's)
    hands it round as plain data; an error on rank 0 raises on every rank."""
    verdict: Any = None
    if rank == 0:
        try:
            table, origin = load_table(machine, call)
            verdict = ("table", table.to_dict() if table is not None else None, origin)
        except InvalidArgumentError as error:
            verdict = ("error", str(error), "")
    everyone: Sequence[Any] = allgather(verdict)
    kind, payload, origin = everyone[0]
    if kind == "error":
        raise InvalidArgumentError(payload if rank == 0 else f"{call}: rank 0: {payload}")
    return (Table.from_dict(payload, origin) if payload is not None else None), origin
