"""python -m hoccl.bench: bus bandwidth of hoccl and NCCL side by side, nccl-tests style.

  mpirun -np 2 python -m hoccl.bench                     # hoccl, NCCL (torch.distributed,
                                                          # nccl4py) and NCCL's zero-SM mode
  python -m hoccl.bench --local 2                         # one process, hoccl only
  python -m hoccl.bench --local 2 --backend host          # no GPU: hoccl's host backend
  mpirun -np 2 python -m hoccl.bench --rounds 3          # each library's median of 3 rounds

Prints one table per collective (time in µs, algbw and busbw in GB/s = 1e9 B/s,
#wrong elements after a checked run), the ratio of hoccl's busbw to the best NCCL
figure of the same size and form, and writes JSON, the Markdown table and PNG plots (with
the bench extra, matplotlib) to --out.  The JSON and the table are rewritten after every
size, so a run stopped halfway leaves what it measured.

The defaults depend on the backend: on cuda every library up to 1 GiB; on host (CPU
tensors, timed by the host's clock) hoccl alone up to 4 MiB, a run of well under a minute
on 2 cores.  --libraries and --max-bytes override them.

Each (collective, form, size) times every library's loop of calls in turn.  With
--rounds R it does so R times (libraries A, B, C, then A, B, C again, ...) and records
each library's median round as its time, and every round's time as ``rounds_us``: on a
GPU that other processes share, one loop's time drifts by ±10 %, and libraries that
run the same path would otherwise differ by as much.  Results are checked in the first
round; a library that fails there is recorded once and left out of the later rounds.

``sendrecv`` is point to point: every rank sends its tensor to the next rank and receives
the previous rank's in one ``hoccl.group()`` (across hosts: the same local rank on the
next host and the one before).  Across hosts (``HOCCL_LOCAL_SIZE`` or real hosts under
mpirun) the default libraries add ``gloo`` (torch.distributed's gloo on the same tensors)
and the table a column hoccl / gloo:

  HOCCL_LOCAL_SIZE=1 mpirun -np 2 python -m hoccl.bench --backend host

On a job whose ranks are on different devices (GPU and CPU ranks as simulated hosts):
``python -m hoccl.bench.mixed``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from .._progress import Progress
from ._harness import (COLLECTIVES, FORMS, bus_factor, count_wrong, human, make_buffers,
                       metadata, parse_size, report, require, setup_ranks, time_graph,
                       time_loop)
from ._libraries import libraries

__all__ = ["main", "sweep", "table", "plots", "BACKEND_DEFAULTS"]

#: what --libraries and --max-bytes are on each backend when not given: the GPU-only
#: variants (SM caps, the own block's route) and NCCL mean nothing on the host backend, and
#: its sizes stop where a CPU's memory copies stop saying more
BACKEND_DEFAULTS = {
    "cuda": {"libraries": "hoccl,hoccl-peer,hoccl+copy_sms=8,hoccl+max_sms=32,nccl,nccl4py,"
                          "nccl-zero",
             "max_bytes": "1G"},
    "host": {"libraries": "hoccl", "max_bytes": "4M"},
}


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hoccl.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local", type=int, default=0, metavar="N",
                        help="drive N GPUs from this one process (hoccl only); default: one "
                             "rank per mpirun process")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES),
                        help="comma-separated subset of %(default)s")
    parser.add_argument("--libraries", default=None,
                        help="default: " + "; ".join(f"{backend}: {values['libraries']}" for
                                                     backend, values in BACKEND_DEFAULTS.items())
                             + ". Comma-separated: hoccl (default options), hoccl-auto (each "
                             "call's path from the machine's tuning table, nothing set), "
                             "hoccl-peer / hoccl-local "
                             "(out-of-place own block through the peer / on capped SMs), any "
                             "of them +max_sms=N+copy_sms=N+chunk_bytes=S (variants changing "
                             "only copy_sms or max_sms run only where it matters), nccl "
                             "(torch.distributed), "
                             "nccl4py, nccl-zero (NCCL CTA policy ZERO, symmetric windows)")
    parser.add_argument("--min-bytes", default="1K", help="smallest size (nccl-tests' size)")
    parser.add_argument("--max-bytes", default=None,
                        help="largest size (default: " + ", ".join(
                            f"{values['max_bytes']} on {backend}"
                            for backend, values in BACKEND_DEFAULTS.items()) + ")")
    parser.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    parser.add_argument("--sizes", default="", help="explicit comma-separated sizes (e.g. "
                        "1M,16M,256M,1G); overrides --min-bytes/--max-bytes/--factor")
    parser.add_argument("--forms", default="out,in", help="out (out-of-place), in (in-place)")
    parser.add_argument("--dtype", default="bfloat16", help="torch dtype name")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per measurement")
    parser.add_argument("--time-budget", type=float, default=0.05,
                        help="seconds of timed calls per measurement (5 to 200 calls)")
    parser.add_argument("--max-sms", type=int, default=8, help="hoccl's SM cap for sums and "
                        "local copies")
    parser.add_argument("--chunk-bytes", default="32M", help="hoccl's pipeline chunk for sums")
    parser.add_argument("--rounds", type=int, default=1, metavar="R",
                        help="time every library's loop R times in turn at each size and "
                             "record its median round (default %(default)s)")
    parser.add_argument("--graph", action="store_true",
                        help="also time each library's calls captured into a CUDA graph (20 "
                             "calls per graph, replayed back to back): rows LIBRARY+graph, "
                             "taken in the last round only")
    parser.add_argument("--backend", choices=("cuda", "host"), default="cuda",
                        help="host: CPU tensors on hoccl's host backend, hoccl only, timed "
                             "by the host's clock (a check of this program without GPUs; "
                             "its times say nothing about a GPU)")
    parser.add_argument("--out", default="results/bench",
                        help="folder for the JSON, the Markdown table and the PNG plots")
    args = parser.parse_args(argv)
    #: libraries left to the defaults: a job across hosts adds gloo to them
    args.default_libraries = args.libraries is None
    for name, value in BACKEND_DEFAULTS[args.backend].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1; got {args.rounds}")
    if args.graph and args.backend != "cuda":
        parser.error("--graph needs the cuda backend")
    return args


def sizes_of(args: argparse.Namespace) -> List[int]:
    """The sizes a run measures: --sizes, else --min-bytes to --max-bytes by --factor."""
    if args.sizes:
        return [parse_size(text) for text in args.sizes.split(",")]
    sizes, size = [], parse_size(args.min_bytes)
    while size <= parse_size(args.max_bytes):
        sizes.append(size)
        size *= args.factor
    return sizes


def points_of(args: argparse.Namespace) -> List[Tuple[str, str, int]]:
    """Every (collective, form, size) a run measures, in the order it measures them."""
    forms = args.forms.split(",")
    return [(collective, form, nbytes) for collective in args.collectives.split(",")
            for form in FORMS[collective] if form in forms for nbytes in sizes_of(args)]


def sweep(args: argparse.Namespace, written: Optional[Callable[[Dict[str, Any]], None]] = None):
    """Returns (result, whether this process reports).  ``written(result)`` is called
    with the result so far after every (collective, form, size) on the reporting rank."""
    import torch
    ranks = setup_ranks(args.local, backend=args.backend, max_sms=args.max_sms,
                        chunk_bytes=parse_size(args.chunk_bytes))
    files = "JSON, table and plots" if importlib.util.find_spec("matplotlib") else "JSON and table"
    ranks.say(f"# hoccl.bench: {len(points_of(args))} sizes to measure; {files} go to "
              f"{args.out}/ as they come")
    dtype = getattr(torch, args.dtype)
    wanted = args.libraries.split(",")
    if getattr(args, "default_libraries", False) and ranks.local_size < ranks.world_size \
            and ranks.mpi is not None:
        wanted.append("gloo")  # across hosts, beside the library every torch job has
    libs = libraries(ranks, wanted)
    # a dedicated stream per rank for every library (NCCL's copy-engine mode refuses the
    # legacy default stream); the host backend takes none
    streams = ([torch.cuda.Stream(device=device) for device in ranks.devices]
               if ranks.backend == "cuda" else [None] * len(ranks.comms))
    records: List[Dict[str, Any]] = []
    result = {"meta": metadata(sys.argv), "world_size": ranks.world_size,
              "local_size": ranks.local_size or ranks.world_size, "dtype": args.dtype,
              "backend": args.backend, "rounds": args.rounds, "records": records}
    ranks.say(f"# hoccl.bench: {ranks.world_size} ranks, {args.dtype}, libraries "
              f"{', '.join(lib.name for lib in libs)}"
              + (f", median of {args.rounds} rounds" if args.rounds > 1 else ""))
    points = points_of(args)
    with Progress(ranks.leader, len(points), "size") as progress:
        ranks.write = lambda text: progress.say(text, file=sys.stdout)
        try:
            for collective, form, nbytes in points:
                records += measure(args, ranks, libs, collective, form, nbytes, dtype, streams)
                progress.step(f"{collective} {form} {human(nbytes)}")
                if written is not None and ranks.leader:
                    written(result)
        finally:
            ranks.write = None
    return result, ranks.leader


def measure(args, ranks, libs, collective, form, nbytes, dtype, streams) -> List[Dict[str, Any]]:
    """The records of one collective, form and size: each library's loop of calls timed
    in turn, ``args.rounds`` times over, its median round as its time.  The first round
    checks every library's result and sets its number of calls per loop; a library that
    fails there gives one error record and no more rounds."""
    import torch
    n = ranks.world_size

    def stream_of(index):
        return streams[index]
    running = [lib for lib in libs if lib.supports(collective, form)]
    # per library: (wrong elements, calls per loop, warm-up calls, each round's µs)
    measured: Dict[Any, Tuple[int, int, int, List[float]]] = {}
    records: List[Dict[str, Any]] = []
    for round_index in range(args.rounds):
        for lib in list(running):
            lib.prepare()
            buffers = make_buffers(lib, ranks, collective, form, nbytes, dtype)
            if round_index == 0:
                try:
                    wrong = count_wrong(lib, ranks, collective, form, buffers, dtype, stream_of)
                except Exception as error:  # a baseline that cannot run this size
                    ranks.say(f"  {collective:14s} {form:3s} {human(nbytes):>5s} "
                              f"{lib.name:11s} failed: {error}")
                    records.append(dict(collective=collective, form=form, bytes=nbytes,
                                        library=lib.name, error=str(error)))
                    running.remove(lib)
                    continue
                probe = time_loop(lib, ranks, collective, buffers, 3, 1, stream_of)
                iters = int(min(200, max(5, args.time_budget / max(probe * 1e-6, 1e-9))))
                iters = int(ranks.max(iters))
                # warm up for ~0.1 s first: the GPUs' clocks ramp up from idle, and the
                # first library at a size would otherwise be timed while they do
                warmup = int(ranks.max(max(args.warmup, 0.1 / max(probe * 1e-6, 1e-9))))
                measured[lib] = (wrong, iters, min(warmup, 400), [])
            wrong, iters, warmup, rounds = measured[lib]
            rounds.append(time_loop(lib, ranks, collective, buffers, iters, warmup, stream_of))
            if round_index == args.rounds - 1:
                micros = statistics.median(rounds)
                algbw = nbytes / (micros * 1e-6) / 1e9
                record = dict(collective=collective, form=form, bytes=nbytes,
                              library=lib.name, time_us=micros, rounds_us=rounds, algbw=algbw,
                              busbw=algbw * bus_factor(collective, n), wrong=wrong,
                              iters=iters, sms=lib.sms_for(collective, nbytes))
                records.append(record)
                spread = ("  rounds " + ",".join(f"{value:.1f}" for value in rounds) + " us"
                          if len(rounds) > 1 else "")
                ranks.say(f"  {collective:14s} {form:3s} {human(nbytes):>5s} {lib.name:11s} "
                          f"{micros:10.1f} us {record['busbw']:7.1f} GB/s  wrong {wrong}"
                          + spread)
                if args.graph:
                    records.append(graph_record(lib, ranks, collective, form, nbytes,
                                                buffers, dtype, streams, record))
            lib.release()
            del buffers
            torch.cuda.empty_cache()
    return records


def graph_record(lib, ranks, collective, form, nbytes, buffers, dtype, streams, eager):
    """The same calls captured into a CUDA graph: a record of library ``NAME+graph``."""
    n = ranks.world_size
    name = f"{lib.name}+graph"
    try:
        replays = max(2, min(50, eager["iters"] // 20 + 2))
        micros, replay = time_graph(lib, ranks, collective, buffers, 20, replays,
                                    lambda i: streams[i])
        wrong = count_wrong(lib, ranks, collective, form, buffers, dtype,
                            lambda i: streams[i], run=replay)
    except Exception as error:  # a library that cannot be captured, or not at this size
        ranks.say(f"  {collective:14s} {form:3s} {human(nbytes):>5s} {name:11s} failed: "
                  f"{type(error).__name__}: {str(error)[:200]}")
        return dict(collective=collective, form=form, bytes=nbytes, library=name,
                    error=f"{type(error).__name__}: {error}")
    algbw = nbytes / (micros * 1e-6) / 1e9
    record = dict(collective=collective, form=form, bytes=nbytes, library=name, time_us=micros,
                  algbw=algbw, busbw=algbw * bus_factor(collective, n), wrong=wrong,
                  iters=20 * replays, sms=lib.sms_for(collective, nbytes))
    ranks.say(f"  {collective:14s} {form:3s} {human(nbytes):>5s} {name:11s} "
              f"{micros:10.1f} us {record['busbw']:7.1f} GB/s  wrong {wrong}")
    return record


def table(result: Dict[str, Any]) -> str:
    """One block per collective and form: a row per size, a column pair per library."""
    records = [r for r in result["records"] if "error" not in r]
    lines = []
    keys = sorted({(r["collective"], r["form"]) for r in records},
                  key=lambda k: (COLLECTIVES.index(k[0]), k[1]))
    for collective, form in keys:
        rows = [r for r in records if r["collective"] == collective and r["form"] == form
                and "error" not in r]
        names = list(dict.fromkeys(r["library"] for r in rows))
        lines.append(f"\n## {collective} ({'in-place' if form == 'in' else 'out-of-place'}), "
                     f"busbw GB/s (time us), {result['world_size']} ranks {result['dtype']}")
        gloo = "gloo" in names
        header = "| size | " + " | ".join(names) + " | hoccl / best NCCL |" + (
            " hoccl / gloo |" if gloo else "")
        lines += [header, "|" + "---|" * (len(names) + 2 + gloo)]
        for nbytes in sorted({r["bytes"] for r in rows}):
            by_name = {r["library"]: r for r in rows if r["bytes"] == nbytes}
            cells = []
            for name in names:
                r = by_name.get(name)
                cells.append("" if r is None else
                             f"{r['busbw']:.1f} ({r['time_us']:.0f})" + (
                                 f" WRONG {r['wrong']}" if r["wrong"] else ""))
            nccl = [r["busbw"] for name, r in by_name.items() if name.startswith("nccl")]
            ratio = (f"{by_name['hoccl']['busbw'] / max(nccl):.2f}x"
                     if nccl and "hoccl" in by_name else "")  # default options vs best NCCL
            if gloo:
                over = (f"{by_name['hoccl']['busbw'] / by_name['gloo']['busbw']:.2f}x"
                        if "hoccl" in by_name and "gloo" in by_name else "")
                ratio += f" | {over}"
            lines.append(f"| {human(nbytes)} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def plots(result: Dict[str, Any], folder: str) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    records = [r for r in result["records"] if "error" not in r]
    for collective in COLLECTIVES:
        rows = [r for r in records if r["collective"] == collective]
        if not rows:
            continue
        figure, axis = plt.subplots(figsize=(7, 4.5))
        for (name, form) in sorted({(r["library"], r["form"]) for r in rows}):
            series = sorted((r["bytes"], r["busbw"]) for r in rows
                            if r["library"] == name and r["form"] == form)
            axis.plot([s for s, _ in series], [b for _, b in series], marker="o",
                      linestyle="-" if name.startswith("hoccl") else "--",
                      label=f"{name} ({form}-of-place)" if form == "out" else f"{name} (in-place)")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("size (bytes)")
        axis.set_ylabel("bus bandwidth (GB/s)")
        axis.set_title(f"{collective}, {result['world_size']} x {result['meta']['gpu']}")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
        path = os.path.join(folder, f"{collective}.png")
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def main(argv=None) -> None:
    args = arguments(argv)
    require("python -m hoccl.bench", args.local, args.backend)

    def written(result: Dict[str, Any]) -> None:
        report(result, args.out, "bench", table(result), echo=False)
    try:
        result, leader = sweep(args, written)
    except KeyboardInterrupt:
        sys.exit(f"python -m hoccl.bench: stopped; what was measured is in {args.out}/")
    if leader:
        report(result, args.out, "bench", table(result))
        try:
            for path in plots(result, args.out):
                print("wrote", path)
        except ImportError:
            print("# plots skipped: matplotlib is not installed (pip install 'hoccl[bench]')")


if __name__ == "__main__":
    main()
