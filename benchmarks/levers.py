"""python benchmarks/levers.py: why a reduction beside a GEMM costs the GEMM so much, on one GPU.

A bf16 GEMM loop (torch, M=N=K=8192 by default) runs on one stream of one GPU while hoccl's
reduction kernel loops on another: the on-GPU half of a 2-rank reduce_scatter, the sum of
two bf16 inputs (own block + received block, 512 MiB each by default, the blocks of a
1 GiB reduce_scatter) into an output, one launch per pipeline chunk as the collective does
(``Device.reduce`` from ``hoccl.backends.cuda.open_device``)::

    GEMM stream       [gemm][gemm][gemm][gemm][gemm] ...    (persistent: a CTA per SM)
    reduction stream    [sum c0][sum c1][sum c2] ...         (8 blocks of 1024 threads)

For each variant of one lever it measures the GEMM's TFLOP/s alone and beside the sums
(the slowdown), and the sums' GB/s (bytes read + written) alone and while the GEMMs run.
The levers, side by side in one run:

- ``sms``: the reduction's block cap (2, 4, 8, 16, 32 SMs);
- ``launches``: one launch per 8 MiB or 32 MiB chunk, or one launch per call;
- ``priority``: the greatest or least stream priority for the reduction and the GEMM
  (hoccl's lanes use the greatest);
- ``block``: 32 blocks of 256 threads instead of 8 of 1024 (the same threads, a quarter of
  the registers per block: can they slip in beside GEMM CTAs?  ptxas gives hoccl's sum 52
  registers per thread for sm_90, so a 1024-thread block holds 57 344 of an SM's 65 536
  registers and fits beside no CTA that holds more than 8 192);
- ``green``: green contexts (``cuGreenCtxCreate``): the reduction confined to a partition
  of N SMs, the GEMM unconfined or confined to the rest;
- ``adaptive``: the cap set to the number of SMs the GEMM leaves idle, measured below;
- ``pipeline``: the collective's own pipeline on one GPU: a copy stream copies each chunk
  of the second input into place on a copy engine (where on two GPUs the peer's copy lands
  in scratch) and signals it with a stream memory operation, and the sums wait for the
  signals, either as a stream wait and a launch per chunk or as one launch per call whose
  blocks wait on the device (``Device.reduce_chunks``, hoccl's ``fuse_sums``);
- ``torch``: the same sum as a torch kernel on the whole GPU (``torch.add``, no SM cap),
  per chunk or per call: what a consumer that adds the partial blocks itself would cost
  the GEMM (the opt-in of deferring the sum to the next kernel: the collective then
  moves blocks with zero SMs, and this kernel is what is left).

Two residency probes use the same sum with a per-block record of ``%smid`` and
``%globaltimer`` (start and end), and a one-block marker kernel between GEMMs that dates
the GEMM kernels on the same clock:

- *idle*: short blocks launched back to back beside the GEMM: the SMs on which they start
  in the middle of a GEMM kernel are the SMs the persistent GEMM leaves idle;
- *waits*: the chunked sum beside the GEMM: how long each block waits for an SM after
  the previous launch ends, whether it starts mid-GEMM or at a GEMM boundary, and how
  long GEMM kernels take that start with reduction blocks resident against those that
  do not (the hypothesis under test: blocks that find no idle SM wait for GEMM CTAs to
  retire, then the GEMM's next kernel waits for them).

A torch.profiler timeline of the baseline variant (8 SMs, 32 MiB chunks) gives each
kernel's start, duration, grid, block, registers and shared memory (``timeline.json``).

Two levers of the issue need a second GPU and are not measured here: summing while the
peer's data arrives against after, and reading the peer's chunk over NVLink from the
kernel against copying it into scratch on a copy engine.

  python benchmarks/levers.py                 # about 2 minutes on one H200 (estimated)
  python benchmarks/levers.py --quick         # about 1 minute
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from hoccl.bench._harness import fill_defaults, human, parse_size, report

__all__ = ["main", "arguments", "Variant", "variants", "pieces", "launches_per_call",
           "residency", "kernel_summary", "table", "markdown"]

PRIORITIES = ("greatest", "least")
GREEN = ("", "reduce", "both")
LEVERS = ("sms", "launches", "priority", "block", "green", "adaptive", "pipeline", "torch")
#: a block that starts within this many µs of the end of its launch's predecessor found an SM
IMMEDIATE_US = 20.0
#: a block that starts within this many µs before a GEMM kernel ends started in its tail
TAIL_US = 30.0
#: blocks the trace buffer can record
_TRACE_SLOTS = 16384

_FULL = {"gemms": 60, "bytes": "512M", "sms": "2,4,8,16,32", "chunks": "8M,32M,whole",
         "priorities": "least/least,least/greatest,greatest/greatest", "blocks": "32x256",
         "green": "8,16", "rounds": 3, "probe_sms": "4,8", "torch_chunks": "32M,128M,whole",
         "pipeline": "8:32M,16:32M,32:32M"}
_QUICK = {"gemms": 20, "bytes": "128M", "sms": "4,8,32", "chunks": "32M,whole",
          "priorities": "least/least", "blocks": "", "green": "8", "rounds": 1,
          "probe_sms": "8", "torch_chunks": "whole", "pipeline": "8:32M"}


# -- the pure part: options, variants, analysis, tables ------------------------------------
def arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parsed options; those left unset take the defaults of a full run or of ``--quick``."""
    parser = argparse.ArgumentParser(prog="python benchmarks/levers.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=int, default=0, help="GPU ordinal")
    parser.add_argument("--quick", action="store_true",
                        help="fewer variants, smaller inputs, one round (about a minute)")
    parser.add_argument("--gemm", type=int, default=8192, help="M = N = K of the bf16 GEMM")
    parser.add_argument("--gemms", type=int, help=f"GEMMs per measurement ({_FULL['gemms']}; "
                        f"quick {_QUICK['gemms']})")
    parser.add_argument("--bytes", help=f"bytes of each of the two inputs ({_FULL['bytes']}: the "
                        f"own block of a 1 GiB reduce_scatter on 2 ranks; quick {_QUICK['bytes']})")
    parser.add_argument("--chunk-bytes", default="32M",
                        help="hoccl's pipeline chunk: one launch per chunk (%(default)s)")
    parser.add_argument("--base-sms", type=int, default=8,
                        help="the reduction cap of the launches, priority, block and green "
                             "levers (hoccl's default max_sms, %(default)s)")
    parser.add_argument("--sms", help=f"caps of the sms lever ({_FULL['sms']})")
    parser.add_argument("--chunks", help="chunk sizes of the launches lever, 'whole' for one "
                        f"launch per call ({_FULL['chunks']})")
    parser.add_argument("--priorities", help="REDUCE/GEMM priority pairs of the priority lever "
                        "besides the baseline greatest/least (hoccl's lanes / torch's default "
                        f"stream) ({_FULL['priorities']})")
    parser.add_argument("--blocks", help="BLOCKSxTHREADS shapes of the block lever ('' for "
                        f"none) ({_FULL['blocks']})")
    parser.add_argument("--green", help="SM counts of the green-context partitions ('' for "
                        f"none) ({_FULL['green']})")
    parser.add_argument("--torch-chunks", help="chunk sizes of the torch lever (the sum as "
                        "torch.add on the whole GPU), 'whole' for one launch per call, '' for "
                        f"none ({_FULL['torch_chunks']}; quick {_QUICK['torch_chunks']})")
    parser.add_argument("--pipeline", help="SMS:CHUNK settings of the pipeline lever, each "
                        "run with a launch per chunk and with one launch per call ('' for "
                        f"none) ({_FULL['pipeline']}; quick {_QUICK['pipeline']})")
    parser.add_argument("--probe-sms", help="caps of the waits probe "
                        f"({_FULL['probe_sms']}; quick {_QUICK['probe_sms']})")
    parser.add_argument("--rounds", type=int, help="rounds over every variant; medians are "
                        f"reported ({_FULL['rounds']}; quick {_QUICK['rounds']})")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the torch.profiler timeline")
    parser.add_argument("--out", default="results/levers", help="folder for JSON and Markdown")
    args = fill_defaults(parser.parse_args(argv), _QUICK, _FULL)
    if args.gemms < 1 or args.rounds < 1 or args.base_sms < 1:
        parser.error("--gemms, --rounds and --base-sms must be at least 1")
    return args


@dataclass(frozen=True)
class Variant:
    """One setting of one lever: how the reduction runs beside the GEMM.

    ``sms``: blocks of the reduction (its SM cap); ``chunk_bytes``: bytes of each input per
    launch (0: one launch per call); ``threads`` and ``unroll``: the kernel's block shape
    (hoccl's is 1024 x 2); ``green``: "" (no green context), "reduce" (the reduction in a
    green context of ``sms`` SMs, the GEMM on the whole GPU) or "both" (the GEMM in a green
    context of the remaining SMs).  The ``torch`` lever runs ``torch.add`` instead of
    hoccl's kernel (no cap: ``sms`` is then the GPU's SM count, for the table)."""
    lever: str
    sms: int
    chunk_bytes: int
    reduce_priority: str = "greatest"
    gemm_priority: str = "least"
    threads: int = 1024
    unroll: int = 2
    green: str = ""
    #: the pipeline lever: the chunk sums as one launch that waits on the device
    fused: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.lever not in LEVERS:
            problems.append(f"lever in {LEVERS}, got {self.lever!r}")
        if self.sms < 1:
            problems.append(f"sms >= 1, got {self.sms}")
        if self.chunk_bytes < 0 or self.chunk_bytes % 16:
            problems.append(f"chunk_bytes a multiple of 16 (0: whole), got {self.chunk_bytes}")
        for name in ("reduce_priority", "gemm_priority"):
            if getattr(self, name) not in PRIORITIES:
                problems.append(f"{name} in {PRIORITIES}, got {getattr(self, name)!r}")
        if self.threads not in (128, 256, 512, 1024):
            problems.append(f"threads in 128/256/512/1024, got {self.threads}")
        if self.unroll < 1:
            problems.append(f"unroll >= 1, got {self.unroll}")
        if self.green not in GREEN:
            problems.append(f"green in {GREEN}, got {self.green!r}")
        if self.lever == "pipeline" and not self.chunk_bytes:
            problems.append("a pipeline of chunks (chunk_bytes > 0)")
        if self.fused and self.lever != "pipeline":
            problems.append("fused only in the pipeline lever")
        if problems:
            raise ValueError("Variant: expected " + "; ".join(problems))

    @property
    def hoccl_kernel(self) -> bool:
        """Whether ``Device.reduce`` runs it (hoccl's block shape, no green context)."""
        return (self.threads, self.unroll) == (1024, 2) and not self.green and not self.torch

    @property
    def torch(self) -> bool:
        """Whether the sum is torch's kernel on the whole GPU."""
        return self.lever == "torch"

    @property
    def label(self) -> str:
        shape = f"{self.sms} SMs" if self.threads == 1024 else f"{self.sms}x{self.threads} thr"
        if self.torch:
            shape = "torch.add, all SMs"
        if self.unroll != 2:
            shape += f" unroll {self.unroll}"
        chunk = "1 launch/call" if not self.chunk_bytes else f"{human(self.chunk_bytes)} chunks"
        parts = [shape, chunk, f"reduce {self.reduce_priority} / GEMM {self.gemm_priority}"]
        if self.green:
            parts.append("green: reduction only" if self.green == "reduce"
                         else "green: reduction + GEMM")
        if self.lever == "pipeline":
            parts[1] = (f"{chunk} copied on a copy engine, "
                        + ("summed in 1 launch/call waiting on the device" if self.fused
                           else "a stream wait + a launch per chunk"))
        return ", ".join(parts)


def _sizes(text: str) -> List[int]:
    return [0 if item.strip() == "whole" else parse_size(item) for item in text.split(",")
            if item.strip()]


def _counts(text: str) -> List[int]:
    return [int(item) for item in text.split(",") if item.strip()]


def variants(args: argparse.Namespace, idle_sms: Optional[int] = None) -> List[Variant]:
    """Every variant of the run, in order, without repeats: the sms sweep (whose
    ``base_sms`` row is the baseline), then the launches, priority, block and green levers
    at ``base_sms``, then the adaptive cap when the idle probe found ``idle_sms`` >= 1."""
    chunk = parse_size(args.chunk_bytes)
    base = args.base_sms
    found: List[Variant] = []

    def add(variant: Variant) -> None:
        same = [v for v in found if _setting(v) == _setting(variant)]
        if not same:
            found.append(variant)

    add(Variant("sms", base, chunk))
    for sms in _counts(args.sms):
        add(Variant("sms", sms, chunk))
    for size in _sizes(args.chunks):
        add(Variant("launches", base, size))
    for pair in (item for item in args.priorities.split(",") if item.strip()):
        reduce_priority, gemm_priority = pair.strip().split("/")
        add(Variant("priority", base, chunk, reduce_priority, gemm_priority))
    for shape in (item for item in args.blocks.split(",") if item.strip()):
        blocks, threads = (int(part) for part in shape.lower().split("x"))
        add(Variant("block", blocks, chunk, threads=threads))
    for sms in _counts(args.green):
        add(Variant("green", sms, chunk, green="reduce"))
        add(Variant("green", sms, chunk, green="both"))
    if idle_sms:
        add(Variant("adaptive", idle_sms, chunk))
    for item in (item for item in (getattr(args, "pipeline", "") or "").split(",")
                 if item.strip()):
        cap, _, chunk_text = item.strip().partition(":")
        for fused in (False, True):
            add(Variant("pipeline", int(cap), parse_size(chunk_text), fused=fused))
    for size in _sizes(getattr(args, "torch_chunks", "") or ""):
        add(Variant("torch", getattr(args, "sm_count", 0) or 132, size))
    found.sort(key=lambda v: LEVERS.index(v.lever))
    return found


def _setting(variant: Variant) -> Tuple:
    """What a variant runs, whichever lever names it (the pipeline lever's copies and
    signals make it a setting of its own)."""
    fields = asdict(variant)
    fields["pipeline"] = fields.pop("lever") == "pipeline"
    return tuple(sorted(fields.items()))


def pieces(nbytes: int, chunk_bytes: int, itemsize: int) -> List[Tuple[int, int]]:
    """``(byte offset, elements)`` of each launch that sums ``nbytes`` per input in chunks
    of ``chunk_bytes`` (0: one launch), as hoccl's reduce_scatter splits its sums."""
    if nbytes <= 0 or nbytes % itemsize:
        raise ValueError(f"pieces: expected a positive multiple of {itemsize} bytes, got {nbytes}")
    step = nbytes if not chunk_bytes else chunk_bytes
    return [(offset, min(step, nbytes - offset) // itemsize) for offset in range(0, nbytes, step)]


def launches_per_call(nbytes: int, chunk_bytes: int) -> int:
    return 1 if not chunk_bytes else math.ceil(nbytes / chunk_bytes)


Block = Tuple[int, int, int]  # (SM id, start ns, end ns) of one thread block


def _intervals(markers: Sequence[Block]) -> List[Tuple[int, int]]:
    """GEMM kernels dated by the one-block markers between them: from one marker's end to
    the next one's start."""
    ordered = sorted(markers, key=lambda block: block[1])
    return [(first[2], second[1]) for first, second in zip(ordered, ordered[1:])
            if second[1] > first[2]]


def _percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _spread(values: Sequence[float]) -> Dict[str, float]:
    if not values:
        return {}
    return {"median": statistics.median(values), "p90": _percentile(values, 0.9),
            "max": max(values), "count": len(values)}


def residency(markers: Sequence[Block], launches: Sequence[Sequence[Block]],
              immediate_us: float = IMMEDIATE_US, tail_us: float = TAIL_US) -> Dict[str, Any]:
    """What the per-block records of launches beside a dated GEMM loop say.

    ``markers``: the one-block kernels between GEMMs (they date each GEMM kernel);
    ``launches``: per launch of the probed kernel, in stream order, its blocks.  A block
    *waits* from the end of its launch's predecessor (stream order: it cannot start
    earlier) to its own start.  It starts *mid-GEMM* when a GEMM kernel runs and has more
    than ``tail_us`` left: it found an SM the GEMM does not use; otherwise it started in
    a GEMM's tail or between GEMMs, on an SM a GEMM CTA had just left.  A GEMM kernel
    *starts with* the blocks resident at its start, which its CTAs cannot use."""
    gemms = _intervals(markers)
    waits: List[float] = []
    immediate: List[int] = []
    mid_sms: set = set()
    starts = {"mid_gemm": 0, "gemm_tail_or_boundary": 0, "no_gemm": 0}
    blocks = [block for launch in launches for block in launch]
    for index, launch in enumerate(launches):
        if index and launches[index - 1] and launch:
            ready = max(block[2] for block in launches[index - 1])
            launch_waits = [max(0.0, (block[1] - ready) / 1e3) for block in launch]
            waits += launch_waits
            immediate.append(sum(wait <= immediate_us for wait in launch_waits))
    for sm, start, _ in blocks:
        gemm = next(((begin, end) for begin, end in gemms if begin <= start < end), None)
        if gemm is None:
            starts["no_gemm"] += 1
        elif (gemm[1] - start) / 1e3 > tail_us:
            starts["mid_gemm"] += 1
            mid_sms.add(sm)
        else:
            starts["gemm_tail_or_boundary"] += 1
    with_blocks: List[float] = []
    without: List[float] = []
    for begin, end in gemms:
        resident = sum(1 for _, start, stop in blocks if start <= begin < stop)
        (with_blocks if resident else without).append((end - begin) / 1e3)
    return {
        "launches": len(launches), "blocks": len(blocks),
        "sms_seen": len({block[0] for block in blocks}),
        "idle_sms": sorted(mid_sms), "idle_sm_count": len(mid_sms),
        "block_starts": starts,
        "wait_us": _spread(waits),
        "immediate_blocks_per_launch": statistics.median(immediate) if immediate else None,
        "gemm_us": _spread([(end - begin) / 1e3 for begin, end in gemms]),
        "gemm_us_starting_with_reduction_blocks": _spread(with_blocks),
        "gemm_us_starting_without": _spread(without),
    }


def kernel_summary(kernels: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Per kernel name in a timeline: count, duration spread (µs), and grid, block,
    registers and shared memory of its first launch."""
    by_name: Dict[str, List[Dict[str, Any]]] = {}
    for kernel in kernels:
        by_name.setdefault(kernel["name"], []).append(kernel)
    summary = {}
    for name, group in by_name.items():
        first = group[0]
        summary[name] = {"duration_us": _spread([kernel["dur_us"] for kernel in group]),
                         **{key: first.get(key) for key in
                            ("grid", "block", "registers", "shared_memory", "stream")}}
    return summary


def _number(value: Any, digits: int = 0, unit: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{unit}"


def _spread_text(spread: Dict[str, float]) -> str:
    if not spread:
        return "–"
    return (f"median {spread['median']:.0f}, p90 {spread['p90']:.0f}, max {spread['max']:.0f} "
            f"(n={spread['count']})")


def table(result: Dict[str, Any]) -> str:
    """The lever table: one row per variant (medians over the rounds)."""
    lines = [f"GEMM {result['gemm']}^3 bf16 on {result['gpu']} ({result['sm_count']} SMs): "
             f"{_number(result.get('gemm_tflops_alone'))} TFLOP/s alone; the sum of 2 x "
             f"{human(result['bytes'])} bf16 inputs per call (3 x {human(result['bytes'])} "
             "moved); medians of " + f"{result['rounds']} round(s)",
             "| lever | variant | blocks | launches/call | GEMM TFLOP/s alone | beside | "
             "GEMM slowdown | sum GB/s alone | beside | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for record in result["records"]:
        note = record.get("error") or record.get("note", "")
        lines.append(
            f"| {record['lever']} | {record['label']} | {record['blocks']} | "
            f"{record['launches_per_call']} | {_number(record.get('gemm_tflops_alone'))} | "
            f"{_number(record.get('gemm_tflops_beside'))} | "
            f"{_number(record.get('slowdown_pct'), 1, ' %')} | "
            f"{_number(record.get('reduce_gbps_alone'))} | "
            f"{_number(record.get('reduce_gbps_beside'))} | {note} |")
    return "\n".join(lines)


def markdown(result: Dict[str, Any]) -> str:
    """The lever table, then what the probes, the timeline and the green contexts found."""
    lines = [table(result), ""]
    kernel = result.get("kernel", {})
    if kernel:
        lines.append(f"Reduction kernel: {kernel.get('registers')} registers per thread x "
                     f"{kernel.get('threads')} threads per block.")
    for name, probe in result.get("probes", {}).items():
        if "error" in probe:
            lines.append(f"- probe {name}: failed: {probe['error']}")
            continue
        starts = probe["block_starts"]
        lines.append(
            f"- probe {name}: {probe['blocks']} blocks in {probe['launches']} launches on "
            f"{probe['sms_seen']} SMs; {starts['mid_gemm']} started mid-GEMM (on "
            f"{probe['idle_sm_count']} distinct SMs), {starts['gemm_tail_or_boundary']} in a "
            f"GEMM's last {TAIL_US:.0f} µs or between GEMMs, {starts['no_gemm']} outside the "
            f"GEMM loop; µs from the previous launch's end to a block's start: "
            f"{_spread_text(probe['wait_us'])}; blocks per launch that started within "
            f"{IMMEDIATE_US:.0f} µs: {_number(probe['immediate_blocks_per_launch'])}; GEMM "
            f"kernel µs: {_spread_text(probe['gemm_us'])}; of GEMMs that started with "
            f"reduction blocks resident: "
            f"{_spread_text(probe['gemm_us_starting_with_reduction_blocks'])}; without: "
            f"{_spread_text(probe['gemm_us_starting_without'])}")
    timeline = result.get("timeline", {})
    if timeline.get("error"):
        lines.append(f"- timeline: failed: {timeline['error']}")
    for phase in ("alone", "beside"):
        for name, entry in timeline.get(phase, {}).items():
            lines.append(f"- timeline {phase}: {name[:80]}: grid {entry['grid']}, block "
                         f"{entry['block']}, {entry['registers']} registers, shared memory "
                         f"{entry['shared_memory']}; µs {entry['duration_us']}")
    green = result.get("green", {})
    for sms, entry in green.items():
        lines.append(f"- green contexts of {sms} SMs: {entry}")
    lines += ["", "Not measured here (they need two GPUs): summing while the peer's data "
              "arrives against after it; reading the peer's chunk over NVLink from the kernel "
              "against copying it into scratch on a copy engine."]
    return "\n".join(lines)


# -- the GPU part ---------------------------------------------------------------------------
_STUDY_KERNELS = r"""
extern "C" __global__ void __launch_bounds__(HOCCL_REDUCE_THREADS)
hoccl_levers_sum(const __grid_constant__ ReduceArgs args) { reduce_body<BFloat16, OP_SUM>(args); }

// The same sum; thread 0 of each block records its SM and when the block started and
// ended (%globaltimer: nanoseconds, one clock for every SM).
extern "C" __global__ void __launch_bounds__(HOCCL_REDUCE_THREADS)
hoccl_levers_traced_sum(const __grid_constant__ ReduceArgs args, unsigned long long* trace) {
    unsigned long long start = 0;
    if (threadIdx.x == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    reduce_body<BFloat16, OP_SUM>(args);
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int sm;
        unsigned long long end;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(end));
        trace[3 * blockIdx.x] = sm;
        trace[3 * blockIdx.x + 1] = start;
        trace[3 * blockIdx.x + 2] = end;
    }
}
"""


def study_source() -> str:
    """CUDA source of the study's kernels: hoccl's templates and the two kernels above."""
    from hoccl.backends import _kernels
    return _kernels.templates() + _STUDY_KERNELS


def study_options(threads: int, unroll: int) -> List[str]:
    """hoccl's compile options with the reduction's block shape replaced."""
    from hoccl.backends import _kernels
    return ([option for option in _kernels.compile_options()
             if not option.startswith("-DHOCCL_REDUCE_")]
            + [f"-DHOCCL_REDUCE_THREADS={threads}", f"-DHOCCL_REDUCE_UNROLL={unroll}"])


class _Green:
    """Two green contexts that split the GPU's SMs: ``reduce`` of at least the requested
    count (the driver rounds it to its partition granularity) and ``rest``."""

    def __init__(self, study: "_Study", sms: int):
        self.study, self.requested = study, sms
        self.handles: List[Any] = []
        #: how the reduction kernel is launched into the green context: "primary module"
        #: (hoccl's kernel, loaded in the primary context) or "green module" (the study's
        #: copy loaded while the green context is current); set by ``_Study.green_launch``
        self.mode = ""
        self.errors: List[str] = []
        try:
            self._create(sms)
        except BaseException:
            self.close()
            raise

    def _create(self, sms: int) -> None:
        driver, call = self.study.driver, self.study.call
        device = call(driver.cuDeviceGet, self.study.ordinal)
        resource = call(driver.cuDeviceGetDevResource, device,
                        driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
        groups, count, remainder = call(driver.cuDevSmResourceSplitByCount, 1, resource, 0, sms)
        if count < 1:
            raise RuntimeError(f"cuDevSmResourceSplitByCount made no group of {sms} SMs")
        self.reduce_sms = int(groups[0].sm.smCount)
        self.rest_sms = int(remainder.sm.smCount)
        flags = int(driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
        contexts = []
        for part in (groups[0], remainder):
            description = call(driver.cuDevResourceGenerateDesc, [part], 1)
            green = call(driver.cuGreenCtxCreate, description, device, flags)
            self.handles.append(green)
            contexts.append(call(driver.cuCtxFromGreenCtx, green))
        self.reduce_context, self.rest_context = contexts
        self.reduce_handle, self.rest_handle = self.handles

    def describe(self) -> Dict[str, Any]:
        return {"requested_sms": self.requested, "reduce_sms": self.reduce_sms,
                "rest_sms": self.rest_sms, "launch_mode": self.mode, "errors": self.errors}

    def close(self) -> None:
        for handle in self.handles:
            self.study.driver.cuGreenCtxDestroy(handle)
        self.handles.clear()


class _Study:
    """Buffers, streams, kernels and measurements of one run on one GPU."""

    def __init__(self, args: argparse.Namespace):
        import torch
        from cuda.bindings import driver

        from hoccl.backends import cuda as backend
        self.args, self.torch, self.driver, self.backend = args, torch, driver, backend
        self.call = backend._call  # hoccl's checked driver gateway
        self.ordinal = args.device
        torch.cuda.set_device(self.ordinal)
        self.device = backend.open_device(self.ordinal, max_sms=args.base_sms,
                                          copy_sms=args.base_sms)
        self.sm_count = self.device.sm_count
        self.device.activate()
        least, greatest = self.call(driver.cuCtxGetStreamPriorityRange)
        self.priorities = {"least": int(least), "greatest": int(greatest)}
        self.streams: Dict[Tuple[str, str, str], Tuple[Any, Any]] = {}
        self.greens: Dict[int, _Green] = {}
        self.green_errors: Dict[int, str] = {}
        self.modules: Dict[Tuple[int, int, int], Dict[str, Any]] = {}
        self.checked: Dict[str, str] = {}
        cuda = f"cuda:{self.ordinal}"
        m = args.gemm
        self.a = torch.randn(m, m, dtype=torch.bfloat16, device=cuda)
        self.b = torch.randn(m, m, dtype=torch.bfloat16, device=cuda)
        self.c = torch.empty(m, m, dtype=torch.bfloat16, device=cuda)
        self.nbytes = parse_size(args.bytes)
        count = self.nbytes // 2
        self.x = torch.randn(count, dtype=torch.bfloat16, device=cuda)
        self.y = torch.randn(count, dtype=torch.bfloat16, device=cuda)
        self.out = torch.empty(count, dtype=torch.bfloat16, device=cuda)
        #: (SM, start ns, end ns) per traced block
        self.trace = torch.zeros(3 * _TRACE_SLOTS, dtype=torch.int64, device=cuda)

    # -- resources --------------------------------------------------------------------
    def stream(self, role: str, priority: str, green: str = "",
               green_sms: int = 0) -> Tuple[Any, Any]:
        """``(CUstream, torch stream)``: the non-blocking stream of ``role`` ("gemm" or
        "reduce": never one stream for both, whatever their priorities) and ``priority``;
        in the green context ``green`` ("reduce" or "rest") of the ``green_sms`` split
        when given."""
        key = (role, priority, f"{green}:{green_sms}" if green else "")
        if key not in self.streams:
            driver = self.driver
            self.device.activate()
            flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
            if green:
                part = self.green(green_sms)
                handle = self.call(driver.cuGreenCtxStreamCreate,
                                   part.reduce_handle if green == "reduce" else part.rest_handle,
                                   int(flags), self.priorities[priority])
            else:
                handle = self.call(driver.cuStreamCreateWithPriority, flags,
                                   self.priorities[priority])
            wrapped = self.torch.cuda.ExternalStream(int(handle), device=f"cuda:{self.ordinal}")
            self.streams[key] = (handle, wrapped)
        return self.streams[key]

    def green(self, sms: int) -> _Green:
        """The green contexts of the ``sms`` split, made once (a refusal is kept and raised
        again: the driver will not change its mind within the run)."""
        if sms in self.green_errors:
            raise RuntimeError(self.green_errors[sms])
        if sms not in self.greens:
            self.device.activate()
            try:
                self.greens[sms] = _Green(self, sms)
            except Exception as error:
                self.green_errors[sms] = f"green contexts of {sms} SMs: " \
                                         f"{type(error).__name__}: {error}"
                raise
        return self.greens[sms]

    def module(self, threads: int, unroll: int, context: Any = None) -> Dict[str, Any]:
        """The study's kernels for a block shape, loaded in the primary context or, with
        ``context``, while that (green) context is current."""
        key = (threads, unroll, int(context) if context is not None else 0)
        if key not in self.modules:
            import cupy
            options = study_options(threads, unroll)
            try:
                if context is not None:
                    # cupy keeps loaded modules by source and options: a distinct option,
                    # so that the module loaded in the primary context is not returned
                    options.append(f"-DHOCCL_LEVERS_CONTEXT={int(context)}")
                    self.call(self.driver.cuCtxSetCurrent, context)
                    source = cupy.RawModule(code=study_source(), options=tuple(options))
                    functions = [self.backend._function(source, name) for name in
                                 ("hoccl_levers_sum", "hoccl_levers_traced_sum")]
                else:
                    with cupy.cuda.Device(self.ordinal):
                        source = cupy.RawModule(code=study_source(), options=tuple(options))
                        functions = [self.backend._function(source, name) for name in
                                     ("hoccl_levers_sum", "hoccl_levers_traced_sum")]
            finally:
                self.device.activate()
            self.modules[key] = {"module": source, "sum": functions[0], "traced": functions[1]}
        return self.modules[key]

    def close(self) -> None:
        """Streams, then green contexts, then the device (torch's buffers are torch's)."""
        self.torch.cuda.synchronize(self.ordinal)
        self.device.activate()
        for handle, _ in self.streams.values():
            self.device.synchronize_stream(handle, 30.0)
            self.driver.cuStreamDestroy(handle)
        self.streams.clear()
        for part in self.greens.values():
            part.close()
        self.greens.clear()
        self.device.close()

    # -- launches ---------------------------------------------------------------------
    def launch_traced(self, function: Any, stream: Any, count: int, slot: int, *,
                      blocks: Optional[int] = None, sms: int = 1 << 20,
                      offset: int = 0) -> Tuple[int, int]:
        """One traced sum of ``count`` elements at byte ``offset`` on at most ``sms`` blocks
        (``blocks``: exactly that many), recorded from trace slot ``slot``.  Returns
        ``(slot, blocks)``."""
        output = self.out.data_ptr() + offset
        inputs = [self.x.data_ptr() + offset, self.y.data_ptr() + offset]
        args, grid, threads = self.device._reduce_arguments(output, inputs, count, 2, 2, sms)
        grid = blocks or grid
        if slot + grid > _TRACE_SLOTS:
            raise ValueError(f"launch_traced: {slot + grid} trace slots needed, "
                             f"{_TRACE_SLOTS} allocated")
        trace = ctypes.c_uint64(self.trace.data_ptr() + 24 * slot)
        parameters = (ctypes.c_void_p * 2)(ctypes.addressof(args), ctypes.addressof(trace))
        self.call(self.driver.cuLaunchKernel, function, grid, 1, 1, threads, 1, 1, 0, stream,
                  ctypes.addressof(parameters), 0)
        return slot, grid

    def blocks_of(self, launches: Sequence[Tuple[int, int]]) -> List[List[Block]]:
        """The recorded blocks of launches given as ``(first slot, blocks)``."""
        words = self.trace.view(-1, 3).cpu().tolist()
        return [[(words[slot + k][0], words[slot + k][1], words[slot + k][2])
                 for k in range(count)] for slot, count in launches]

    def launcher(self, variant: Variant) -> Tuple[Callable[[int, int], None], Any, str]:
        """``(launch(byte offset, elements), CUstream, kernel)``: one launch of the sum as
        ``variant`` runs it; each way of launching is checked once on a small sum."""
        handle, _ = self.stream("reduce", variant.reduce_priority,
                                "reduce" if variant.green else "",
                                variant.sms)
        out, x, y = self.out.data_ptr(), self.x.data_ptr(), self.y.data_ptr()
        device = self.device
        launch: Callable[[int, int], None]
        if variant.torch:
            torch = self.torch
            _, wrapped = self.stream("reduce", variant.reduce_priority)

            def torch_sum(offset: int, count: int) -> None:
                first = offset // 2  # bf16 elements
                with torch.cuda.stream(wrapped):
                    torch.add(self.x[first:first + count], self.y[first:first + count],
                              out=self.out[first:first + count])
            launch, kernel = torch_sum, "torch.add (whole GPU)"
        elif variant.hoccl_kernel:
            def hoccl_sum(offset: int, count: int) -> None:
                device.reduce(handle, out + offset, [x + offset, y + offset], count,
                              "bfloat16", "sum", sms=variant.sms)
            launch, kernel = hoccl_sum, "hoccl's kernel (Device.reduce)"
        elif not variant.green:
            function = self.module(variant.threads, variant.unroll)["sum"]

            def rebuilt_sum(offset: int, count: int) -> None:
                device.activate()
                device._launch_reduce(function, handle, out + offset, [x + offset, y + offset],
                                      count, 2, 2, variant.sms, threads=variant.threads)
            launch, kernel = rebuilt_sum, f"hoccl's sum built {variant.threads}x{variant.unroll}"
        else:
            launch, kernel = self.green_launch(variant, handle)
        if kernel not in self.checked:
            self.check_sum(launch, handle, kernel)
        return launch, handle, kernel

    def pipeline(self, variant: Variant,
                 plan: List[Tuple[int, int]]) -> Tuple[Callable[[], None], str]:
        """``(call, kernel)`` of the pipeline lever: a copy stream copies chunk k of the
        second input from ``y`` into ``landed`` (a copy engine), then writes k + 1 past the
        call's base into a flag; the reduction stream sums ``x`` and ``landed`` into
        ``out`` chunk by chunk once each flag is up: a wait and a launch per chunk, or one
        ``reduce_chunks`` launch (``variant.fused``).  A call's copies start once the
        previous call's sums are done (an event), as a collective's scratch is reused.
        Checked bit for bit once per way."""
        torch, device = self.torch, self.device
        handle, _ = self.stream("reduce", variant.reduce_priority)
        copier, _ = self.stream("copy", "greatest")
        if not hasattr(self, "landed"):
            self.landed = torch.empty_like(self.y)
            self.flag = torch.zeros(2, dtype=torch.int64, device=self.y.device)
            self.flag_base = 0
            self.done_event = self.call(self.driver.cuEventCreate,
                                        self.driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            self.call(self.driver.cuEventRecord, self.done_event, handle)
        out, x, y, landed = (self.out.data_ptr(), self.x.data_ptr(), self.y.data_ptr(),
                             self.landed.data_ptr())
        flag = self.flag.data_ptr()
        stride = plan[0][1] if len(plan) > 1 else 0

        def call() -> None:
            base = self.flag_base
            self.flag_base += len(plan)
            self.call(self.driver.cuStreamWaitEvent, copier, self.done_event, 0)
            for k, (offset, count) in enumerate(plan):
                device.copy(copier, landed + offset, y + offset, 2 * count)
                device.write_value(copier, flag, base + k + 1)
            if variant.fused and len(plan) > 1:
                device.reduce_chunks(handle, [flag], base + 1, out, [x, landed], plan[0][1],
                                     plan[-1][1], len(plan), stride, "bfloat16", "sum",
                                     sms=variant.sms)
            else:
                for k, (offset, count) in enumerate(plan):
                    device.wait_value(handle, flag, base + k + 1)
                    device.reduce(handle, out + offset, [x + offset, landed + offset], count,
                                  "bfloat16", "sum", sms=variant.sms)
            self.call(self.driver.cuEventRecord, self.done_event, handle)

        kernel = ("hoccl's chunked launch (Device.reduce_chunks)" if variant.fused
                  else "hoccl's kernel per chunk after a stream wait")
        if kernel not in self.checked:
            self.out.fill_(float("nan"))
            self.landed.fill_(float("nan"))
            torch.cuda.synchronize(self.ordinal)
            call()
            device.synchronize_stream(handle, 30.0)
            want = (self.x.float() + self.y.float()).to(torch.bfloat16)
            wrong = int((self.out.view(torch.int16) != want.view(torch.int16)).sum())
            if wrong:
                raise RuntimeError(f"{kernel}: {wrong} of {self.out.numel()} sums wrong")
            self.checked[kernel] = "bit-exact"
        return call, kernel

    def green_launch(self, variant: Variant,
                     handle: Any) -> Tuple[Callable[[int, int], None], str]:
        """Launches into the reduction's green context: hoccl's kernel as loaded (in the
        primary context), or where the driver refuses that, the study's copy of it loaded
        while the green context is current."""
        part = self.green(variant.sms)
        out, x, y = self.out.data_ptr(), self.x.data_ptr(), self.y.data_ptr()
        device = self.device

        def primary(offset: int, count: int) -> None:
            device.reduce(handle, out + offset, [x + offset, y + offset], count, "bfloat16",
                          "sum", sms=part.reduce_sms)

        name = "hoccl's kernel (Device.reduce) into a green context"
        if not part.mode:
            try:
                self.check_sum(primary, handle, name)
                part.mode = "primary module"
            except Exception as error:  # recorded; the other way is tried
                part.errors.append(f"{name}: {type(error).__name__}: {error}")
                part.mode = "green module"
        if part.mode == "primary module":
            return primary, name
        function = self.module(1024, 2, part.reduce_context)["sum"]

        def green(offset: int, count: int) -> None:
            self.call(self.driver.cuCtxSetCurrent, part.reduce_context)
            try:
                device._launch_reduce(function, handle, out + offset, [x + offset, y + offset],
                                      count, 2, 2, part.reduce_sms)
            finally:
                device.activate()
        return green, "hoccl's sum loaded in the green context"

    def check_sum(self, launch: Callable[[int, int], None], handle: Any, name: str) -> None:
        """``launch(0, count)`` on a poisoned output, compared bit for bit with torch's sum
        (both add in float32 and round once)."""
        torch = self.torch
        count = min(1 << 20, self.nbytes // 2)
        self.out[:count].fill_(float("nan"))
        torch.cuda.synchronize(self.ordinal)
        launch(0, count)
        self.device.synchronize_stream(handle, 30.0)
        want = (self.x[:count].float() + self.y[:count].float()).to(torch.bfloat16)
        wrong = int((self.out[:count].view(torch.int16) != want.view(torch.int16)).sum())
        if wrong:
            raise RuntimeError(f"{name}: {wrong} of {count} sums wrong")
        self.checked[name] = "bit-exact"

    # -- timing -----------------------------------------------------------------------
    def gemms(self, stream: Any, count: int) -> None:
        with self.torch.cuda.stream(stream):
            for _ in range(count):
                self.torch.matmul(self.a, self.b, out=self.c)

    def events(self, count: int) -> List[Any]:
        return [self.torch.cuda.Event(enable_timing=True) for _ in range(count)]

    def time_gemms(self, stream: Any, count: int) -> float:
        """Seconds for ``count`` GEMMs back to back."""
        self.torch.cuda.synchronize(self.ordinal)
        start, end = self.events(2)
        start.record(stream)
        self.gemms(stream, count)
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def time_calls(self, call: Callable[[], None], stream: Any, count: int) -> Tuple[float, float]:
        """(GPU seconds, host seconds) per call over ``count`` calls back to back."""
        self.torch.cuda.synchronize(self.ordinal)
        start, end = self.events(2)
        start.record(stream)
        began = time.perf_counter()
        for _ in range(count):
            call()
        host = time.perf_counter() - began
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / count, host / count

    def measure(self, variant: Variant) -> Dict[str, Any]:
        """One round of one variant: the GEMMs alone, the sums alone, then both at once
        (the GEMM loop enqueued first, then sums enough to outlast it; the sums' rate
        beside counts the calls that ended while the GEMMs ran)."""
        args, torch = self.args, self.torch
        plan = pieces(self.nbytes, variant.chunk_bytes, 2)
        if variant.lever == "pipeline":
            call, kernel = self.pipeline(variant, plan)
        else:
            launch, _, kernel = self.launcher(variant)

            def call() -> None:
                for offset, count in plan:
                    launch(offset, count)
        _, gemm_stream = self.stream("gemm", variant.gemm_priority,
                                     "rest" if variant.green == "both" else "", variant.sms)
        _, reduce_stream = self.stream("reduce", variant.reduce_priority,
                                       "reduce" if variant.green else "", variant.sms)
        flops = 2.0 * args.gemm ** 3
        self.gemms(gemm_stream, 3)  # warm-up: cuBLAS picks its kernel, clocks ramp up
        gemm_alone = self.time_gemms(gemm_stream, args.gemms)
        probe, _ = self.time_calls(call, reduce_stream, 1)
        calls_alone = max(3, min(50, int(0.05 / max(probe, 1e-6))))
        reduce_alone, host_per_call = self.time_calls(call, reduce_stream, calls_alone)
        # enough calls to outlast the GEMM loop even if the GEMMs slow down 2.5-fold
        calls = max(2, min(4000, math.ceil(2.5 * gemm_alone / reduce_alone) + 2))
        torch.cuda.synchronize(self.ordinal)
        gemm_start, gemm_end, reduce_start = self.events(3)
        done = self.events(calls)
        gemm_start.record(gemm_stream)
        self.gemms(gemm_stream, args.gemms)
        gemm_end.record(gemm_stream)
        reduce_start.record(reduce_stream)
        for event in done:
            call()
            event.record(reduce_stream)
        done[-1].synchronize()
        gemm_end.synchronize()
        gemm_beside = gemm_start.elapsed_time(gemm_end) / 1e3
        lag = gemm_start.elapsed_time(reduce_start) / 1e3
        ends = [reduce_start.elapsed_time(event) / 1e3 for event in done]
        within = [end for end in ends if lag + end <= gemm_beside]
        moved = 3 * self.nbytes
        return {
            "gemm_tflops_alone": flops * args.gemms / gemm_alone / 1e12,
            "gemm_tflops_beside": flops * args.gemms / gemm_beside / 1e12,
            "slowdown_pct": 100 * (gemm_beside / gemm_alone - 1),
            "reduce_gbps_alone": moved / reduce_alone / 1e9,
            "reduce_gbps_beside": (moved * len(within) / within[-1] / 1e9) if within else None,
            "reduce_outlasted_gemm": lag + ends[-1] >= gemm_beside,
            "reduce_calls_within_gemm": len(within),
            "host_us_per_call": host_per_call * 1e6,
            "gpu_us_per_call_alone": reduce_alone * 1e6,
            "kernel": kernel,
        }

    # -- probes -----------------------------------------------------------------------
    def dated_gemms(self, count: int, traced: Any) -> List[Tuple[int, int]]:
        """Enqueue ``count`` GEMMs on the least-priority GEMM stream with a one-block traced
        marker before each and after the last; returns the markers' launches."""
        handle, stream = self.stream("gemm", "least")
        markers = []
        for index in range(count + 1):
            self.device.activate()
            markers.append(self.launch_traced(traced, handle, 8, index, blocks=1))
            if index < count:
                self.gemms(stream, 1)
        return markers

    def probe(self, kind: str, sms: int = 0) -> Dict[str, Any]:
        """A dated loop of 12 GEMMs alone (``kind`` "gemm"), beside back-to-back launches
        of 2 x SMs short blocks ("idle"), or beside the chunked sum on ``sms`` blocks on
        hoccl's lane priority ("waits")."""
        torch = self.torch
        traced = self.module(1024, 2)["traced"]
        handle, reduce_stream = self.stream("reduce", "greatest")
        gemm_count = 12
        if kind == "waits":  # enough launches to cover the GEMM loop 1.5 times
            chunk = parse_size(self.args.chunk_bytes)
            plan = pieces(self.nbytes, chunk, 2)
            launch, _, _ = self.launcher(Variant("sms", sms, chunk))
            seconds, _ = self.time_calls(lambda: launch(*plan[0]), reduce_stream, 4)
            _, gemm_stream = self.stream("gemm", "least")
            gemm_seconds = self.time_gemms(gemm_stream, 2) / 2
            wanted = math.ceil(1.5 * gemm_count * gemm_seconds / seconds)
            plan = (plan * (wanted // len(plan) + 1))[:min(wanted, (_TRACE_SLOTS - 64) // sms)]
        torch.cuda.synchronize(self.ordinal)
        markers = self.dated_gemms(gemm_count, traced)
        slot = len(markers)
        launches = []
        if kind == "idle":
            # each block sums 16 vectors per thread (~10 µs on an SM of its own)
            count = 2 * self.sm_count * 1024 * 8 * 16
            count = min(count, self.nbytes // 2) // 16 * 16
            for _ in range(16):
                launches.append(self.launch_traced(traced, handle, count, slot,
                                                   blocks=2 * self.sm_count))
                slot += 2 * self.sm_count
        elif kind == "waits":
            for offset, count in plan:
                launches.append(self.launch_traced(traced, handle, count, slot, sms=sms,
                                                   offset=offset))
                slot += launches[-1][1]
        torch.cuda.synchronize(self.ordinal)
        self.device.synchronize_stream(handle, 30.0)
        result = residency([block for launch in self.blocks_of(markers) for block in launch],
                           self.blocks_of(launches))
        result["gemms"] = gemm_count
        return result

    def probes(self) -> Dict[str, Any]:
        plans = [("GEMM alone, dated", "gemm", 0), ("idle SMs beside the GEMM", "idle", 0)]
        plans += [(f"waits at {sms} SMs beside the GEMM", "waits", sms)
                  for sms in _counts(self.args.probe_sms)]
        found: Dict[str, Any] = {}
        for name, kind, sms in plans:
            try:
                found[name] = self.probe(kind, sms)
            except Exception as error:  # a probe that fails is reported, not fatal
                found[name] = {"error": f"{type(error).__name__}: {error}"}
        return found

    def confinement(self, part: _Green) -> Dict[str, Any]:
        """The SMs the traced kernel reaches from a stream of each green context."""
        seen = {}
        for name, context, blocks in (("reduce", part.reduce_context, 4 * part.reduce_sms),
                                      ("rest", part.rest_context, 2 * self.sm_count)):
            role = "reduce" if name == "reduce" else "gemm"
            handle, _ = self.stream(role, "greatest", name, part.requested)
            green_module = part.mode == "green module"
            traced = self.module(1024, 2, context if green_module else None)["traced"]
            if green_module:
                self.call(self.driver.cuCtxSetCurrent, context)
            try:
                self.launch_traced(traced, handle, 8, 0, blocks=blocks)
            finally:
                self.device.activate()
            self.device.synchronize_stream(handle, 30.0)
            seen[name] = {block[0] for block in self.blocks_of([(0, blocks)])[0]}
        return {"reduce_partition_sms_seen": len(seen["reduce"]),
                "rest_partition_sms_seen": len(seen["rest"]),
                "shared_sms": len(seen["reduce"] & seen["rest"])}

    # -- the timeline -------------------------------------------------------------------
    def timeline(self, variant: Variant, folder: str) -> Dict[str, Any]:
        """torch.profiler's kernel records of the GEMM loop alone, then beside the sums;
        written to ``timeline.json``, summarised per kernel."""
        from torch.profiler import ProfilerActivity, profile
        torch = self.torch
        launch, handle, _ = self.launcher(variant)
        plan = pieces(self.nbytes, variant.chunk_bytes, 2)

        def call() -> None:
            for offset, count in plan:
                launch(offset, count)
        _, gemm_stream = self.stream("gemm", variant.gemm_priority)
        _, reduce_stream = self.stream("reduce", variant.reduce_priority)
        gemm_count = min(self.args.gemms, 20)
        # sums enough to cover the GEMM loop (1.2 times its time alone)
        call_seconds, _ = self.time_calls(call, reduce_stream, 1)
        gemm_seconds = self.time_gemms(gemm_stream, gemm_count)
        calls = max(2, min(200, math.ceil(1.2 * gemm_seconds / call_seconds)))
        phases: Dict[str, List[Dict[str, Any]]] = {}
        for phase in ("alone", "beside"):
            torch.cuda.synchronize(self.ordinal)
            with profile(activities=[ProfilerActivity.CUDA]) as profiler:
                self.gemms(gemm_stream, gemm_count)
                if phase == "beside":
                    for _ in range(calls):
                        call()
                torch.cuda.synchronize(self.ordinal)
                self.device.synchronize_stream(handle, 30.0)
            with tempfile.TemporaryDirectory() as scratch:
                path = os.path.join(scratch, "trace.json")
                profiler.export_chrome_trace(path)
                with open(path) as stream:
                    events = json.load(stream).get("traceEvents", [])
            phases[phase] = kernels_of(events)
        with open(os.path.join(folder, "timeline.json"), "w") as stream:
            json.dump({"variant": asdict(variant), "label": variant.label, **phases}, stream,
                      indent=1)
        return {phase: kernel_summary(kernels) for phase, kernels in phases.items()}

    # -- the run --------------------------------------------------------------------------
    def run(self) -> Dict[str, Any]:
        args, torch = self.args, self.torch
        os.makedirs(args.out, exist_ok=True)
        kernel: Dict[str, Any] = {"threads": 1024}
        try:
            function = self.device._kernels().reduce["bfloat16", "sum"]
            kernel["registers"] = self.call(
                self.driver.cuFuncGetAttribute,
                self.driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, function)
        except Exception as error:  # reported, not needed
            kernel["error"] = str(error)
        print(f"# levers: {torch.cuda.get_device_name(self.ordinal)}, {self.sm_count} SMs, "
              f"stream priorities {self.priorities}, reduction kernel {kernel}", flush=True)
        _, gemm_stream = self.stream("gemm", "least")
        self.gemms(gemm_stream, 5)
        gemm_alone = self.time_gemms(gemm_stream, args.gemms)
        probes = self.probes()
        for name, probe in probes.items():
            print(f"# probe {name}: " + (probe["error"] if "error" in probe else
                  f"started mid-GEMM on {probe['idle_sm_count']} SMs, starts "
                  f"{probe['block_starts']}, wait µs {probe['wait_us']}, GEMM µs "
                  f"{probe['gemm_us']}"), flush=True)
        idle = probes["idle SMs beside the GEMM"].get("idle_sm_count")
        args.sm_count = self.sm_count
        chosen = variants(args, idle_sms=idle if idle and idle < self.sm_count else None)
        measured: Dict[Variant, List[Dict[str, Any]]] = {variant: [] for variant in chosen}
        errors: Dict[Variant, str] = {}
        for round_index in range(args.rounds):
            for variant in chosen:
                if variant in errors:
                    continue
                try:
                    entry = self.measure(variant)
                except Exception as error:  # e.g. green contexts refused: recorded, not fatal
                    errors[variant] = f"{type(error).__name__}: {error}"
                    print(f"  {variant.lever:9s} {variant.label}: failed: {errors[variant]}",
                          flush=True)
                    continue
                measured[variant].append(entry)
                print(f"  [{round_index + 1}] {variant.lever:9s} {variant.label:62s} GEMM "
                      f"{entry['gemm_tflops_beside']:4.0f} TFLOP/s "
                      f"({entry['slowdown_pct']:+5.1f} %)  sum "
                      f"{entry['reduce_gbps_alone']:5.0f} GB/s alone, "
                      f"{_number(entry['reduce_gbps_beside'])} beside", flush=True)
        records = [self.record(variant, measured[variant], errors.get(variant))
                   for variant in chosen]
        green: Dict[int, Any] = {sms: {"error": error} for sms, error in self.green_errors.items()}
        for sms, part in self.greens.items():
            green[sms] = part.describe()
            try:
                green[sms]["confinement"] = self.confinement(part)
            except Exception as error:  # reported, not fatal
                green[sms]["confinement"] = f"failed: {type(error).__name__}: {error}"
        timeline: Dict[str, Any] = {}
        if not args.no_profile:
            try:
                timeline = self.timeline(Variant("sms", args.base_sms,
                                                 parse_size(args.chunk_bytes)), args.out)
            except Exception as error:  # reported, not fatal
                timeline = {"error": f"{type(error).__name__}: {error}"}
        from hoccl.bench._harness import metadata
        return {"meta": metadata(sys.argv), "gpu": torch.cuda.get_device_name(self.ordinal),
                "sm_count": self.sm_count, "priorities": self.priorities, "gemm": args.gemm,
                "gemms": args.gemms, "bytes": self.nbytes, "rounds": args.rounds,
                "gemm_tflops_alone": 2.0 * args.gemm ** 3 * args.gemms / gemm_alone / 1e12,
                "kernel": kernel, "checked": self.checked, "records": records,
                "probes": probes, "green": green, "timeline": timeline}

    def record(self, variant: Variant, measured: List[Dict[str, Any]],
               error: Optional[str]) -> Dict[str, Any]:
        """A variant's row: its setting and the median of each figure over the rounds."""
        part = self.greens.get(variant.sms) if variant.green else None
        blocks = part.reduce_sms if part is not None else min(variant.sms, self.sm_count)
        record: Dict[str, Any] = {
            **asdict(variant), "label": variant.label, "blocks": f"{blocks} x {variant.threads}",
            "launches_per_call": (1 if variant.fused
                                  else launches_per_call(self.nbytes, variant.chunk_bytes)),
            "rounds": len(measured)}
        if error:
            record["error"] = error
        if not measured:
            return record
        for key, value in measured[0].items():
            if isinstance(value, bool):
                record[key] = all(entry[key] for entry in measured)
            elif isinstance(value, (int, float)) or value is None:
                values = [entry[key] for entry in measured if entry[key] is not None]
                record[key] = statistics.median(values) if values else None
            else:
                record[key] = value
        notes = []
        if not record["reduce_outlasted_gemm"]:
            notes.append("the sums ended before the GEMMs: the slowdown is a lower bound")
        if record["host_us_per_call"] > 0.8 * record["gpu_us_per_call_alone"]:
            notes.append("launches host-bound")
        record["note"] = "; ".join(notes)
        record["all_rounds"] = measured
        return record


def kernels_of(events: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Kernel records of a chrome trace (torch.profiler's export), times relative to the
    first kernel, in µs."""
    kernels = [event for event in events if event.get("cat") == "kernel"]
    if not kernels:
        return []
    origin = min(event["ts"] for event in kernels)
    found = []
    for event in sorted(kernels, key=lambda event: event["ts"]):
        extra = event.get("args", {})
        found.append({"name": event.get("name", ""), "start_us": event["ts"] - origin,
                      "dur_us": event.get("dur", 0.0), "stream": extra.get("stream"),
                      "grid": extra.get("grid"), "block": extra.get("block"),
                      "registers": extra.get("registers per thread"),
                      "shared_memory": extra.get("shared memory"),
                      "blocks_per_sm": extra.get("blocks per SM"),
                      "occupancy_pct": extra.get("est. achieved occupancy %")})
    return found


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = arguments(argv)
    from hoccl.bench._harness import require
    require("python benchmarks/levers.py", local=1)
    study = _Study(args)
    try:
        result = study.run()
    finally:
        study.close()
    report(result, args.out, "levers", markdown(result))
    print()
    print(table(result))


if __name__ == "__main__":
    main()
