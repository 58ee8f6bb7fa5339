#!/usr/bin/env python3
"""Run every hoccl collective and check each result against numpy.

  python examples/run_all.py                     # GPUs when visible (up to 4), else 4 host ranks
  python examples/run_all.py --backend host --ranks 3
  mpirun -np 2 python examples/run_all.py --mpi  # one rank per process (hoccl.init)

Covers all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, reduce, gather
and scatter (in place and out of place, several dtypes, odd sizes, first and last
root, several reduction ops, both routes of a rank's own block), send/recv and
barrier.  Each check draws fresh random inputs, poisons the outputs and compares
every rank's output with the naive numpy program (``hoccl.testing``).  Prints one
table row per case and ``N passed, M failed`` last; exits 1 when anything failed.

Without --mpi every rank lives in this one process (``hoccl.init_local``): on the
cuda backend rank i drives GPU i, so there are at most as many ranks as GPUs; on
the host backend ranks are worker threads over host memory and any count works.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

import hoccl
from hoccl.backends import cuda_device_count
from hoccl.testing import (IN_PLACE_FORMS, ArrayModule, RegisteredArrays, check_collective,
                           poison, random_array)

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
               "reduce", "gather", "scatter")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("reduce_scatter", "all_reduce", "reduce")
#: the main grid: each dtype with its own odd count (NCCL's count, see hoccl.sched.Shape)
MAIN_DTYPES = (("float32", 65537), ("bfloat16", 1021), ("int32", 17))
#: the other dtypes, once each through all_reduce with every op
OTHER_DTYPES = ("float16", "float64", "int8", "uint8", "int64")
ALL_OPS = ("sum", "prod", "max", "min", "avg")


@dataclass
class Case:
    """One table row: a collective in one form, dtype and count, over some roots and ops."""
    collective: str
    form: str                   # "out", "in", "out/peer" or "out/local" (the own-block route
                                # forced), or a send/recv pattern
    dtype: str
    count: int
    roots: Sequence[int] = (0,)
    ops: Sequence[str] = ("sum",)
    passed: int = 0
    failed: int = 0
    errors: List[str] = field(default_factory=list)
    skipped: str = ""

    @property
    def variants(self) -> str:
        parts = []
        if self.collective in ROOTED:
            parts.append("root " + ",".join(map(str, self.roots)))
        if self.collective in REDUCING:
            parts.append("op " + ",".join(self.ops))
        return "; ".join(parts)


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("cuda", "host"), default=None,
                        help="cuda (GPUs through copy engines) or host (numpy and worker "
                             "threads, no GPU needed); default: cuda when a GPU is visible")
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks in this process without --mpi; default 4 on the host "
                             "backend, min(4, visible GPUs) on cuda")
    parser.add_argument("--mpi", action="store_true",
                        help="one rank per process under mpirun/mpiexec (hoccl.init); "
                             "rank 0 prints")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds any host wait may take before it raises (default 60)")
    args = parser.parse_args(argv)
    if args.mpi and args.ranks is not None:
        parser.error("--ranks does not apply with --mpi: the rank count is mpirun's -np")
    if args.ranks is not None and args.ranks < 1:
        parser.error(f"--ranks must be at least 1; got {args.ranks}")
    return args


# -- setup ---------------------------------------------------------------------------------
def open_ranks(args: argparse.Namespace):
    """This process's communicators (all ranks, or this process's one) and the MPI world."""
    if args.mpi:
        from mpi4py import MPI
        comm = hoccl.init(backend=args.backend, timeout=args.timeout)
        return [comm], MPI.COMM_WORLD
    gpus = cuda_device_count()
    backend = args.backend or ("cuda" if gpus else "host")
    if backend == "cuda":
        ranks = args.ranks or min(4, gpus)
        if ranks > gpus:
            sys.exit(f"run_all: --ranks {ranks} needs {ranks} GPUs; {gpus} visible (init_local "
                     f"runs one rank per GPU; use --backend host for more ranks)")
        return hoccl.init_local(list(range(ranks)), backend="cuda", timeout=args.timeout), None
    return hoccl.init_local(args.ranks or 4, backend="host", timeout=args.timeout), None


def array_module(backend: str, dtype: str) -> Optional[ArrayModule]:
    """numpy on the host; cupy (or torch) on GPUs; torch for bfloat16 on GPUs. None: missing."""
    if backend == "host":
        return ArrayModule("numpy")
    has_torch = importlib.util.find_spec("torch") is not None
    if dtype == "bfloat16":
        return ArrayModule("torch") if has_torch else None
    if importlib.util.find_spec("cupy") is not None:
        return ArrayModule("cupy")
    return ArrayModule("torch") if has_torch else None


def cases(world_size: int) -> List[Case]:
    last = world_size - 1
    roots = sorted({0, last})
    grid = []
    for collective in COLLECTIVES:
        for dtype, count in MAIN_DTYPES:
            for form in ("out", "in") if collective in IN_PLACE_FORMS else ("out",):
                grid.append(Case(collective, form, dtype, count,
                                 roots=roots if collective in ROOTED else (0,),
                                 ops=("sum", "max", "avg") if collective in REDUCING else ("sum",)))
    for route in ("peer", "local"):
        for collective in ("all_gather", "all_to_all", "broadcast", "gather", "scatter"):
            grid.append(Case(collective, f"out/{route}", "float32", 4099,
                             roots=(last,) if collective in ROOTED else (0,)))
    for dtype in OTHER_DTYPES:
        grid.append(Case("all_reduce", "out", dtype, 1001, ops=ALL_OPS))
    # buffers carved from registered arrays (hoccl.empty) at the same offsets on every rank:
    # under --mpi these calls go without a descriptor exchange
    for collective in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        for form in ("in/registered", "out/registered") if collective != "all_to_all" \
                else ("out/registered",):
            grid.append(Case(collective, form, "float32", 4099,
                             ops=("sum", "max") if collective in REDUCING else ("sum",)))
    grid.append(Case("send/recv", "ring +1", "float64", 12345))
    grid.append(Case("send/recv", "ring -1", "int8", 31))
    grid.append(Case("barrier", "", "", 0))
    return grid


# -- checks --------------------------------------------------------------------------------
def check_send_recv(comms, arrays: ArrayModule, dtype: str, count: int, shift: int,
                    seed: int) -> None:
    """Every rank sends to rank+shift and receives from rank-shift.

    A send completes only once the receiver's stream reaches the matching recv, so a
    ring where everyone sends first would wait in a cycle; even ranks send first and
    odd ranks receive first, which orders every pair.
    """
    n = comms[0].world_size
    rng = np.random.default_rng(seed)
    data = [random_array(rng, count, dtype) for _ in range(n)]
    buffers = {}
    for comm in comms:
        buffers[comm.rank] = (arrays.asarray(data[comm.rank], comm.device),
                              arrays.asarray(poison(count, dtype), comm.device))
    for comm in comms:
        r = comm.rank
        source, target = buffers[r]
        to, frm = (r + shift) % n, (r - shift) % n
        if r % 2 == 0:
            comm.send(source, to)
            comm.recv(target, frm)
        else:
            comm.recv(target, frm)
            comm.send(source, to)
    for comm in comms:
        comm.synchronize()
    for comm in comms:
        r = comm.rank
        got = arrays.to_numpy(buffers[r][1], dtype)
        want = data[(r - shift) % n]
        if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
            wrong = int(np.count_nonzero(got != want))
            raise AssertionError(f"send/recv: rank {r} received {wrong} wrong elements of "
                                 f"{count} from rank {(r - shift) % n}")


def check_barrier(comms, arrays: ArrayModule, seed: int) -> None:
    """Two barriers back to back complete, and a collective after them is still right."""
    for _ in range(2):
        for comm in comms:
            comm.barrier()
    for comm in comms:
        comm.synchronize()
    check_collective(comms, "all_gather", count=5, dtype="int32", seed=seed, arrays=arrays)


def run_case(comms, case: Case, seed: int) -> List[Optional[str]]:
    """Run every variant of ``case``; one entry per variant: None when it passed, else why."""
    backend = comms[0].backend
    arrays = array_module(backend, case.dtype or "int32")
    if arrays is None:
        case.skipped = "needs torch" if case.dtype == "bfloat16" else "needs cupy or torch"
        return []
    outcomes = []

    def attempt(action) -> None:
        try:
            action()
            outcomes.append(None)
        except Exception as error:  # a wrong result, or an error hoccl raised: report both
            detail = "".join(traceback.format_exception_only(type(error), error)).strip()
            outcomes.append(f"{where}{detail}")

    # under mpirun each process reports its own rank; in one process the message names it
    where = f"rank {comms[0].rank}: " if len(comms) == 1 and comms[0].world_size > 1 else ""

    if case.collective == "send/recv":
        if comms[0].world_size < 2:
            case.skipped = "needs 2 ranks"
            return []
        shift = 1 if case.form == "ring +1" else -1
        attempt(lambda: check_send_recv(comms, arrays, case.dtype, case.count, shift, seed))
        return outcomes
    if case.collective == "barrier":
        attempt(lambda: check_barrier(comms, arrays, seed))
        return outcomes
    registered = case.form.endswith("/registered")
    if registered:  # one registered array per rank, released (collectively) after the case
        arrays = RegisteredArrays(arrays, slot_bytes=case.count * comms[0].world_size * 8)
    default_route = comms[0].options.self_route
    route = case.form.split("/")[1] if "/" in case.form and not registered else default_route
    for comm in comms:
        comm.set_options(self_route=route)
    for root in case.roots:
        for op in case.ops:
            attempt(lambda: check_collective(
                comms, case.collective, count=case.count, dtype=case.dtype, op=op, root=root,
                in_place=case.form.split("/")[0] == "in",
                seed=seed + 1000 * root + ALL_OPS.index(op), arrays=arrays))
    for comm in comms:
        comm.set_options(self_route=default_route)
    if registered:
        try:
            arrays.release()
        except Exception as error:  # a failed deregistration fails the case
            outcomes.append(f"{where}deregister: {error}")
    return outcomes


# -- report --------------------------------------------------------------------------------
COLUMNS = (("collective", 15), ("form", 14), ("dtype", 9), ("count", 6), ("variants", 30),
           ("result", 0))


def row(*cells) -> str:
    return "  ".join(f"{cell:<{width}}" if width else str(cell)
                     for cell, (_, width) in zip(cells, COLUMNS)).rstrip()


def main(argv=None) -> int:
    args = arguments(argv)
    start = time.monotonic()
    comms, world = open_ranks(args)
    leader = world is None or world.rank == 0
    n, backend = comms[0].world_size, comms[0].backend
    gpus = [c.device for c in comms] if world is None else world.allgather(comms[0].device)
    if leader:
        where = (f"{n} processes (mpirun, hoccl.init)" if world is not None
                 else f"{n} ranks in one process (init_local)")
        devices = "" if backend == "host" else f", GPUs {gpus}"
        print(f"hoccl {hoccl.__version__}: backend {backend}, {where}{devices}")
        print(row(*(name for name, _ in COLUMNS)))
        print(row(*("-" * max(width, 6) for _, width in COLUMNS)))
    passed = failed = 0
    skipped = []
    for index, case in enumerate(cases(n)):
        outcomes = run_case(comms, case, seed=index * 10_000)
        bad = [message is not None for message in outcomes]
        messages = [message for message in outcomes if message is not None]
        if world is not None:  # a variant failed if it failed on any rank
            from mpi4py import MPI
            flags = np.array(bad, dtype=np.int64)
            world.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
            bad = [bool(flag) for flag in flags]
            gathered = world.gather(messages, root=0)
            messages = [m for per_rank in (gathered or []) for m in per_rank]
            case.skipped = world.bcast(case.skipped, root=0)
        case.failed = sum(1 for flag in bad if flag)
        case.passed = len(bad) - case.failed
        passed, failed = passed + case.passed, failed + case.failed
        if case.skipped:
            skipped.append(case)
        if leader:
            if case.skipped:
                result = f"skipped ({case.skipped})"
            elif case.failed:
                result = f"FAILED {case.failed} of {len(bad)}"
            else:
                result = "ok" if len(bad) == 1 else f"ok ({len(bad)} checks)"
            print(row(case.collective, case.form, case.dtype, case.count if case.dtype else "",
                      case.variants, result), flush=True)
            for message in messages:
                print(f"    {message}", flush=True)
    for comm in comms:
        comm.close()
    if leader:
        if skipped:
            print(f"{len(skipped)} rows skipped: " +
                  "; ".join(f"{c.collective} {c.dtype} ({c.skipped})" for c in skipped))
        print(f"took {time.monotonic() - start:.1f} s")
        print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
