"""python -m hoccl.bench.tp: a tensor-parallel MLP layer with its communication hidden behind
its matmuls, on hoccl, on NCCL and on torch's async-TP, in one run.

The sequence-parallel MLP of tensor parallelism (Megatron-style, ``world_size`` ranks):
every rank holds ``tokens / world_size`` rows of the activations X (hidden wide), a
column shard W1 (hidden x ffn / world_size) and a row shard W2 (ffn / world_size x
hidden).  The naive program, per rank::

    X_full = all_gather(X)              # tokens x hidden
    Y      = X_full @ W1                # tokens x ffn/world_size
    Z      = Y @ W2                     # tokens x hidden, a partial sum
    out    = reduce_scatter(Z, "sum")   # tokens/world_size x hidden: this rank's rows

*Sequential* runs exactly that on one stream.  *C chunks overlapped* cuts every rank's
rows into C chunks: chunk c's all_gather runs on a side stream while the matmul of chunk
c-1 runs, and chunk c's reduce_scatter while the matmul of chunk c+1 runs::

    side     [AG 0][AG 1][AG 2][AG 3]          [RS 0]   [RS 1]   [RS 2]   [RS 3]
    compute        [X0@W1][X1@W1][X2@W1][X3@W1][Y0@W2]  [Y1@W2]  [Y2@W2]  [Y3@W2]

The gathered activations and the partial sums live chunk-major ([C, world_size, rows, *]):
chunk c of every rank is one contiguous block, so each collective is in place (the rank's
input rows sit in its own slots of the gather buffer, the layer's output in its own slots
of the partial-sum buffer; with hoccl an in-place all_gather moves no own block and takes
no SM).  hoccl runs its collectives on its copy-engine lanes with ``stream=side``; NCCL
(torch.distributed) the same calls on the same side stream.  torch's async-TP
(``torch.ops.symm_mem.fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter``, on
symmetric memory, its own pipelining) takes X contiguous and copies it into its workspace
itself; its non-overlapped counterpart is NCCL's sequence.  *Matmuls only* is the same
schedule with no communication: the floor an overlap can reach.

Every schedule is first checked: inputs of small integers (sums of them are exact in
float32 whatever the order, and a bf16 rounding of an exact sum is one value), outputs
poisoned with NaN, one layer, every element of the output compared bit for bit with a
reference computed on the rank from every rank's shards without communication.  Then
each is timed on normal random inputs: ``--iters`` layers back to back, the slowest
rank's time, the median of ``--rounds`` interleaved rounds.

  mpirun -np 2 python -m hoccl.bench.tp              # tokens 8192, hidden 8192, ffn 28672
  mpirun -np 2 python -m hoccl.bench.tp --quick      # small shapes, one round
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from ._harness import fill_defaults, report
from ._tp_layout import (ASYNC_TP, COMPUTE, ChunkViews, Layout, Schedule, count_mismatches,
                         schedules)

__all__ = ["main", "arguments", "Layout", "ChunkViews", "Schedule", "schedules",
           "count_mismatches", "summary", "table"]

#: NVLink multicast can take a shared host's GPUs out of service: never let torch, NCCL or
#: NVSHMEM use it from this program
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}

_FULL = {"tokens": 8192, "hidden": 8192, "ffn": 28672, "chunks": "2,4", "iters": 10,
         "rounds": 3}
_QUICK = {"tokens": 2048, "hidden": 2048, "ffn": 8192, "chunks": "2", "iters": 5, "rounds": 1}


# -- the pure part ----------------------------------------------------------------------------
def arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parsed options; those left unset take the defaults of a full run or of ``--quick``."""
    parser = argparse.ArgumentParser(prog="python -m hoccl.bench.tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes, one round")
    parser.add_argument("--tokens", type=int, help=f"rows of X over all ranks ({_FULL['tokens']})")
    parser.add_argument("--hidden", type=int, help=f"model width ({_FULL['hidden']})")
    parser.add_argument("--ffn", type=int, help=f"MLP width over all ranks ({_FULL['ffn']})")
    parser.add_argument("--chunks", help="chunk counts of the overlapped schedules "
                        f"({_FULL['chunks']}; quick {_QUICK['chunks']})")
    parser.add_argument("--libraries", default="hoccl,hoccl+max_sms=4,nccl,async-tp",
                        help="hoccl (default options) and variants such as hoccl+max_sms=4, "
                             "nccl (torch.distributed), async-tp (torch's symmetric-memory "
                             "fused ops; its baseline, NCCL's sequence, is measured with it)")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 or float16")
    parser.add_argument("--iters", type=int, help=f"layers per timing ({_FULL['iters']})")
    parser.add_argument("--warmup", type=int, default=2, help="untimed layers first")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds; medians reported "
                        f"({_FULL['rounds']}; quick {_QUICK['rounds']})")
    parser.add_argument("--max-sms", type=int, default=8, help="hoccl's SM cap for sums")
    parser.add_argument("--chunk-bytes", default="32M", help="hoccl's pipeline chunk for sums")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--plant-fault", action="store_true",
                        help="flip one bit of every checked output before comparing it (the "
                             "check must then report one wrong element per rank)")
    parser.add_argument("--out", default="results/tp", help="folder for JSON and Markdown")
    args = fill_defaults(parser.parse_args(argv), _QUICK, _FULL)
    if args.dtype not in ("bfloat16", "float16"):
        parser.error(f"--dtype must be bfloat16 or float16, got {args.dtype}")
    if min(args.iters, args.rounds, args.tokens, args.hidden, args.ffn) < 1 or args.warmup < 0:
        parser.error("--iters, --rounds and the shapes must be at least 1")
    return args


def summary(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Each schedule's speedup over its library's sequence, the best overlap of each
    library, and the ratios of the other libraries' best times to hoccl's."""
    timed = {(r["library"], r["chunks"], r["overlapped"]): r for r in records
             if r.get("ms_per_layer") is not None}
    for record in records:
        base = Schedule(record["library"], record["chunks"], record["overlapped"]).baseline
        reference = timed.get((base.library, base.chunks, base.overlapped))
        if (record.get("ms_per_layer") is not None and reference is not None
                and record["library"] != COMPUTE and reference is not record):
            record["speedup"] = reference["ms_per_layer"] / record["ms_per_layer"]
    best: Dict[str, Dict[str, Any]] = {}
    for record in timed.values():
        if record["overlapped"] and record["library"] != COMPUTE:
            held = best.get(record["library"])
            if held is None or record["ms_per_layer"] < held["ms_per_layer"]:
                best[record["library"]] = record
    ratios = {}
    hoccls = [name for name in best if name.startswith("hoccl")]
    for name in hoccls:
        for other in best:
            if not other.startswith("hoccl"):
                ratios[f"{other} / {name}"] = (best[other]["ms_per_layer"]
                                               / best[name]["ms_per_layer"])
    return {"best": {name: {"schedule": Schedule(r["library"], r["chunks"],
                                                 r["overlapped"]).label,
                            "ms_per_layer": r["ms_per_layer"]} for name, r in best.items()},
            "time_ratios": ratios}


def _number(value: Any, digits: int = 2, unit: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{unit}"


def table(result: Dict[str, Any]) -> str:
    """A row per schedule, then the best overlap of each library and the time ratios."""
    shape = result["shape"]
    lines = [f"TP MLP layer: tokens {shape['tokens']}, hidden {shape['hidden']}, ffn "
             f"{shape['ffn']}, {result['dtype']}, {result['world_size']} ranks; ms per layer "
             f"(slowest rank, median of {result['rounds']} round(s) of {result['iters']} layers)",
             "| library | schedule | ms per layer | TFLOP/s per rank | speedup over its "
             "sequence | wrong elements |", "|---|---|---|---|---|---|"]
    for r in result["records"]:
        wrong = r.get("error") or r.get("wrong")
        lines.append(f"| {r['library']} | {r['label']} | {_number(r.get('ms_per_layer'))} | "
                     f"{_number(r.get('tflops'), 0)} | {_number(r.get('speedup'), 3, 'x')} | "
                     f"{'–' if wrong is None else wrong} |")
    best = result["summary"]["best"]
    if best:
        lines.append("")
        lines.append("Best overlap: " + "; ".join(
            f"{name} {entry['ms_per_layer']:.2f} ms ({entry['schedule']})"
            for name, entry in best.items()))
    ratios = result["summary"]["time_ratios"]
    if ratios:
        lines.append("Time per layer, other library / hoccl (above 1: hoccl faster): " + "; ".join(
            f"{name} {value:.3f}" for name, value in ratios.items()))
    return "\n".join(lines)


# -- the GPU part ---------------------------------------------------------------------------
class _Run:
    """Ranks, libraries, buffers and the layer of one run (one process per rank)."""

    def __init__(self, args: argparse.Namespace):
        import torch

        from ._harness import parse_size, setup_ranks
        from ._libraries import libraries
        self.args, self.torch = args, torch
        self.ranks = setup_ranks(0, max_sms=args.max_sms,
                                 chunk_bytes=parse_size(args.chunk_bytes))
        self.rank, self.world_size = self.ranks.comms[0].rank, self.ranks.world_size
        self.device = torch.device(f"cuda:{self.ranks.devices[0]}")
        self.dtype = getattr(torch, args.dtype)
        names = [name for name in args.libraries.split(",") if name]
        planned = schedules(names, [int(c) for c in args.chunks.split(",") if c])
        wanted = list(dict.fromkeys(s.library for s in planned
                                    if s.library not in (ASYNC_TP, COMPUTE)))
        # async-TP's process group is NCCL's, made by the "nccl" library it brings along
        self.libraries = {lib.name: lib for lib in libraries(self.ranks, wanted)}
        #: schedules of libraries that could not be set up here are left out, never run
        #: without their communication
        self.schedules = [s for s in planned if s.library in (ASYNC_TP, COMPUTE)
                          or s.library in self.libraries]
        self.group_name = ""
        self.async_tp_error = ""
        if ASYNC_TP in names:
            if "nccl" in self.libraries:
                self.group_name = self.enable_async_tp()
            else:
                self.async_tp_error = "needs torch.distributed's NCCL process group"
        whole = Layout(args.tokens, args.hidden, args.ffn, self.world_size)
        self.whole = whole
        self.compute = torch.cuda.Stream(device=self.device)
        self.side = torch.cuda.Stream(device=self.device)

        def empty(*shape: int) -> Any:
            return torch.empty(*shape, dtype=self.dtype, device=self.device)
        self.gather = empty(whole.tokens * whole.hidden)
        self.hidden = empty(whole.tokens * whole.ffn_shard)
        self.partial = empty(whole.tokens * whole.hidden)
        self.x = empty(whole.rows_per_rank, whole.hidden)
        self.w1 = empty(whole.hidden, whole.ffn_shard)
        self.w2 = empty(whole.ffn_shard, whole.hidden)
        chunk_counts = {max(1, s.chunks) for s in self.schedules}
        self.events = {c: ([torch.cuda.Event() for _ in range(c)],
                           [torch.cuda.Event() for _ in range(c)]) for c in chunk_counts}

    def enable_async_tp(self) -> str:
        """The process group's name, with symmetric memory enabled for it where torch asks
        for that (torch 2.11; later versions deprecate the call)."""
        import torch.distributed as dist
        try:
            import torch.distributed._symmetric_memory as symmetric_memory
            group = dist.group.WORLD
            if group is None:
                raise RuntimeError("torch.distributed has no default process group")
            name = group.group_name
            enable = getattr(symmetric_memory, "enable_symm_mem_for_group", None)
            if enable is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    enable(name)
            return name
        except Exception as error:  # recorded; the other libraries still run
            self.async_tp_error = f"{type(error).__name__}: {error}"
            return ""

    # -- data --------------------------------------------------------------------------
    def fill(self, exact: bool) -> None:
        """This rank's X, W1 and W2: small integers (``exact``) or normal random values
        scaled like an initialised layer."""
        torch, layout = self.torch, self.whole
        if exact:
            x, w1, w2 = self.exact_shards(self.rank)
            self.x.copy_(x)
            self.w1.copy_(w1)
            self.w2.copy_(w2)
            return
        generator = torch.Generator(device=self.device).manual_seed(self.args.seed + self.rank)
        for tensor, width in ((self.x, 1), (self.w1, layout.hidden), (self.w2, layout.ffn_shard)):
            tensor.normal_(0.0, width ** -0.5, generator=generator)

    def exact_shards(self, rank: int) -> Any:
        """Rank ``rank``'s X, W1 and W2 of the check: values in {-1, 0, 1} from a
        generator seeded by the rank, so that every rank can make every rank's shards."""
        torch, layout = self.torch, self.whole
        generator = torch.Generator(device=self.device).manual_seed(self.args.seed * 1000 + rank)

        def draw(*shape: int) -> Any:
            return torch.randint(-1, 2, shape, generator=generator, device=self.device,
                                 dtype=torch.int8).to(self.dtype)
        return (draw(layout.rows_per_rank, layout.hidden), draw(layout.hidden, layout.ffn_shard),
                draw(layout.ffn_shard, layout.hidden))

    def reference(self) -> Any:
        """This rank's rows of the output, from every rank's shards, without communication:
        the sum over ranks r of (X @ W1_r) @ W2_r, each product rounded to the dtype as
        cuBLAS rounds it, the sum accumulated in float32 and rounded once."""
        torch = self.torch
        x = self.exact_shards(self.rank)[0]
        total = torch.zeros(x.shape[0], self.whole.hidden, dtype=torch.float32,
                            device=self.device)
        for rank in range(self.world_size):
            _, w1, w2 = self.exact_shards(rank)
            total += torch.mm(torch.mm(x, w1), w2).float()
        return total.to(self.dtype)

    # -- the layer ---------------------------------------------------------------------
    def layer(self, schedule: Schedule) -> Callable[[], Any]:
        """A callable that enqueues one layer as ``schedule`` runs it; it returns the
        output (async-TP) or None (the output is in the partial-sum buffer's own slots)."""
        if schedule.library == ASYNC_TP:
            return self.fused_layer
        torch = self.torch
        layout = Layout(self.whole.tokens, self.whole.hidden, self.whole.ffn, self.world_size,
                        schedule.chunks)
        views = layout.views(self.gather, self.hidden, self.partial, self.rank)
        library = self.libraries.get(schedule.library)
        compute = self.compute
        side = self.side if schedule.overlapped else None
        gathered, multiplied = self.events[schedule.chunks]
        w1, w2 = self.w1, self.w2

        def run() -> None:
            lane = side if side is not None else compute
            if side is not None:
                side.wait_stream(compute)  # the previous layer's use of the buffers is over
            for index, chunk in enumerate(views):
                if library is not None:
                    library.run(0, "all_gather", chunk.own, chunk.gathered, lane)
                if side is not None:
                    gathered[index].record(side)
            with torch.cuda.stream(compute):
                for index, chunk in enumerate(views):
                    if side is not None:
                        compute.wait_event(gathered[index])
                    torch.mm(chunk.activations, w1, out=chunk.hidden)
                for index, chunk in enumerate(views):
                    torch.mm(chunk.hidden, w2, out=chunk.partial)
                    if side is not None:
                        multiplied[index].record(compute)
                        side.wait_event(multiplied[index])
                    if library is not None:
                        library.run(0, "reduce_scatter", chunk.partial_flat, chunk.result, lane)
            if side is not None:
                compute.wait_stream(side)
        return run

    def fused_layer(self) -> Any:
        torch = self.torch
        with torch.cuda.stream(self.compute):
            _, outputs = torch.ops.symm_mem.fused_all_gather_matmul(
                self.x, [self.w1], 0, self.group_name)
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(
                outputs[0], self.w2, "sum", 0, self.group_name)

    def prepare(self, schedule: Schedule, poison: bool) -> None:
        """The library's options, this rank's input in the schedule's own slots and, with
        ``poison``, NaN everywhere else the layer writes."""
        library = self.libraries.get(schedule.library)
        if library is not None:
            library.prepare()
        if schedule.library != ASYNC_TP:
            if poison:
                for buffer in (self.gather, self.hidden, self.partial):
                    buffer.fill_(float("nan"))
            Layout(self.whole.tokens, self.whole.hidden, self.whole.ffn, self.world_size,
                   schedule.chunks).place_input(self.gather, self.x, self.rank)
        # the copies ran on torch's current stream, the layer runs on others
        self.torch.cuda.synchronize(self.device)

    def agree(self, error: Optional[BaseException]) -> str:
        """Every rank's verdict: the first error of any rank, or "" when none failed."""
        mine = f"rank {self.rank}: {type(error).__name__}: {error}" if error else ""
        verdicts = [mine] if self.ranks.mpi is None else self.ranks.mpi.allgather(mine)
        return next((verdict for verdict in verdicts if verdict), "")

    def check(self, schedule: Schedule, reference: Any) -> Dict[str, Any]:
        """One layer on the exact inputs with every output poisoned: wrong elements summed
        over the ranks (a ``--plant-fault`` flip adds one per rank)."""
        torch = self.torch
        if schedule.library == COMPUTE:
            return {}  # no communication: the own slots hold a partial sum, not the output
        error: Optional[BaseException] = None
        wrong = 0
        try:
            if schedule.library == ASYNC_TP and not self.group_name:
                raise RuntimeError(self.async_tp_error or "async-TP is not set up")
            self.prepare(schedule, poison=True)
            self.ranks.barrier()
            output = self.layer(schedule)()
            torch.cuda.synchronize(self.device)
            if output is None:
                output = Layout(self.whole.tokens, self.whole.hidden, self.whole.ffn,
                                self.world_size, schedule.chunks).output(self.partial, self.rank)
            if self.args.plant_fault:
                output = output.clone()
                output.view(torch.int16)[0, 0] ^= 1
            wrong = count_mismatches(output, reference)
        except Exception as got:  # agreed below: every rank skips a failed schedule
            error = got
        verdict = self.agree(error)
        if verdict:
            return {"error": verdict}
        return {"wrong": int(self.ranks.sum(wrong))}

    def time(self, schedule: Schedule) -> float:
        """Milliseconds per layer: ``--iters`` layers back to back, the slowest rank's."""
        torch, args = self.torch, self.args
        run = self.layer(schedule)
        self.prepare(schedule, poison=False)
        for _ in range(args.warmup):
            run()
        torch.cuda.synchronize(self.device)
        self.ranks.barrier()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record(self.compute)
        for _ in range(args.iters):
            run()
        end.record(self.compute)
        end.synchronize()
        return self.ranks.max(start.elapsed_time(end) / args.iters)

    def run(self) -> Dict[str, Any]:
        torch, args, say = self.torch, self.args, self.ranks.say
        say(f"# tp: {self.world_size} ranks, tokens {args.tokens}, hidden {args.hidden}, ffn "
            f"{args.ffn}, {args.dtype}; libraries {', '.join(self.libraries)}"
            + (f", {ASYNC_TP}" if self.group_name else ""))
        if self.async_tp_error:
            say(f"# {ASYNC_TP}: not set up: {self.async_tp_error}")
        # exact, deterministic products for the check: no reduced-precision split-K sums
        reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        reduced16 = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        try:
            self.fill(exact=True)
            reference = self.reference()
            checks = {schedule: self.check(schedule, reference) for schedule in self.schedules}
        finally:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = reduced16
        del reference
        for schedule, checked in checks.items():
            if checked:
                say(f"  check {schedule.library:16s} {schedule.label:30s} "
                    + (f"failed: {checked['error']}" if "error" in checked
                       else f"wrong {checked['wrong']}"))
        self.fill(exact=False)
        times: Dict[Schedule, List[float]] = {s: [] for s in self.schedules}
        errors: Dict[Schedule, str] = {}
        for round_index in range(args.rounds):
            for schedule in self.schedules:
                if "error" in checks[schedule] or schedule in errors:
                    continue
                failure: Optional[BaseException] = None
                try:
                    elapsed = self.time(schedule)
                except Exception as error:  # agreed below
                    failure = error
                verdict = self.agree(failure)
                if verdict:
                    errors[schedule] = verdict
                    say(f"  [{round_index + 1}] {schedule.library:16s} {schedule.label:30s} "
                        f"failed: {verdict}")
                    continue
                times[schedule].append(elapsed)
                say(f"  [{round_index + 1}] {schedule.library:16s} {schedule.label:30s} "
                    f"{elapsed:8.3f} ms per layer")
        flops = self.whole.flops
        records = []
        for schedule in self.schedules:
            record: Dict[str, Any] = {"library": schedule.library, "chunks": schedule.chunks,
                                      "overlapped": schedule.overlapped, "label": schedule.label,
                                      **checks[schedule], "ms_all_rounds": times[schedule]}
            if schedule in errors:
                record["error"] = errors[schedule]
            if times[schedule]:
                record["ms_per_layer"] = statistics.median(times[schedule])
                record["tflops"] = flops / (record["ms_per_layer"] * 1e-3) / 1e12
            records.append(record)
        from ._harness import metadata
        return {"meta": metadata(sys.argv), "world_size": self.world_size, "dtype": args.dtype,
                "shape": {"tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn},
                "chunks": args.chunks, "iters": args.iters, "rounds": args.rounds,
                "hoccl": {"max_sms": args.max_sms, "chunk_bytes": args.chunk_bytes},
                "async_tp_error": self.async_tp_error, "plant_fault": args.plant_fault,
                "records": records, "summary": summary(records)}

    def close(self) -> None:
        self.torch.cuda.synchronize(self.device)
        for comm in self.ranks.comms:
            comm.close()


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = arguments(argv)
    for name, value in _NO_MULTICAST.items():
        os.environ[name] = value
    from ._harness import require
    require("python -m hoccl.bench.tp", 0)
    run = _Run(args)
    if run.world_size < 2:
        sys.exit("python -m hoccl.bench.tp: needs 2 or more ranks: mpirun -np 2 python -m "
                 "hoccl.bench.tp")
    try:
        result = run.run()
    finally:
        run.close()
    if run.ranks.leader:
        report(result, args.out, "tp", table(result))
    expected = run.world_size if args.plant_fault else 0
    unexpected = [r for r in result["records"] if "wrong" in r and r["wrong"] != expected]
    if unexpected:
        sys.exit(f"python -m hoccl.bench.tp: {len(unexpected)} schedule(s) with a number of "
                 f"wrong elements other than {expected}: "
                 + ", ".join(f"{r['library']} {r['label']}: {r['wrong']}" for r in unexpected))


if __name__ == "__main__":
    main()
