"""python -m hoccl.bench.host_cost: the host's time per repeated call, hoccl beside
torch.distributed on NCCL in the same run.

  python -m hoccl.bench.host_cost                    # world 1 in one process, every variant
  mpirun -np 2 python -m hoccl.bench.host_cost       # hoccl per rank (NCCL takes one rank
                                                      # per GPU; it runs where it can)
  python -m hoccl.bench.host_cost --backend host     # no GPU: the host backend's path

A call is repeated in bursts of ``--burst`` without synchronizing, the burst timed by the
host's clock, then synchronized untimed; the figure is the median burst's time per call
(and the process CPU time per call beside it). This is the host's own cost of a call that
the device keeps up with or queues: what a small or frequent call (tensor parallelism,
decoding, a bucketed gradient) pays on the CPU whatever the GPU does.

Variants: ``hoccl-registered`` (buffers from ``hoccl.empty``), ``hoccl-plain`` (tensors of
the framework's allocator, the same ones every call), ``hoccl-direct`` (registered, calls
up to the size as direct kernels: ``kernel_bytes``), ``nccl`` (torch.distributed, world 1
in this process, CUDA only), and two floors on CUDA: ``torch-copy`` (one
``tensor.copy_``) and ``graph-replay`` (an empty captured CUDA graph replayed).
Each hoccl call is the one torch.distributed makes: all_gather and reduce_scatter out of
place, all_reduce in place (``in_place`` in the JSON).
Writes ``host_cost.json`` and ``host_cost.md`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

from ._harness import metadata, parse_size, report

__all__ = ["main", "measure"]

COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter")


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hoccl.bench.host_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1M", help="bytes of each rank's output")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--burst", type=int, default=50, help="calls per timed burst")
    parser.add_argument("--bursts", type=int, default=20, help="timed bursts per figure")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--variants", default="hoccl-registered,hoccl-plain,hoccl-direct,nccl,"
                        "torch-copy,graph-replay")
    parser.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--out", default="results/host_cost")
    args = parser.parse_args(argv)
    if args.burst < 1 or args.bursts < 1:
        parser.error(f"--burst and --bursts must be >= 1; got {args.burst} and {args.bursts}")
    unknown = set(args.collectives.split(",")) - set(COLLECTIVES)
    if unknown:
        parser.error(f"--collectives: unknown {sorted(unknown)}; expected some of {COLLECTIVES}")
    return args


def measure(call: Callable[[], Any], sync: Callable[[], Any], burst: int,
            bursts: int) -> Dict[str, float]:
    """Host µs per call: the median and the least burst by the wall clock, and the median
    by the process's CPU time."""
    for _ in range(3):  # warm: the first calls prepare and bind
        call()
    sync()
    walls: List[float] = []
    cpus: List[float] = []
    for _ in range(bursts):
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(burst):
            call()
        walls.append((time.perf_counter() - wall) / burst * 1e6)
        cpus.append((time.process_time() - cpu) / burst * 1e6)
        sync()
    return {"us_per_call": statistics.median(walls), "min_us": min(walls),
            "cpu_us_per_call": statistics.median(cpus)}


def _buffers(collective: str, count: int, n: int, make: Callable[[int], Any]):
    """(send, recv) of ``count`` output elements per rank (all_gather: the input is a
    block; reduce_scatter: the output is)."""
    if collective == "all_gather":
        return make(count // n), make(count - count % n)
    if collective == "reduce_scatter":
        return make(count * n), make(count)
    return make(count), make(count)


def _hoccl_rows(comm: Any, args: argparse.Namespace, collectives: List[str], count: int,
                variants: List[str]) -> List[Dict[str, Any]]:
    import hoccl
    rows = []
    n = comm.world_size
    cuda = comm.backend == "cuda"
    if cuda:
        import torch
        dtype = getattr(torch, args.dtype)
        stream = torch.cuda.current_stream()

        def plain(elements):
            return torch.zeros(elements, dtype=dtype, device=f"cuda:{comm.device}")

        def sync():
            comm.synchronize()
            stream.synchronize()
    else:
        import numpy as np
        dtype = np.dtype("float32" if args.dtype == "bfloat16" else args.dtype)

        def plain(elements):
            return np.zeros(elements, dtype=dtype)

        def sync():
            comm.synchronize()

    def registered(elements):
        return hoccl.empty(elements, args.dtype if cuda else dtype.name, comm,
                           framework="torch" if cuda else None)

    for variant in variants:
        if not variant.startswith("hoccl-") or (variant == "hoccl-direct" and not cuda):
            continue
        make = plain if variant == "hoccl-plain" else registered
        kernel_bytes = count * (2 if args.dtype in ("bfloat16", "float16") else 4) \
            if variant == "hoccl-direct" else 0
        comm.set_options(kernel_bytes=kernel_bytes)
        for collective in collectives:
            send, recv = _buffers(collective, count, n, make)
            if collective == "all_reduce":  # in place, as torch.distributed's
                send = recv
            method = getattr(comm, collective)
            figure = measure(lambda: method(send, recv), sync, args.burst, args.bursts)
            rows.append({"variant": variant, "collective": collective, "world": n,
                         "rank": comm.rank, "in_place": send is recv, **figure})
    comm.set_options(kernel_bytes=0)
    return rows


def _nccl_rows(args: argparse.Namespace, collectives: List[str], count: int
               ) -> List[Dict[str, Any]]:
    """torch.distributed on NCCL with one rank in this process (a store of its own)."""
    import torch
    import torch.distributed as dist
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    rows = []
    try:
        dtype = getattr(torch, args.dtype)
        device = torch.device("cuda", torch.cuda.current_device())
        for collective in collectives:
            send, recv = _buffers(collective, count, 1,
                                  lambda elements: torch.zeros(elements, dtype=dtype,
                                                               device=device))
            calls = {"all_gather": lambda: dist.all_gather_into_tensor(recv, send),
                     "all_reduce": lambda: dist.all_reduce(recv),
                     "reduce_scatter": lambda: dist.reduce_scatter_tensor(recv, send)}
            figure = measure(calls[collective], torch.cuda.synchronize, args.burst,
                             args.bursts)
            rows.append({"variant": "nccl", "collective": collective, "world": 1, "rank": 0,
                         "in_place": collective == "all_reduce", **figure})
    finally:
        dist.destroy_process_group()
    return rows


def _floor_rows(args: argparse.Namespace, count: int, variants: List[str]
                ) -> List[Dict[str, Any]]:
    import torch
    dtype = getattr(torch, args.dtype)
    rows = []
    if "torch-copy" in variants:
        a = torch.zeros(count, dtype=dtype, device="cuda")
        b = torch.zeros(count, dtype=dtype, device="cuda")
        rows.append({"variant": "torch-copy", "collective": "copy_", "world": 1, "rank": 0,
                     **measure(lambda: b.copy_(a), torch.cuda.synchronize, args.burst,
                               args.bursts)})
    if "graph-replay" in variants:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            with torch.cuda.graph(graph):
                pass
        rows.append({"variant": "graph-replay", "collective": "(empty graph)", "world": 1,
                     "rank": 0, **measure(graph.replay, torch.cuda.synchronize, args.burst,
                                          args.bursts)})
    return rows


def table(rows: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"host µs per repeated call, {args.size} of {args.dtype}, bursts of {args.burst} "
             f"without synchronizing (median of {args.bursts} bursts; least; CPU time)",
             "",
             "| variant | collective | world | µs/call | least | CPU µs/call |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['variant']} | {row['collective']} | {row['world']} | "
                     f"{row['us_per_call']:.1f} | {row['min_us']:.1f} | "
                     f"{row['cpu_us_per_call']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = arguments(argv)
    import hoccl
    collectives = args.collectives.split(",")
    variants = args.variants.split(",")
    nbytes = parse_size(args.size)
    itemsize = 2 if args.dtype in ("bfloat16", "float16") else 4
    count = nbytes // itemsize
    comm = hoccl.init(backend=args.backend)
    if args.backend == "cuda":
        import torch
        torch.cuda.set_device(comm.device)
    rows = _hoccl_rows(comm, args, collectives, count, variants)
    world = comm.world_size
    rank = comm.rank
    comm.close()
    if world > 1:  # one rank per process: under mpirun
        from mpi4py import MPI
        everyone = MPI.COMM_WORLD.allgather(rows)
    else:
        everyone = [rows]
    if rank != 0:
        return 0
    rows = [row for ranks_rows in everyone for row in ranks_rows]
    if args.backend == "cuda" and world == 1:
        if "nccl" in variants:
            try:
                rows += _nccl_rows(args, collectives, count)
            except Exception as error:  # report it, keep hoccl's figures
                print(f"nccl: not measured: {error!r}", file=sys.stderr)
        rows += _floor_rows(args, count, variants)
    result = {"meta": metadata(sys.argv) if args.backend == "cuda" else
              {"command": " ".join(sys.argv), "backend": "host"},
              "size": nbytes, "dtype": args.dtype, "burst": args.burst, "bursts": args.bursts,
              "rows": rows}
    report(result, args.out, "host_cost", table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
