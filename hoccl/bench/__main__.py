"""python -m hoccl.bench: bus bandwidth of hoccl and NCCL side by side, nccl-tests style.

  mpirun -np 2 python -m hoccl.bench                     # hoccl, NCCL (torch.distributed,
                                                          # nccl4py) and NCCL's zero-SM mode
  python -m hoccl.bench --local 2                         # one process, hoccl only

Prints one table per collective (time in µs, algbw and busbw in GB/s = 1e9 B/s,
#wrong elements after a checked run), the ratio of hoccl's busbw to the best NCCL
figure of the same size and form, and writes JSON and PNG plots to --out.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List

from ._harness import (COLLECTIVES, FORMS, bus_factor, count_wrong, human, libraries,
                       make_buffers, metadata, parse_size, report, require, setup_ranks,
                       time_graph, time_loop)

__all__ = ["main", "sweep", "table", "plots"]


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hoccl.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local", type=int, default=0, metavar="N",
                        help="drive N GPUs from this one process (hoccl only); default: one "
                             "rank per mpirun process")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES),
                        help="comma-separated subset of %(default)s")
    parser.add_argument("--libraries",
                        default="hoccl,hoccl-peer,hoccl+copy_sms=8,hoccl+max_sms=32,nccl,nccl4py,"
                                "nccl-zero",
                        help="comma-separated: hoccl (default options), hoccl-auto (each "
                             "call's path from the machine's tuning table, nothing set), "
                             "hoccl-peer / hoccl-local "
                             "(out-of-place own block through the peer / on capped SMs), any "
                             "of them +max_sms=N+copy_sms=N+chunk_bytes=S (variants changing "
                             "only copy_sms or max_sms run only where it matters), nccl "
                             "(torch.distributed), "
                             "nccl4py, nccl-zero (NCCL CTA policy ZERO, symmetric windows)")
    parser.add_argument("--min-bytes", default="1K", help="smallest size (nccl-tests' size)")
    parser.add_argument("--max-bytes", default="1G", help="largest size")
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
    parser.add_argument("--graph", action="store_true",
                        help="also time each library's calls captured into a CUDA graph (20 "
                             "calls per graph, replayed back to back): rows LIBRARY+graph")
    parser.add_argument("--out", default="results/bench", help="folder for JSON and PNG")
    return parser.parse_args(argv)


def sweep(args: argparse.Namespace):
    """Returns (result, whether this process reports)."""
    import torch
    ranks = setup_ranks(args.local, max_sms=args.max_sms,
                        chunk_bytes=parse_size(args.chunk_bytes))
    dtype = getattr(torch, args.dtype)
    libs = libraries(ranks, args.libraries.split(","))
    sizes, size = [], parse_size(args.min_bytes)
    while size <= parse_size(args.max_bytes):
        sizes.append(size)
        size *= args.factor
    if args.sizes:
        sizes = [parse_size(text) for text in args.sizes.split(",")]
    forms = args.forms.split(",")
    # a dedicated stream per rank for every library (NCCL's copy-engine mode refuses the
    # legacy default stream)
    streams = [torch.cuda.Stream(device=device) for device in ranks.devices]
    records: List[Dict[str, Any]] = []
    n = ranks.world_size
    ranks.say(f"# hoccl.bench: {n} ranks, {args.dtype}, libraries "
              f"{', '.join(lib.name for lib in libs)}")
    for collective in args.collectives.split(","):
        for form in FORMS[collective]:
            if form not in forms:
                continue
            for nbytes in sizes:
                for lib in libs:
                    if not lib.supports(collective, form):
                        continue
                    lib.prepare()
                    buffers = make_buffers(lib, ranks, collective, form, nbytes, dtype)
                    try:
                        wrong = count_wrong(lib, ranks, collective, form, buffers, dtype,
                                            lambda i: streams[i])
                    except Exception as error:  # a baseline that cannot run this size
                        ranks.say(f"  {collective:14s} {form:3s} {human(nbytes):>5s} "
                                  f"{lib.name:11s} failed: {error}")
                        records.append(dict(collective=collective, form=form, bytes=nbytes,
                                            library=lib.name, error=str(error)))
                        continue
                    probe = time_loop(lib, ranks, collective, buffers, 3, 1, lambda i: streams[i])
                    iters = int(min(200, max(5, args.time_budget / max(probe * 1e-6, 1e-9))))
                    iters = int(ranks.max(iters))
                    # warm up for ~0.1 s first: the GPUs' clocks ramp up from idle, and the
                    # first library at a size would otherwise be timed while they do
                    warmup = int(ranks.max(max(args.warmup, 0.1 / max(probe * 1e-6, 1e-9))))
                    micros = time_loop(lib, ranks, collective, buffers, iters,
                                       min(warmup, 400), lambda i: streams[i])
                    algbw = nbytes / (micros * 1e-6) / 1e9
                    record = dict(collective=collective, form=form, bytes=nbytes,
                                  library=lib.name, time_us=micros, algbw=algbw,
                                  busbw=algbw * bus_factor(collective, n), wrong=wrong,
                                  iters=iters, sms=lib.sms_for(collective, nbytes))
                    records.append(record)
                    ranks.say(f"  {collective:14s} {form:3s} {human(nbytes):>5s} {lib.name:11s} "
                              f"{micros:10.1f} us {record['busbw']:7.1f} GB/s  wrong {wrong}")
                    if args.graph:
                        records.append(graph_record(lib, ranks, collective, form, nbytes,
                                                    buffers, dtype, streams, record))
                    lib.release()
                    del buffers
                    torch.cuda.empty_cache()
    return ({"meta": metadata(sys.argv), "world_size": n, "dtype": args.dtype,
             "records": records}, ranks.leader)


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
        header = "| size | " + " | ".join(names) + " | hoccl / best NCCL |"
        lines += [header, "|" + "---|" * (len(names) + 2)]
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
    require("python -m hoccl.bench", args.local)
    result, leader = sweep(args)
    if leader:
        report(result, args.out, "bench", table(result))
        try:
            for path in plots(result, args.out):
                print("wrote", path)
        except ImportError as error:
            print(f"# plots skipped: {error}")


if __name__ == "__main__":
    main()
