"""Each call's path and settings, from a tuning table measured on the machine (pure).

A call is known by its collective and its size (nccl-tests' size, ``size_of``: the whole
output of all_gather, the whole input of reduce_scatter and all_to_all, the buffer of
all_reduce and broadcast).  A ``Table`` holds, per collective, rows of size ranges, each
naming the **path** to take and the settings to take it with:

=========  ===========================================================================
path       what runs
=========  ===========================================================================
push       copy engines push each block into the peers' buffers or scratch; the
           reductions sum from scratch in chunks of ``chunk_bytes``
pull       a reduction's kernel sums the peers' inputs where they lie (``pull_bytes``)
one_shot   an all_reduce in one phase: every rank pushes its input to every peer
           (``one_shot_bytes``)
direct     one direct kernel per rank, no copy engine (``kernel_bytes``)
=========  ===========================================================================

A row may be narrowed to some calls: ``forms`` ("in", "out"), ``dtypes``, and the call's
traits ``registered`` (its buffers registered), ``captured`` (issued in a CUDA graph
capture) and ``beside_compute`` (issued beside compute: what ``python -m hoccl.tune
--beside-compute`` measures).  A trait a row leaves out (None) applies to every call; a
trait the caller does not know (None) matches every row.  The first row that covers a
call wins, so a table lists its narrower rows first (the tuner writes its beside-compute
rows before the plain ones: a call that does not say whether it runs beside compute
then takes them, one that says it does not passes them over).

``choose`` turns (table, call, the communicator's settings, the names the user gave)
into the ``Options`` the call is planned with, and the reduction kernels' SM cap
(``Choice.max_sms``): a setting the user gave always wins; every setting left unset
comes from the row, else from the defaults.  A table is a machine's: ``Table.machine``
says which (GPU model, world size, ranks per GPU, link type and count, driver, backend,
hoccl's version), and ``Table.mismatch`` tells why a table does not apply.  A machine
with no measured table takes the cost model's table on the cuda backend
(``hoccl.sched._path_model``); else the defaults stand (copy engines, no small-message
path).

Version 2 of the format added the traits and ``max_sms``; a version 1 table reads as
version 2 with rows for every call (it named neither).

Every rank of a communicator chooses from the same table (rank 0's, shared at init), so
ranks still plan alike and a real disagreement is still a ``MismatchError``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import (Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence,
                    Tuple)

from .algorithms import (KERNEL_COLLECTIVES, KERNEL_MAX_RANKS, Options, Shape, kernel_bytes_of,
                         path_of)

__all__ = ["PATHS", "TUNED", "TABLE_FORMAT", "TABLE_VERSION", "Row", "Table", "Choice",
           "TableError", "choose", "candidates", "size_of", "path_options", "rows_from",
           "TRAITS", "ANY_SIZE"]

TABLE_FORMAT = "hoccl-tuning"
TABLE_VERSION = 2
#: the versions this hoccl reads (1: before ``TRAITS`` and ``max_sms``)
_READABLE = (1, 2)
PATHS = ("push", "pull", "one_shot", "direct")
#: the settings a row may give besides its path (``max_sms``: the reduction kernels' SM
#: cap, a setting of the communicator rather than of the plan: ``Choice.max_sms``)
TUNED = ("chunk_bytes", "copy_lanes", "kernel_sms", "self_route", "max_sms")
#: what a call is besides its shape, which a row may be narrowed to
TRAITS = ("registered", "captured", "beside_compute")
#: the largest size: the last row of a sweep that reached its largest size runs on to it
ANY_SIZE = 1 << 62
#: a call none of whose traits is known
_UNKNOWN: Mapping[str, Optional[bool]] = MappingProxyType({})
#: the thresholds a path is taken by (``build_plan`` compares the size with them)
_THRESHOLDS = ("kernel_bytes", "pull_bytes", "one_shot_bytes")
_PATH_THRESHOLD = {"direct": "kernel_bytes", "pull": "pull_bytes", "one_shot": "one_shot_bytes"}
_REDUCING = ("reduce_scatter", "all_reduce", "reduce")
#: what a row's ``forms`` and ``dtypes`` may name
FORMS = ("in", "out")
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
#: the machine's properties a table is keyed by, in order
MACHINE_KEYS = ("backend", "gpu", "world_size", "ranks_per_gpu", "link", "links", "driver",
                "hoccl")


class TableError(ValueError):
    """A tuning table that cannot be used: malformed, of another format or version."""


def size_of(shape: Shape) -> int:
    """The size a table's rows are keyed by (nccl-tests' size of the call)."""
    return kernel_bytes_of(shape)


def candidates(collective: str, world_size: int) -> Tuple[str, ...]:
    """The paths a call of ``collective`` among ``world_size`` ranks can take."""
    paths = ["push"]
    if collective in _REDUCING:
        paths.append("pull")
    if collective == "all_reduce":
        paths.append("one_shot")
    if collective in KERNEL_COLLECTIVES and 1 < world_size <= KERNEL_MAX_RANKS:
        paths.append("direct")
    return tuple(paths)


def path_options(path: str, size: int, base: Options) -> Options:
    """``base`` with the thresholds set so that a call of ``size`` bytes takes ``path``
    (a threshold of ``size`` turns its path on for it; the others are off)."""
    if path not in PATHS:
        raise TableError(f"path must be one of {PATHS}; got {path!r}")
    wanted = _PATH_THRESHOLD.get(path)
    thresholds: Dict[str, Any] = {name: max(1, size) if name == wanted else 0
                                  for name in _THRESHOLDS}
    return dataclasses.replace(base, **thresholds)


@dataclass(frozen=True)
class Row:
    """Calls of ``collective`` whose size is in [``min_bytes``, ``max_bytes``] take
    ``path`` with ``settings`` (names of ``TUNED``); ``source`` says where it was measured.
    ``forms`` ("in", "out") and ``dtypes`` narrow it to those calls (empty: every one);
    ``traits`` (names of ``TRAITS`` with True or False) to calls that have those traits
    (a trait not named: every call)."""
    collective: str
    min_bytes: int
    max_bytes: int
    path: str
    settings: Tuple[Tuple[str, Any], ...] = ()
    source: str = ""
    forms: Tuple[str, ...] = ()
    dtypes: Tuple[str, ...] = ()
    traits: Tuple[Tuple[str, bool], ...] = ()

    def covers(self, collective: str, size: int, form: Optional[str] = None,
               dtype: Optional[str] = None,
               traits: Mapping[str, Optional[bool]] = _UNKNOWN) -> bool:
        """Whether a call of ``collective`` and ``size`` (of ``form``, ``dtype`` and
        ``traits`` where known; a trait None or left out: unknown) is this row's."""
        return (self.collective == collective and self.min_bytes <= size <= self.max_bytes
                and (not self.forms or form is None or form in self.forms)
                and (not self.dtypes or dtype is None or dtype in self.dtypes)
                and all(traits.get(name) in (None, value) for name, value in self.traits))

    def to_dict(self) -> Dict[str, Any]:
        made: Dict[str, Any] = {"collective": self.collective, "min_bytes": self.min_bytes,
                                "max_bytes": self.max_bytes, "path": self.path,
                                "settings": dict(self.settings), "source": self.source}
        if self.forms:
            made["forms"] = list(self.forms)
        if self.dtypes:
            made["dtypes"] = list(self.dtypes)
        made.update(self.traits)
        return made


@dataclass(frozen=True)
class Table:
    """A machine's measured choices: ``machine`` (``MACHINE_KEYS``), ``rows``, and where
    the table came from (``origin``: a file, the shipped table's name)."""
    machine: Tuple[Tuple[str, Any], ...]
    rows: Tuple[Row, ...]
    origin: str = ""
    note: str = ""

    # -- reading and writing --------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, origin: str = "") -> "Table":
        where = f"tuning table {origin}" if origin else "tuning table"
        if not isinstance(data, dict):
            raise TableError(f"{where}: expected a JSON object; got {type(data).__name__}")
        if data.get("format") != TABLE_FORMAT:
            raise TableError(f"{where}: format must be {TABLE_FORMAT!r}; got "
                             f"{data.get('format')!r}")
        if data.get("version") not in _READABLE:
            raise TableError(f"{where}: version {data.get('version')!r} is not a version "
                             f"this hoccl reads ({', '.join(map(str, _READABLE))}); tune "
                             f"again: python -m hoccl.tune")
        machine = data.get("machine")
        if not isinstance(machine, dict) or sorted(machine) != sorted(MACHINE_KEYS):
            raise TableError(f"{where}: machine must name exactly {list(MACHINE_KEYS)}; got "
                             f"{machine!r}")
        rows = data.get("rows")
        if not isinstance(rows, list):
            raise TableError(f"{where}: rows must be a list; got {type(rows).__name__}")
        parsed = tuple(_row(where, index, row) for index, row in enumerate(rows))
        _check_overlaps(where, parsed)
        return cls(tuple((key, machine[key]) for key in MACHINE_KEYS), parsed, origin,
                   str(data.get("note", "")))

    @classmethod
    def from_json(cls, text: str, origin: str = "") -> "Table":
        try:
            data = json.loads(text)
        except ValueError as error:
            raise TableError(f"tuning table {origin}: not JSON: {error}") from None
        return cls.from_dict(data, origin)

    def to_dict(self) -> Dict[str, Any]:
        return {"format": TABLE_FORMAT, "version": TABLE_VERSION, "machine": dict(self.machine),
                "note": self.note, "rows": [row.to_dict() for row in self.rows]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    # -- use --------------------------------------------------------------------------
    def mismatch(self, machine: Mapping[str, Any]) -> Optional[str]:
        """Why this table is not ``machine``'s (None: it is)."""
        differ = [f"{key} {value!r} (this machine: {machine.get(key)!r})"
                  for key, value in self.machine if machine.get(key) != value]
        return ", ".join(differ) if differ else None

    def row_for(self, collective: str, size: int, form: Optional[str] = None,
                dtype: Optional[str] = None, traits: Mapping[str, Optional[bool]] = _UNKNOWN
                ) -> Optional[Tuple[int, Row]]:
        """The first row that covers the call, and its index."""
        for index, row in enumerate(self.rows):
            if row.covers(collective, size, form, dtype, traits):
                return index, row
        return None

    def largest(self, path: str) -> int:
        """The largest size any row takes ``path`` at (sizes the direct kernels' rings)."""
        return max((row.max_bytes for row in self.rows if row.path == path), default=0)


def _row(where: str, index: int, row: Any) -> Row:
    if not isinstance(row, dict):
        raise TableError(f"{where}: row {index} must be an object; got {row!r}")
    collective, path = row.get("collective"), row.get("path")
    low: Any = row.get("min_bytes")
    high: Any = row.get("max_bytes")
    settings: Any = row.get("settings", {})
    if not isinstance(collective, str) or not isinstance(path, str) or path not in PATHS:
        raise TableError(f"{where}: row {index} needs a collective and a path of {PATHS}; "
                         f"got {row!r}")
    if (not all(isinstance(value, int) and not isinstance(value, bool) for value in (low, high))
            or not 0 <= low <= high):
        raise TableError(f"{where}: row {index}: min_bytes and max_bytes must be ints with "
                         f"0 <= min_bytes <= max_bytes; got {low!r}, {high!r}")
    if path != "push" and path not in candidates(collective, KERNEL_MAX_RANKS):
        raise TableError(f"{where}: row {index}: a {collective} cannot take path {path!r}")
    if not isinstance(settings, dict) or set(settings) - set(TUNED):
        raise TableError(f"{where}: row {index}: settings may name only {list(TUNED)}; got "
                         f"{settings!r}")
    sms: Any = settings.get("max_sms", 1)
    if not isinstance(sms, int) or isinstance(sms, bool) or sms < 1:
        raise TableError(f"{where}: row {index}: max_sms must be a positive int; got {sms!r}")
    try:
        dataclasses.replace(Options(), **{name: value for name, value in settings.items()
                                          if name != "max_sms"})
    except ValueError as error:  # InvalidArgumentError is a ValueError
        raise TableError(f"{where}: row {index}: {error}") from None
    traits = tuple((name, row[name]) for name in TRAITS if name in row)
    for name, given in traits:
        if not isinstance(given, bool):
            raise TableError(f"{where}: row {index}: {name} must be true or false (left out: "
                             f"every call); got {given!r}")
    narrowed = []
    for key, known in (("forms", FORMS), ("dtypes", DTYPES)):
        value: Any = row.get(key, [])
        if not isinstance(value, list) or not set(value) <= set(known):
            raise TableError(f"{where}: row {index}: {key} must be a list of {list(known)}; "
                             f"got {value!r}")
        narrowed.append(tuple(value))
    return Row(collective, low, high, path, tuple(sorted(settings.items())),
               str(row.get("source", "")), narrowed[0], narrowed[1], traits)


def _check_overlaps(where: str, rows: Sequence[Row]) -> None:
    """Rows of one collective that apply to the same calls (the same forms, dtypes and
    traits) must not overlap in size; narrower rows may lie over wider ones (the first
    wins)."""
    by_collective: Dict[Tuple[str, tuple, tuple, tuple], List[Tuple[int, int, int]]] = {}
    for index, row in enumerate(rows):
        by_collective.setdefault((row.collective, row.forms, row.dtypes, row.traits),
                                 []).append((row.min_bytes, row.max_bytes, index))
    for (collective, _, _, _), ranges in by_collective.items():
        ranges.sort()
        for (_, high, first), (low, _, second) in zip(ranges, ranges[1:]):
            if low <= high:
                raise TableError(f"{where}: rows {first} and {second} of {collective} overlap")


@dataclass(frozen=True)
class Choice:
    """A call's path and the options it is planned with, and where each came from:
    ``sources`` maps each setting a row or the user decided to "user", or to "table row
    N (source)"; the rest are the defaults.  ``max_sms``: the row's SM cap for the call's
    reduction kernels (None: the communicator's ``max_sms``)."""
    path: str
    options: Options
    sources: Tuple[Tuple[str, str], ...]
    row: Optional[int] = None
    max_sms: Optional[int] = None

    def describe(self) -> Dict[str, Any]:
        return {"path": self.path, "settings": {**dataclasses.asdict(self.options),
                                                "max_sms": self.max_sms},
                "sources": dict(self.sources), "row": self.row}


def choose(table: Optional[Table], shape: Shape, base: Options, given: Iterable[str] = (),
           *, registered: Optional[bool] = None, captured: Optional[bool] = None,
           beside_compute: Optional[bool] = None) -> Choice:
    """The options ``shape``'s call is planned with: ``base`` (the communicator's
    settings) where the user ``given`` them, else the table's row for the call, else
    ``base`` (the defaults).  ``registered``, ``captured`` and ``beside_compute``: the
    call's traits (None: not known, any row's)."""
    user: FrozenSet[str] = frozenset(given)
    sources = {name: "user" for name in user if hasattr(base, name) or name == "max_sms"}
    traits = {"registered": registered, "captured": captured, "beside_compute": beside_compute}
    found = (table.row_for(shape.collective, size_of(shape), "in" if shape.in_place else "out",
                           shape.dtype, traits) if table is not None else None)
    if found is None:
        return Choice(path_of(shape, base), base, tuple(sorted(sources.items())))
    index, row = found
    source = f"table row {index}" + (f" ({row.source})" if row.source else "")
    chosen = path_options(row.path, row.max_bytes, base)
    changes = {name: getattr(chosen, name) for name in _THRESHOLDS if name not in user}
    changes.update({name: value for name, value in row.settings if name not in user})
    sms = changes.pop("max_sms", None)
    options = dataclasses.replace(base, **changes)
    sources.update({name: source for name in changes})
    if sms is not None:
        sources["max_sms"] = source
    return Choice(path_of(shape, options), options, tuple(sorted(sources.items())), index, sms)


def rows_from(collective: str, picks: Sequence[Tuple[int, str, Tuple[Tuple[str, Any], ...]]],
              complete: bool, source: Callable[[Sequence[int]], str],
              traits: Tuple[Tuple[str, bool], ...] = (), midpoint: bool = True) -> List[Row]:
    """Rows for one collective's picks, (size, path, settings) at each size a sweep
    looked at, smallest first: neighbouring sizes with the same pick make one row; each
    row reaches the geometric middle to the next row's first size (``midpoint``; else
    its own largest size), the first starts at 0, and the last runs on to ``ANY_SIZE``
    when ``complete`` (and it is not a direct kernel, whose staging ring grows with the
    largest size a table gives it), else it ends at its largest size.  ``source(sizes)``
    says where a row of those sizes came from; ``traits`` narrow every row."""
    groups: List[Tuple[str, Tuple[Tuple[str, Any], ...], List[int]]] = []
    for size, path, settings in picks:
        if groups and groups[-1][:2] == (path, settings):
            groups[-1][2].append(size)
        else:
            groups.append((path, settings, [size]))
    rows: List[Row] = []
    for index, (path, settings, sizes) in enumerate(groups):
        low = rows[-1].max_bytes + 1 if rows else 0
        if index + 1 < len(groups):
            high = math.isqrt(sizes[-1] * groups[index + 1][2][0]) if midpoint else sizes[-1]
        elif complete and path != "direct":
            high = ANY_SIZE
        else:
            high = sizes[-1]
        rows.append(Row(collective, low, high, path, settings, source(sizes), traits=traits))
    return rows
