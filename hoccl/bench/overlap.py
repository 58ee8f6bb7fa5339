"""python -m hoccl.bench.overlap: what communication costs the compute beside it.

On every rank a bf16 GEMM loop (M=N=K=8192 by default, torch) runs on the compute
stream while a collective loops on another stream.  For each library and
collective it reports the GEMM's TFLOP/s alone and beside the loop (the slowdown),
and the collective's bus bandwidth meanwhile.  Every library runs the same GEMM,
the same sizes and the same loop in this one run.

  mpirun -np 2 python -m hoccl.bench.overlap
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Dict, List

from ._harness import (bus_factor, human, make_buffers, metadata, parse_size, report, require,
                       setup_ranks, time_loop)
from ._libraries import libraries

__all__ = ["main", "run", "table"]


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hoccl.bench.overlap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local", type=int, default=0, metavar="N",
                        help="drive N GPUs from one process (hoccl only)")
    parser.add_argument("--cases", default="all_gather:in,all_gather:out,all_to_all:out,"
                        "reduce_scatter:out,all_reduce:in",
                        help="comma-separated collective:form (form: in or out)")
    parser.add_argument("--libraries", default="hoccl,hoccl-peer,hoccl+copy_sms=8,hoccl+max_sms=4,"
                        "hoccl+max_sms=32+copy_sms=32,hoccl+max_sms=32+chunk_bytes=128M,"
                        "hoccl-reg,nccl,nccl4py,nccl-zero",
                        help="as for python -m hoccl.bench")
    parser.add_argument("--bytes", default="1G", help="collective size (nccl-tests' size)")
    parser.add_argument("--gemm", type=int, default=8192, help="M = N = K of the GEMM")
    parser.add_argument("--gemms", type=int, default=60, help="GEMMs per measurement")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-sms", type=int, default=8, help="hoccl's SM cap for sums")
    parser.add_argument("--chunk-bytes", default="32M", help="hoccl's pipeline chunk for sums")
    parser.add_argument("--out", default="results/overlap")
    return parser.parse_args(argv)


def _gemm_span(ranks, operands, count: int, streams) -> float:
    """Seconds the slowest rank takes for ``count`` GEMMs enqueued back to back."""
    import torch
    events = []
    for index, (a, b, c) in enumerate(operands):
        with torch.cuda.stream(streams[index]):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(count):
                torch.matmul(a, b, out=c)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.append((start, end))
    worst = 0.0
    for start, end in events:
        end.synchronize()
        worst = max(worst, start.elapsed_time(end) / 1000)
    return ranks.max(worst)


def run(args: argparse.Namespace):
    import torch
    ranks = setup_ranks(args.local, max_sms=args.max_sms,
                        chunk_bytes=parse_size(args.chunk_bytes))
    dtype = getattr(torch, args.dtype)
    nbytes = parse_size(args.bytes)
    m = args.gemm
    flops = 2.0 * m * m * m
    compute, comm_streams, operands = [], [], []
    for device in ranks.devices:
        with torch.cuda.device(device):
            compute.append(torch.cuda.Stream(device=device))
            comm_streams.append(torch.cuda.Stream(device=device))
            a = torch.randn(m, m, dtype=dtype, device=f"cuda:{device}")
            b = torch.randn(m, m, dtype=dtype, device=f"cuda:{device}")
            operands.append((a, b, torch.empty(m, m, dtype=dtype, device=f"cuda:{device}")))
    _gemm_span(ranks, operands, 5, compute)  # warm up cuBLAS
    alone = _gemm_span(ranks, operands, args.gemms, compute)
    tflops_alone = flops * args.gemms / alone / 1e12
    ranks.say(f"# GEMM {m}^3 {args.dtype} alone: {tflops_alone:.0f} TFLOP/s "
              f"({alone / args.gemms * 1e3:.2f} ms each)")
    libs = libraries(ranks, args.libraries.split(","))
    records: List[Dict[str, Any]] = []
    n = ranks.world_size
    for case in args.cases.split(","):
        collective, form = case.split(":")
        for lib in libs:
            if not lib.supports(collective, form):
                continue
            lib.prepare()
            buffers = make_buffers(lib, ranks, collective, form, nbytes, dtype)
            comm_alone = time_loop(lib, ranks, collective, buffers, 10, 2,
                                   lambda i: comm_streams[i]) * 1e-6
            # enough collectives to outlast the GEMM loop even if they run at full speed
            loops = int(ranks.max(math.ceil(alone * 1.3 / comm_alone) + 2))
            for device in ranks.devices:
                torch.cuda.synchronize(device)
            ranks.barrier()
            comm_events = []
            for index in range(len(ranks.comms)):
                start = torch.cuda.Event(enable_timing=True)
                start.record(comm_streams[index])
                comm_events.append([start, None])
            # the whole GEMM loop first: a collective call may block the host (a full launch
            # queue), and that must not starve the GEMM stream and pass for interference
            gemm_events = []
            for index, (a, b, c) in enumerate(operands):
                start = torch.cuda.Event(enable_timing=True)
                start.record(compute[index])
                gemm_events.append([start, None])
                with torch.cuda.stream(compute[index]):
                    for _ in range(args.gemms):
                        torch.matmul(a, b, out=c)
            for step in range(loops):
                for index, (send, recv, _) in enumerate(buffers):
                    lib.run(index, collective, send, recv, comm_streams[index])
            for index in range(len(ranks.comms)):
                end = torch.cuda.Event(enable_timing=True)
                end.record(compute[index])
                gemm_events[index][1] = end
                end = torch.cuda.Event(enable_timing=True)
                end.record(comm_streams[index])
                comm_events[index][1] = end
            gemm_span = comm_span = 0.0
            for (gs, ge), (cs, ce) in zip(gemm_events, comm_events):
                assert gs is not None and ge is not None and cs is not None and ce is not None
                ge.synchronize()
                ce.synchronize()
                gemm_span = max(gemm_span, gs.elapsed_time(ge) / 1000)
                comm_span = max(comm_span, cs.elapsed_time(ce) / 1000)
            gemm_span, comm_span = ranks.max(gemm_span), ranks.max(comm_span)
            tflops = flops * args.gemms / gemm_span / 1e12
            busbw = nbytes * loops / comm_span / 1e9 * bus_factor(collective, n)
            busbw_alone = nbytes / comm_alone / 1e9 * bus_factor(collective, n)
            record = dict(collective=collective, form=form, library=lib.name, bytes=nbytes,
                          gemm_tflops=tflops, gemm_tflops_alone=tflops_alone,
                          slowdown_pct=100 * (tflops_alone / tflops - 1),
                          busbw_during=busbw, busbw_alone=busbw_alone, loops=loops,
                          comm_outlasted_gemm=comm_span >= gemm_span * 0.95, sms=lib.sms)
            records.append(record)
            ranks.say(f"  {collective:14s} {form:3s} {lib.name:11s} GEMM {tflops:6.0f} TFLOP/s "
                      f"(-{record['slowdown_pct']:.1f} %)  comm {busbw:6.1f} GB/s meanwhile "
                      f"({busbw_alone:.1f} alone)")
            lib.release()
            del buffers
            torch.cuda.empty_cache()
    result = {"meta": metadata(sys.argv), "world_size": n, "dtype": args.dtype,
              "bytes": nbytes, "gemm": m, "gemm_tflops_alone": tflops_alone, "records": records}
    return result, ranks.leader


def table(result: Dict[str, Any]) -> str:
    lines = [f"GEMM {result['gemm']}^3 {result['dtype']} alone: "
             f"{result['gemm_tflops_alone']:.0f} TFLOP/s; collectives of {human(result['bytes'])}, "
             f"{result['world_size']} ranks",
             "| collective | form | library | GEMM TFLOP/s | GEMM slowdown | busbw meanwhile | "
             "busbw alone | SMs |", "|---|---|---|---|---|---|---|---|"]
    for r in result["records"]:
        lines.append(f"| {r['collective']} | {r['form']} | {r['library']} | "
                     f"{r['gemm_tflops']:.0f} | {r['slowdown_pct']:.1f} % | "
                     f"{r['busbw_during']:.1f} | {r['busbw_alone']:.1f} | {r['sms']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = arguments(argv)
    require("python -m hoccl.bench.overlap", args.local)
    result, leader = run(args)
    if leader:
        report(result, args.out, "overlap", table(result))


if __name__ == "__main__":
    main()
