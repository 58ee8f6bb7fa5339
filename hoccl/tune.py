"""python -m hoccl.tune: measure which path each call should take here; write the table.

  mpiexec -n 2 python -m hoccl.tune                         # one rank per process
  python -m hoccl.tune --local 2                            # one process, GPUs 0 and 1
  python -m hoccl.tune --local 3 --backend host --max-bytes 64K --budget 20 --output t.json

For each collective, each size (nccl-tests' size, ``hoccl.sched.select.size_of``) and
each path the call can take there (``select.candidates``: push, pull, one_shot, direct;
push and pull reductions also with a few ``chunk_bytes``), the tuner forces that path
(``set_options``: a setting the user gives overrides any table), checks one call against
the reference (``hoccl.testing.check_collective``: fresh random inputs, poisoned
outputs, every output compared bit for bit, since every backend sums in rank order; with
``--tolerance`` float reductions within that error), and only then times it: warm-up
calls, then the median of ``--samples`` samples, each a run of back-to-back calls ended
by ``synchronize``.  Where a size's correct candidates come within 10 % of its fastest,
the budget's time left times them again in turn, up to 3 timings each, and the median of
a candidate's timings counts (``refine``).
Every rank takes the slowest rank's time, so all ranks choose alike.  The fastest
correct candidate wins each (collective, size); neighbouring sizes with the same winner
merge into one row of size range, and rank 0 writes the table (``select.Table``) to
``--output``, by default where ``init`` looks for this machine's table
(``hoccl.tuning.cache_dir() / table_name(machine)``).

Rows cover the measured sizes contiguously: a size's row reaches halfway (geometrically)
to the next measured size, the first row starts at 0, and the last one runs on to any
size when the sweep reached ``--max-bytes`` (a direct-kernel row ends at its size: its
staging ring grows with the largest size the table gives it).  Sizes the ``--budget``
would not cover are skipped, said so on stderr and in the table's note, and left to the
defaults.  A candidate that computes a wrong result is reported and never chosen, and
the program then exits with status 2 after writing the table; one whose call raises (a
path that cannot run that call here) is reported and passed over.

With ``--beside-compute`` the reductions (reduce_scatter, all_reduce) are timed a second
time beside a GEMM that runs on the same devices (``hoccl._beside``: a bf16 torch matmul
on a stream of its own on the cuda backend, a numpy matmul in a thread on the host
backend), over their candidates and a larger SM cap (``max_sms``).  Each candidate's
cost is the time the calls and the GEMMs took together beyond the GEMMs' own time
alone, per call: the communication the GEMMs did not hide plus the GEMMs' slowdown.  The
cheapest per size (with the same margin) makes rows marked ``"beside_compute": true``,
written before the plain rows: ``init`` then takes them for every reduction whose call
does not say it runs apart from compute (``select.choose(beside_compute=False)`` passes
them over).  Half the budget goes to the plain sweep, the rest to this one.

On the host backend the timings say little about a GPU; the table is still valid and
exact, which is what the tests check.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _beside
from ._progress import Progress
from ._dtypes import numpy_dtype
from .bench._harness import Ranks, human, parse_size, require_installed
from .sched._path_model import excluded_paths
from .sched.algorithms import Shape
from .sched.select import ANY_SIZE, Row, Table, candidates, path_options, rows_from, size_of

__all__ = ["main", "Candidate", "Measurement", "candidates_at", "sizes_between", "rows_of",
           "COLLECTIVES"]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
#: per collective: (elements sent, elements received) per rank, in ``count``s (1 or n)
_BLOCKS = {"all_gather": (1, "n"), "reduce_scatter": ("n", 1), "all_reduce": (1, 1),
           "all_to_all": ("n", "n"), "broadcast": (1, 1)}
_REDUCTIONS = ("reduce_scatter", "all_reduce")
#: the smallest chunk the tuner tries
_MIN_CHUNK = 4 << 10
#: the settings a forced candidate fixes, so that no table decides them while timing
_FORCED = ("kernel_bytes", "pull_bytes", "one_shot_bytes", "chunk_bytes", "copy_lanes",
           "kernel_sms", "self_route", "max_sms")
#: the SM caps reductions are also tried with beside compute (the best 2 x H200 training
#: figure took 32: docs/results/h200x2-2026-11-30.md)
_SMS_BESIDE = (32,)
_PROGRAM = "python -m hoccl.tune"


def arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=_PROGRAM, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local", type=int, default=0, metavar="N",
                        help="drive N ranks from this one process (hoccl.init_local); "
                             "default: one rank per mpiexec process (hoccl.init)")
    parser.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES),
                        help="comma-separated subset of %(default)s")
    parser.add_argument("--min-bytes", default="4K", help="smallest size (nccl-tests' size)")
    parser.add_argument("--max-bytes", default="1G", help="largest size")
    parser.add_argument("--factor", type=int, choices=(2, 4), default=4,
                        help="size multiplier between measured sizes")
    parser.add_argument("--dtype", default="float32",
                        help="element type of the measured calls (float32, int32, ...)")
    parser.add_argument("--budget", type=float, default=120.0, metavar="SECONDS",
                        help="total time; no candidate starts that would end past it, and the sizes "
                             "it leaves out keep the defaults")
    parser.add_argument("--samples", type=int, default=5,
                        help="timed samples per candidate (the median counts)")
    parser.add_argument("--sample-seconds", type=float, default=0.01,
                        help="length of one sample: back-to-back calls, 1 to 100")
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="relative and absolute error allowed in float reductions "
                             "(default 0: bit for bit, as every backend sums in rank order)")
    parser.add_argument("--output", default="",
                        help="where to write the table (default: the cache directory's "
                             "file for this machine, which init loads)")
    parser.add_argument("--beside-compute", action="store_true",
                        help="also time the reductions beside a GEMM and write rows for "
                             "calls that overlap compute (half the budget)")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples must be at least 1; got {args.samples}")
    args.min_bytes, args.max_bytes = parse_size(args.min_bytes), parse_size(args.max_bytes)
    if not 0 < args.min_bytes <= args.max_bytes:
        parser.error(f"need 0 < --min-bytes <= --max-bytes; got {args.min_bytes}, "
                     f"{args.max_bytes}")
    args.collectives = args.collectives.split(",")
    unknown = sorted(set(args.collectives) - set(COLLECTIVES))
    if unknown:
        parser.error(f"--collectives: unknown {unknown}; expected any of {list(COLLECTIVES)}")
    return args


# -- what is measured ----------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One way to run a call: a path, and for push and pull reductions a chunk size and
    an SM cap (None: the communicator's)."""
    path: str
    chunk_bytes: Optional[int] = None
    max_sms: Optional[int] = None

    @property
    def label(self) -> str:
        return self.path + (f" chunk {human(self.chunk_bytes)}" if self.chunk_bytes else "") \
            + (f" max_sms {self.max_sms}" if self.max_sms else "")

    def settings(self) -> Tuple[Tuple[str, Any], ...]:
        """What a table row names besides the path."""
        return tuple((name, value) for name, value in (("chunk_bytes", self.chunk_bytes),
                                                       ("max_sms", self.max_sms)) if value)


@dataclass
class Measurement:
    """A candidate at one (collective, size): seconds per call (the slowest rank's
    median), or why it was not timed: ``verdict`` "wrong" (a wrong result) or "failed"
    (the call raised), and ``error``, what the check said."""
    collective: str
    size: int
    candidate: Candidate
    seconds: Optional[float] = None
    verdict: str = ""
    error: str = ""
    shape: Optional[Shape] = None  #: the call timed
    rounds: Tuple[float, ...] = ()  #: each timing's seconds; ``seconds`` is their median
    spent: float = 0.0  #: the wall time one timing took (check included)


def sizes_between(low: int, high: int, factor: int) -> List[int]:
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= factor
    return sizes


def shape_at(collective: str, size: int, world_size: int, dtype: str, itemsize: int) -> Shape:
    """The call of nominal ``size`` bytes: its ``count`` rounded down to whole elements
    per block (at least one); ``size_of`` gives the size it really has."""
    blocks = world_size if collective in ("all_gather", "reduce_scatter", "all_to_all") else 1
    return Shape(collective, world_size, max(1, size // itemsize // blocks), dtype, itemsize)


def candidates_at(collective: str, world_size: int, size: int, chunk_bytes: int,
                  sms: Sequence[int] = (), excluded: Sequence[str] = ()) -> List[Candidate]:
    """Every path ``select.candidates`` allows but ``excluded``; push and pull reductions also in chunks of
    about a quarter and a sixteenth of ``size`` (powers of two, at least 4 KiB) besides
    the communicator's ``chunk_bytes`` (a candidate of no chunk of its own), and with each
    SM cap of ``sms`` besides the communicator's."""
    found = []
    for path in candidates(collective, world_size):
        if path in excluded:
            continue
        if path in ("push", "pull") and collective in _REDUCTIONS:
            parts = (1 << (size // divisor).bit_length() - 1 for divisor in (4, 16)
                     if size // divisor >= _MIN_CHUNK)
            chunks = [None] + sorted({part for part in parts if part != chunk_bytes},
                                     reverse=True)
            found += [Candidate(path, chunk, cap) for cap in (None, *sms) for chunk in chunks]
        else:
            found.append(Candidate(path))
    return found


# -- the ranks -------------------------------------------------------------------------------
def open_ranks(args: argparse.Namespace) -> Ranks:
    import hoccl
    if args.local:
        comms = hoccl.init_local(args.local, backend=args.backend)
        return Ranks(comms, args.local, None)
    from mpi4py import MPI
    comm = hoccl.init(backend=args.backend)
    return Ranks([comm], comm.world_size, MPI.COMM_WORLD)


def agreed(ranks: Ranks, value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    return value if ranks.mpi is None else ranks.mpi.bcast(value, root=0)


def machine_of(ranks: Ranks) -> Dict[str, Any]:
    """The machine these ranks' table is for: what ``init`` keyed its own look-up by."""
    return dict(ranks.comms[0]._engine.machine)


def force(ranks: Ranks, base: Dict[str, Any], candidate: Candidate, shape: Shape) -> None:
    """Make ``shape``'s calls take ``candidate`` on every local rank."""
    options = path_options(candidate.path, size_of(shape), ranks.comms[0].options)
    changes = dict(base, kernel_bytes=options.kernel_bytes, pull_bytes=options.pull_bytes,
                   one_shot_bytes=options.one_shot_bytes)
    if candidate.chunk_bytes:
        changes["chunk_bytes"] = candidate.chunk_bytes
    if candidate.max_sms:
        changes["max_sms"] = candidate.max_sms
    for comm in ranks.comms:
        comm.set_options(**changes)


def buffers_for(ranks: Ranks, shape: Shape, arrays: Any) -> List[Tuple[Any, Any, Any]]:
    """(comm, send, recv) per local rank, out of place (broadcast: send on the root only)."""
    n, dtype = ranks.world_size, numpy_dtype(shape.dtype)
    sends, receives = ((shape.count * n if times == "n" else shape.count)
                       for times in _BLOCKS[shape.collective])
    buffers = []
    for comm in ranks.comms:
        send = None
        if shape.collective != "broadcast" or comm.rank == 0:
            send = arrays.asarray(np.ones(sends, dtype=dtype), comm.device)
        buffers.append((comm, send, arrays.asarray(np.zeros(receives, dtype=dtype), comm.device)))
    return buffers


def issue(collective: str, buffers: Sequence[Tuple[Any, Any, Any]]) -> None:
    for comm, send, recv in buffers:
        if collective in _REDUCTIONS:
            getattr(comm, collective)(send, recv, "sum")
        elif collective == "broadcast":
            comm.broadcast(send, recv, 0)
        else:
            getattr(comm, collective)(send, recv)


def seconds_per_call(ranks: Ranks, collective: str, buffers: Sequence[Tuple[Any, Any, Any]],
                     calls: int) -> float:
    """This process's seconds per call over ``calls`` back-to-back calls, from a barrier
    to the end of the last."""
    ranks.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        issue(collective, buffers)
    for comm, _, _ in buffers:
        comm.synchronize()
    return (time.perf_counter() - start) / calls


def check(ranks: Ranks, shape: Shape, seed: int, tolerance: float,
          arrays: Any = None) -> Tuple[str, str]:
    """One call on fresh random inputs, on every rank: ("", "") when right everywhere,
    else ("wrong", what) for a wrong result or ("failed", what) for a call that raised
    (the first such rank's message; every rank returns the same verdict)."""
    from .testing import check_collective
    floating = np.dtype(numpy_dtype(shape.dtype)).kind == "f"
    rounding = tolerance if tolerance and floating and shape.collective in _REDUCTIONS else None
    try:
        check_collective(ranks.comms, shape.collective, count=shape.count, dtype=shape.dtype,
                         seed=seed, rounding=rounding, arrays=arrays)
        verdict = ("", "")
    except AssertionError as error:
        verdict = ("wrong", str(error))
    except Exception as error:  # the path cannot run this call here: not a candidate
        verdict = ("failed", f"{type(error).__name__}: {error}")
    if ranks.mpi is None:
        return verdict
    verdicts = sorted((one for one in ranks.mpi.allgather(verdict) if one[0]),
                      key=lambda one: one[0] != "wrong")
    return verdicts[0] if verdicts else ("", "")


def measure(ranks: Ranks, args: argparse.Namespace, shape: Shape, candidate: Candidate,
            seed: int, arrays: Any = None, compute: Optional[_beside.Compute] = None
            ) -> Measurement:
    """Check ``candidate`` at ``shape``, then time it (the slowest rank's median): alone,
    or beside ``compute`` (``_beside.overlapped_seconds``)."""
    from .testing import array_module_for
    found = Measurement(shape.collective, size_of(shape), candidate, shape=shape)
    found.verdict, found.error = check(ranks, shape, seed, args.tolerance, arrays)
    if found.verdict:
        return found
    buffers = buffers_for(ranks, shape, array_module_for(args.backend, shape.dtype))
    for _ in range(2):  # warm-up: plans, peers' buffers, clocks
        seconds_per_call(ranks, shape.collective, buffers, 1)
    probe = ranks.max(seconds_per_call(ranks, shape.collective, buffers, 1))
    calls = int(agreed(ranks, min(100, max(1, int(args.sample_seconds / max(probe, 1e-9))))))

    def sample() -> float:
        if compute is None:
            return seconds_per_call(ranks, shape.collective, buffers, calls)
        return _beside.overlapped_seconds(
            compute, lambda: seconds_per_call(ranks, shape.collective, buffers, calls),
            calls, probe, ranks.barrier)
    found.seconds = ranks.max(float(np.median([sample() for _ in range(args.samples)])))
    found.rounds = (found.seconds,)
    return found


#: candidates within this fraction of a size's fastest are timed again (``refine``)
CLOSE = 0.10
#: the timings a close candidate gets in all, where the budget leaves time
ROUNDS = 3


def refine(results: Dict[str, List[Measurement]],
           again: Callable[[Measurement], Measurement], time_for: Callable[[float], bool]
           ) -> int:
    """Time again, in turn (A, B, A, B: drift falls on both), the correct candidates
    within ``CLOSE`` of each size's fastest where more than one is, until each has
    ``ROUNDS`` timings or ``time_for(predicted seconds)`` says no; each one's
    ``seconds`` becomes the median of its timings.  A sweep's samples are short, and on
    a busy or shared machine one timing can reverse a close order.  ``again(m)``
    measures ``m``'s candidate anew (checked first: one found wrong now is never
    chosen).  Returns how many timings were added."""
    added = 0
    for _ in range(ROUNDS - 1):
        close: List[Measurement] = []
        for measured in results.values():
            for found in _timed_by_size(measured).values():
                near = _within(found, CLOSE)
                close += near if len(near) > 1 else []
        for one in close:
            if not time_for(one.spent):
                return added
            timed = again(one)
            added += 1
            if timed.seconds is None:
                one.seconds, one.verdict, one.error = None, timed.verdict, timed.error
                continue
            one.rounds += (timed.seconds,)
            one.seconds = float(np.median(one.rounds))
    return added


# -- the sweep ---------------------------------------------------------------------------------
def sweep(ranks: Ranks, args: argparse.Namespace, budget: float, arrays: Any = None,
          compute: Optional[_beside.Compute] = None
          ) -> Tuple[Dict[str, List[Measurement]], Dict[str, int]]:
    """Every (collective, size, candidate) ``budget`` seconds allow, small sizes first;
    beside ``compute``: the reductions only, with the SM caps of ``_SMS_BESIDE`` too.

    Returns each collective's measurements and, for a collective whose sizes the budget
    cut, the first size it skipped."""
    n, dtype = ranks.world_size, args.dtype
    itemsize = np.dtype(numpy_dtype(dtype)).itemsize
    chunk_bytes = ranks.comms[0].options.chunk_bytes
    base = {name: getattr(ranks.comms[0].config, name) for name in _FORCED}
    sizes = sizes_between(args.min_bytes, args.max_bytes, args.factor)
    collectives = [collective for collective in args.collectives
                   if compute is None or collective in _REDUCTIONS]
    excluded = excluded_paths(machine_of(ranks))
    plan = {(collective, size): candidates_at(collective, n, size_of(shape_at(
        collective, size, n, dtype, itemsize)), chunk_bytes,
        _SMS_BESIDE if compute is not None else (), excluded)
        for size in sizes for collective in collectives}
    progress = Progress(ranks.leader, sum(map(len, plan.values())), "candidate", budget)
    if excluded:
        progress.say(f"{_PROGRAM}: not timed here: {', '.join(excluded)} "
                     f"({ranks.comms[0]._engine.machine['ranks_per_gpu']} ranks per GPU)")
    if compute is not None:
        progress.say(f"{_PROGRAM}: the reductions beside {compute.name}")
    seed = int(agreed(ranks, int(np.random.default_rng().integers(1 << 30))))
    results: Dict[str, List[Measurement]] = {collective: [] for collective in collectives}
    cost: Dict[str, List[float]] = {collective: [] for collective in collectives}
    skipped: Dict[str, int] = {}
    for size in sizes:
        for collective in collectives:
            if collective in skipped:
                progress.step(f"{collective} {human(size)} skipped", len(plan[collective, size]))
                continue
            spent = cost[collective]
            growth = min(args.factor, max(1.0, spent[-1] / spent[-2])) if len(spent) > 1 else 1.0
            predicted = spent[-1] * growth if spent else 0.0
            over = agreed(ranks, progress.elapsed() + predicted > budget and bool(spent))
            if over:
                skipped[collective] = size
                progress.say(f"{_PROGRAM}: {collective} from {human(size)} up skipped: about "
                             f"{predicted:.1f} s more would pass the budget of {budget:g} s "
                             f"({progress.elapsed():.1f} s used); those sizes keep the defaults")
                progress.step(f"{collective} {human(size)} skipped", len(plan[collective, size]))
                continue
            shape = shape_at(collective, size, n, dtype, itemsize)
            started = time.monotonic()
            measured: List[Measurement] = []
            for candidate in plan[collective, size]:
                # the next candidate takes about what the ones before it at this size took;
                # a size the budget cuts short is left to the defaults, not chosen among
                # some of its candidates (a collective's smallest size is always measured)
                if spent and measured and agreed(ranks, progress.elapsed() + (
                        time.monotonic() - started) / len(measured) > budget):
                    break
                force(ranks, base, candidate, shape)
                seed += 1
                began = time.monotonic()
                found = measure(ranks, args, shape, candidate, seed, arrays, compute)
                found.spent = time.monotonic() - began
                measured.append(found)
                if found.verdict:
                    progress.say(f"{_PROGRAM}: {collective} {human(found.size)} "
                                 f"{candidate.label}: {found.verdict.upper()}, not chosen: "
                                 f"{found.error}")
                progress.step(f"{collective} {human(found.size)} {candidate.label}")
            if len(measured) < len(plan[collective, size]):
                skipped[collective] = size
                progress.say(f"{_PROGRAM}: {collective} from {human(size)} up skipped: its "
                             f"candidates would pass the budget of {budget:g} s "
                             f"({progress.elapsed():.1f} s used); those sizes keep the defaults")
                progress.step(f"{collective} {human(size)} skipped",
                              len(plan[collective, size]) - len(measured))
                continue
            results[collective] += measured
            cost[collective].append(time.monotonic() - started)

    def again(one: Measurement) -> Measurement:
        nonlocal seed
        assert one.shape is not None
        force(ranks, base, one.candidate, one.shape)
        seed += 1
        return measure(ranks, args, one.shape, one.candidate, seed, arrays, compute)
    added = refine(results, again, lambda predicted: bool(
        agreed(ranks, progress.elapsed() + predicted <= budget)))
    for comm in ranks.comms:
        comm.set_options(**base)
    progress.close()
    progress.say(f"{_PROGRAM}: measured in {progress.elapsed():.1f} s ({added} timings "
                 f"again of candidates within {CLOSE:.0%} of their size's fastest)")
    return results, skipped


# -- the table ---------------------------------------------------------------------------------
#: a candidate that sets more (a chunk size of its own) must beat a simpler one by this
#: fraction to be chosen: timings differ by noise, and a setting chosen on noise costs
#: where the noise went the other way
MARGIN = 0.05


def winners(measured: Sequence[Measurement]) -> List[Tuple[int, Measurement]]:
    """(size, the chosen correct measurement) per measured size, smallest first: of the
    candidates within ``MARGIN`` of the fastest, the one with the fewest settings, then
    the fastest; a size where no candidate was right has none."""
    chosen: Dict[int, Measurement] = {}
    for size, found in _timed_by_size(measured).items():
        chosen[size] = min(_within(found, MARGIN),
                           key=lambda one: (len(one.candidate.settings()), one.seconds))
    return sorted(chosen.items())


def _timed_by_size(measured: Sequence[Measurement]) -> Dict[int, List[Measurement]]:
    """The timed (correct) measurements by size."""
    by_size: Dict[int, List[Measurement]] = {}
    for one in measured:
        if one.seconds is not None:
            by_size.setdefault(one.size, []).append(one)
    return by_size


def _within(found: Sequence[Measurement], fraction: float) -> List[Measurement]:
    """Those of ``found`` (all timed) within ``fraction`` of the fastest."""
    fastest = min(one.seconds for one in found)  # type: ignore[type-var]
    return [one for one in found if one.seconds <= fastest * (1 + fraction)]  # type: ignore[operator]


def rows_of(collective: str, chosen: Sequence[Tuple[int, Measurement]], complete: bool,
            run: str, traits: Tuple[Tuple[str, bool], ...] = ()) -> List[Row]:
    """Rows for one collective's winners (``select.rows_from``), each naming the run and
    the sizes it was measured at."""
    return rows_from(collective, [(size, found.candidate.path, found.candidate.settings())
                                  for size, found in chosen], complete,
                     lambda sizes: f"{run}: measured at {', '.join(map(human, sizes))}", traits)


#: the rows of a sweep beside compute
BESIDE = (("beside_compute", True),)
#: a sweep's rows' traits, its measurements and its skipped sizes
Sweep = Tuple[Tuple[Tuple[str, bool], ...], Dict[str, List[Measurement]], Dict[str, int]]


def table_of(machine: Dict[str, Any], sweeps: Sequence[Sweep], run: str) -> Table:
    """The table of ``sweeps``, each (traits its rows are narrowed to, measurements,
    skipped sizes), their rows in that order."""
    rows: List[Row] = []
    note = f"measured by {run}"
    for traits, results, skipped in sweeps:
        for collective, measured in results.items():
            chosen = winners(measured)
            # the last row runs on past the largest size only where that size was
            # measured and had a right candidate
            complete = collective not in skipped and bool(chosen) \
                and chosen[-1][0] == max(one.size for one in measured)
            rows += rows_of(collective, chosen, complete, run, traits)
        if skipped:
            note += ("; beside compute" if traits else "") + \
                "; skipped by the budget, left to the defaults: " + ", ".join(
                    f"{collective} from {human(size)}" for collective, size in skipped.items())
    return Table(tuple((key, machine[key]) for key in machine), tuple(rows), note=note)


def summary(results: Dict[str, List[Measurement]], heading: str) -> List[str]:
    lines = []
    for collective, measured in results.items():
        lines.append(f"## {collective}{heading}: µs per call (the slowest rank's median)")
        chosen = dict(winners(measured))
        for size in sorted({one.size for one in measured}):
            cells = [f"{one.candidate.label} " + (f"{one.seconds * 1e6:.1f}" if one.seconds
                                                  is not None else one.verdict.upper())
                     for one in measured if one.size == size]
            pick = chosen[size].candidate.label if size in chosen else "none right"
            lines.append(f"  {human(size):>6s}  " + " | ".join(cells) + f"  -> {pick}")
    return lines


def rows_summary(table: Table, where: str) -> List[str]:
    lines = [f"## rows written to {where}"]
    for row in table.rows:
        high = "any" if row.max_bytes == ANY_SIZE else str(row.max_bytes)
        settings = "".join(f" {name}={value}" for name, value in row.settings)
        marks = "".join(f" [{name}]" for name, value in row.traits if value)
        lines.append(f"  {row.collective:14s} {row.min_bytes:>10d} .. {high:>10s}  "
                     f"{row.path}{settings}{marks}")
    if table.note:
        lines.append(f"note: {table.note}")
    return lines


def main(argv: Optional[Sequence[str]] = None, arrays: Any = None) -> int:
    """Tune, write the table on rank 0; 0, or 2 when a candidate computed a wrong result.
    ``arrays``: the ``hoccl.testing.ArrayModule`` the checks use (tests plant faults)."""
    require_installed(_PROGRAM, ("tqdm", "humanfriendly"))
    args = arguments(argv)
    import hoccl
    from . import tuning
    ranks = open_ranks(args)
    try:
        machine = machine_of(ranks)
        launch = f"--local {args.local}" if args.local else f"{ranks.world_size} processes"
        command = " ".join([_PROGRAM] + list(sys.argv[1:] if argv is None else argv))
        run = (f"{datetime.now(timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')} `{command}` "
               f"({launch}, hoccl {hoccl.__version__})")
        output = Path(args.output) if args.output else \
            tuning.cache_dir() / tuning.table_name(machine)
        if ranks.leader:
            print(f"{_PROGRAM}: tuning for about {args.budget:g} s; the table goes to "
                  f"{output}", flush=True)
        started = time.monotonic()
        share = 0.5 if args.beside_compute else 1.0
        sweeps: List[Sweep] = [((), *sweep(ranks, args, args.budget * share, arrays))]
        if args.beside_compute:
            compute = _beside.open_compute(args.backend, [comm.device for comm in ranks.comms])
            left = args.budget - (time.monotonic() - started)
            sweeps.insert(0, (BESIDE, *sweep(ranks, args, left, arrays, compute)))
        wrong = any(one.verdict == "wrong" for _, results, _ in sweeps
                    for measured in results.values() for one in measured)
        if ranks.leader:
            table = table_of(machine, sweeps, run)
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(table.to_json())
            lines = [line for traits, results, _ in reversed(sweeps)
                     for line in summary(results, " beside compute" if traits else "")]
            print("\n".join(lines + rows_summary(table, str(output))), flush=True)
        ranks.barrier()
    finally:
        for comm in ranks.comms:
            comm.close()
    return 2 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
