"""Host time of one FSDP2 all-gather (or reduce-scatter) hook call, piece by piece.

Run: ``mpirun -np 2 python tools/hook_cost.py [--size 64M] [--iters 300] [--burst 50]
[--device cpu] [--profile]``

Calls ``hoccl.torch.AllGather`` (registered memory, in place, as FSDP2 does) back to back
on FSDP2's pattern of streams, and times on the host: the whole hook call, hoccl's
``Communicator.all_gather`` inside it, the pool's shadows, and ``Launcher.run``'s torch
work (stream switch, event, Work).  Each rank prints µs per call of each.  With ``--device
cpu`` the tensors are CPU tensors and the calls run on the host backend (no GPU needed): the
figures are then the Python side of the path, which the GPU shares, plus the host
backend's worker threads.  ``--profile`` adds a cProfile of rank 0's timed calls, sorted by
own time.
"""

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import time

import torch
import torch.distributed as dist

import hoccl.torch  # noqa: F401  registers the backend
from hoccl.torch import _fsdp, _work
from hoccl.bench._harness import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="64M", help="bytes of the all-gather output")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--burst", type=int, default=0,
                        help="time the calls in bursts of this many, synchronizing between "
                             "bursts (not timed): the host's own cost where the GPU cannot "
                             "keep up (two ranks on one GPU)")
    parser.add_argument("--collective", choices=("all_gather", "reduce_scatter"),
                        default="all_gather",
                        help="reduce_scatter: FSDP2's gradient reduce-scatter (fp32, AVG) "
                             "beside an all-gather hook's registered pool, as in training")
    parser.add_argument("--async-op", action="store_true",
                        help="async_op=True (the call on the group's side stream, then wait)")
    parser.add_argument("--settings", default="",
                        help="the group's hoccl settings (pg_options), e.g. pull_bytes=64M; "
                             "sizes may say K, M or G")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: CPU tensors on the host backend")
    parser.add_argument("--profile", action="store_true",
                        help="print a cProfile of rank 0's timed calls")
    args = parser.parse_args()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", 0)))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", 1)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    gpu = args.device == "cuda"
    if gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    settings = {}
    for item in filter(None, args.settings.split(",")):
        key, _, value = item.partition("=")
        settings[key] = parse_size(value)
    dist.init_process_group("hoccl", rank=rank, world_size=world,
                            pg_options=hoccl.torch.Options(settings=settings))
    group = dist.group.WORLD
    gather = _fsdp.AllGather(group, registered=True)
    hook = gather if args.collective == "all_gather" else _fsdp.ReduceScatter(group)
    comm = hook.comm
    method = f"comm.{args.collective}"
    spent = {"hook": 0.0, method: 0.0, "pool.shadow": 0.0, "Launcher.run": 0.0}
    # where the calls went: the caller's stream itself, or the lanes
    executor, placed = comm._engine.executor, {"on the caller's stream": 0, "on the lanes": 0}

    def counted(name, function):
        def wrapper(*a, **k):
            placed[name] += 1
            return function(*a, **k)
        return wrapper
    executor.issue_on_caller = counted("on the caller's stream", executor.issue_on_caller)
    executor.issue = counted("on the lanes", executor.issue)

    def timed(name, function):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                spent[name] += time.perf_counter() - start
        return wrapper
    setattr(comm, args.collective, timed(method, getattr(comm, args.collective)))
    hook.pool.shadow = timed("pool.shadow", hook.pool.shadow)
    _work.Launcher.run = timed("Launcher.run", _work.Launcher.run)
    cuda = torch.device(args.device)
    stream = torch.cuda.Stream() if gpu else None
    if args.collective == "all_gather":
        count = parse_size(args.size) // 2
        block = count // world
        output = hook.allocate((count,), dtype=torch.bfloat16, device=cuda)
        output.zero_()

        def issue():
            return hook(output, output[rank * block:(rank + 1) * block], group,
                        async_op=args.async_op)
    else:
        gather.allocate((1 << 20,), dtype=torch.bfloat16, device=cuda)  # FSDP2's pool
        count = parse_size(args.size) // 4
        input = hook.allocate((count,), dtype=torch.float32, device=cuda)
        input.normal_()
        output = hook.allocate((count // world,), dtype=torch.float32, device=cuda)

        def issue():
            return hook(output, input, group, op=dist.ReduceOp.AVG, async_op=args.async_op)

    def call():
        with torch.cuda.stream(stream) if gpu else contextlib.nullcontext():
            work = issue()
            if work is not None:
                work.wait()
    synchronize = torch.cuda.synchronize if gpu else comm.synchronize
    for _ in range(20):
        call()
    synchronize()
    for key in spent:
        spent[key] = 0.0
    for key in placed:
        placed[key] = 0
    profiler = cProfile.Profile() if args.profile and rank == 0 else None
    start = time.perf_counter()
    burst = args.burst or args.iters
    for index in range(args.iters):
        if index and index % burst == 0:
            synchronize()
        begin = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        call()
        if profiler is not None:
            profiler.disable()
        spent["hook"] += time.perf_counter() - begin
    host = spent["hook"] if args.burst else time.perf_counter() - start
    synchronize()
    total = time.perf_counter() - start
    what = ("in-place all-gather" if args.collective == "all_gather"
            else "reduce-scatter (fp32, AVG)")
    print(f"rank {rank}: {args.size} {what} through the FSDP hook "
          f"(async_op={args.async_op}{', ' + args.settings if args.settings else ''}), "
          f"{args.iters} "
          f"calls: host {host / args.iters * 1e6:.1f} µs per call, with the GPU "
          f"{total / args.iters * 1e6:.1f}; " + ", ".join(
              f"{name} {value / args.iters * 1e6:.1f}" for name, value in spent.items())
          + "; calls " + ", ".join(f"{count} {name}" for name, count in placed.items()),
          flush=True)
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
