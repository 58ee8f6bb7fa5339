"""python -m hoccl.bench.train: an FSDP2 training step on NCCL and on hoccl, in one run.

A Llama-style decoder (RMSNorm, rotary causal attention through SDPA, SwiGLU MLP) is
sharded with FSDP2 in bf16 (fp32 gradient reduction) once per library, from the same
initial weights; then trials alternate between the libraries (so drift in clocks or
temperature hits all of them alike) over a sweep of shapes, from compute-bound to
communication-heavy.  Libraries:

* ``nccl`` (``gloo`` on CPU): FSDP2 on the default process group;
* ``hoccl``: FSDP2 on a hoccl process group (``dist.new_group(backend="hoccl")``);
* ``hoccl-hooks``: FSDP2 on the default group, its all-gathers and reduce-scatters
  through ``hoccl.torch.use_for_fsdp`` (all-gathers into registered memory);
* ``hoccl-hooks-plain``: the same with ``registered=False`` (plain tensors, exchanged
  per call).

Any hoccl library may carry settings, as in the other benchmarks:
``hoccl-hooks+max_sms=32+chunk_bytes=128M`` runs on a hoccl group of its own made with
those settings (``hoccl.torch.Options``: max_sms, copy_sms, chunk_bytes, copy_lanes,
one_shot_bytes, pull_bytes, kernel_bytes, kernel_sms; sizes may say K, M or G).

Per shape and library it prints the median step time, tokens/s (global), the ratio to
the baseline, and the exposed communication per step, from a torch.profiler trace of a
few more steps on each GPU: the time during which communication work runs on the GPU
(NCCL kernels; hoccl's copy-engine copies and its reduce/copy kernels) while no compute
kernel runs on any stream.  Work invisible to the profiler is not in it: hoccl's waits
for its peers are stream memory operations, so a step stalled on them shows as idle
time (its own column), while NCCL waits inside its kernels.  On CPU there is no device
timeline and both columns are empty.  JSON, Markdown and a PNG go to ``--out``.

  mpirun -np 2 python -m hoccl.bench.train                     # GPUs: nccl vs hoccl
  mpiexec -n 2 python -m hoccl.bench.train --shapes tiny       # CPU: gloo vs hoccl host
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..config import SETTINGS as CONFIG_SETTINGS
from ._model import SHAPES, Decoder, ModelShape, batch, optimizer_for, shard, train_step

__all__ = ["ModelShape", "Decoder", "SHAPES", "exposed", "main"]


# -- launching -----------------------------------------------------------------------------------
def launch_env() -> Tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's or mpirun's environment."""
    for rank, size, local in (("RANK", "WORLD_SIZE", "LOCAL_RANK"),
                              ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                               "OMPI_COMM_WORLD_LOCAL_RANK"),
                              ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")):
        if rank in os.environ:
            rank_value = int(os.environ[rank])
            return rank_value, int(os.environ[size]), int(os.environ.get(local, rank_value))
    return 0, 1, 0


def init_distributed(backend: str) -> Tuple[int, int, torch.device]:
    """torch.distributed with ``backend`` as the default group (env:// rendezvous; under
    mpirun MASTER_ADDR defaults to 127.0.0.1 and MASTER_PORT to 29500)."""
    import torch.distributed as dist
    if backend == "hoccl":
        import hoccl.torch  # noqa: F401  registers the backend
    rank, world_size, local_rank = launch_env()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    return rank, world_size, device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- exposed communication --------------------------------------------------------------------
def is_communication(name: str) -> bool:
    """A device activity that moves data between ranks: NCCL's kernels, hoccl's kernels and
    its peer copies (copy engines)."""
    return name.startswith(("nccl", "hoccl_")) or name.startswith("Memcpy PtoP")


def exposed(activities: Iterable[Tuple[float, float, bool]]) -> Dict[str, float]:
    """From device activities ``(start, end, is_communication)``: the time some activity
    runs ("busy"), communication runs ("communication"), communication runs while no
    compute does ("exposed"), and nothing runs ("idle"), within the span of all of them."""
    points = []
    for start, end, communication in activities:
        if end > start:
            points += [(start, 1, communication), (end, -1, communication)]
    if not points:
        return {"span": 0.0, "busy": 0.0, "communication": 0.0, "exposed": 0.0, "idle": 0.0}
    points.sort(key=lambda point: (point[0], point[1]))
    running = {True: 0, False: 0}
    totals = {"busy": 0.0, "communication": 0.0, "exposed": 0.0}
    last = points[0][0]
    for time_point, change, communication in points:
        width = time_point - last
        if running[True] or running[False]:
            totals["busy"] += width
        if running[True]:
            totals["communication"] += width
            if not running[False]:
                totals["exposed"] += width
        running[communication] += change
        last = time_point
    span = points[-1][0] - points[0][0]
    return {"span": span, **totals, "idle": span - totals["busy"]}


def profile_steps(run_steps, steps: int, device: torch.device) -> Optional[Dict[str, Any]]:
    """Per-step averages of ``exposed`` over ``steps`` profiled steps (None on CPU)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        run_steps(steps)
        synchronize(device)
    # device work only: kernels, copies, memsets.  Not the GPU spans of user annotations
    # (record_function ranges such as a process group's "nccl:all_gather..." or FSDP's own),
    # which cover other work and, counted as compute, would hide the communication under
    # them
    events = [event for event in profiler.events()
              if event.device_type == torch.autograd.DeviceType.CUDA
              and not getattr(event, "is_user_annotation", False)]
    activities = [(event.time_range.start, event.time_range.end, is_communication(event.name))
                  for event in events]
    totals = exposed(activities)
    found: Dict[str, Any] = {key: value / steps / 1000 for key, value in totals.items()}
    # what the columns were made of: the device activities with the most time, each with
    # its ms per step and whether it counted as communication
    by_name: Dict[str, float] = {}
    for event in events:
        by_name[event.name] = by_name.get(event.name, 0.0) + event.time_range.elapsed_us()
    found["activities"] = [[name[:80], round(total / steps / 1000, 3), is_communication(name)]
                           for name, total in sorted(by_name.items(), key=lambda item: -item[1])
                           [:15]]
    return found


def profile_host(run_steps, steps: int, device: torch.device) -> List[List[Any]]:
    """Where the host's time goes over ``steps`` more steps (cProfile, this rank): the
    functions with the most time of their own, as [function, calls per step, ms per step
    of its own, ms per step with what it calls]."""
    import cProfile
    import pstats
    synchronize(device)
    profiler = cProfile.Profile()
    profiler.enable()
    run_steps(steps)
    synchronize(device)
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, function), (_, calls, own, total, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(path)}:{line}({function})" if line else function
        rows.append([where[:100], round(calls / steps, 1), round(own / steps * 1000, 3),
                     round(total / steps * 1000, 3)])
    rows.sort(key=lambda row: -row[2])
    return rows[:25]


# -- the benchmark -------------------------------------------------------------------------------
@dataclass
class Library:
    name: str
    model: nn.Module
    optimizer: Any
    losses: List[torch.Tensor]  # kept on the device: reading one would synchronize
    hooks: Any = None           # hoccl.torch.FSDPHooks of the hoccl-hooks libraries


LIBRARIES = ("hoccl", "hoccl-hooks", "hoccl-hooks-plain")


def parse_library(name: str, baseline: str) -> Tuple[str, Dict[str, Any]]:
    """``hoccl-hooks+max_sms=32+chunk_bytes=128M`` -> ("hoccl-hooks", {"max_sms": 32, ...})."""
    from ._harness import parse_size
    base, *assignments = name.split("+")
    if base not in (baseline,) + LIBRARIES or (base == baseline and assignments):
        raise ValueError(f"--libraries: unknown library {name!r}; expected {baseline} or one of "
                         f"{list(LIBRARIES)}, the latter optionally with +setting=value")
    settings: Dict[str, Any] = {}
    for assignment in assignments:
        key, separator, value = assignment.partition("=")
        if not separator or key not in SETTINGS:
            raise ValueError(f"--libraries: {name!r}: expected +setting=value with a setting of "
                             f"{list(SETTINGS)}; got {assignment!r}")
        try:
            settings[key] = parse_size(value)
        except ValueError:
            raise ValueError(f"--libraries: {name!r}: {key} must be a number (K, M, G allowed); "
                             f"got {value!r}") from None
    return base, settings


#: the settings a library name may carry: every ``hoccl.Config`` field but the timeout
SETTINGS = tuple(name for name in CONFIG_SETTINGS if name != "timeout")


def hoccl_groups(names: Sequence[str], baseline: str, max_sms: int) -> Dict[str, Any]:
    """One hoccl process group per distinct set of settings, made in the order of ``names``
    (the same on every rank); keyed by library name."""
    import torch.distributed as dist
    import hoccl.torch
    made: Dict[Tuple[Tuple[str, Any], ...], Any] = {}
    groups = {}
    for name in names:
        base, settings = parse_library(name, baseline)
        if base == baseline:
            continue
        settings = {"max_sms": max_sms, **settings}
        key = tuple(sorted(settings.items()))
        if key not in made:
            made[key] = dist.new_group(backend="hoccl", pg_options=hoccl.torch.Options(
                settings=settings))
        groups[name] = made[key]
    return groups


def libraries(names: Sequence[str], shape: ModelShape, device: torch.device,
              groups: Dict[str, Any]) -> List[Library]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    import hoccl.torch
    found = []
    for name in names:
        base = name.split("+")[0]
        if base == "hoccl":
            mesh = DeviceMesh.from_group(groups[name], device.type)
        else:
            mesh = DeviceMesh.from_group(dist.distributed_c10d._get_default_group(), device.type)
        model = shard(shape, mesh, device)
        hooks = None
        if base.startswith("hoccl-hooks"):
            hooks = hoccl.torch.use_for_fsdp(model, groups[name],
                                             registered=base == "hoccl-hooks")
        found.append(Library(name, model, optimizer_for(model, device), [], hooks))
    return found


class Batches:
    """The batches of a shape on one rank, made before the steps that use them (``ready``,
    untimed) and kept for the others: making one is host work (a Python loop over the
    sequence) that belongs to no library, and the same steps' batches serve every library
    of a trial."""

    def __init__(self, shape: ModelShape, rank: int, device: torch.device):
        self.shape, self.rank, self.device = shape, rank, device
        self.made: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def ready(self, first: int, steps: int) -> None:
        for step in range(first, first + steps):
            if step not in self.made:
                self.made[step] = batch(self.shape, step, self.rank, self.device)

    def __getitem__(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        self.ready(step, 1)
        return self.made[step]


def run_steps(library: Library, batches: Batches, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        tokens, targets = batches[step]
        library.losses.append(train_step(library.model, library.optimizer, tokens, targets))


def measure(shape_name: str, shape: ModelShape, names: Sequence[str], args: argparse.Namespace,
            rank: int, world_size: int, device: torch.device, groups: Dict[str, Any],
            baseline: str) -> List[Dict[str, Any]]:
    import torch.distributed as dist
    found = libraries(names, shape, device, groups)
    batches = Batches(shape, rank, device)
    times: Dict[str, List[float]] = {library.name: [] for library in found}
    # how long the host took to enqueue the steps (until run_steps returned, before the
    # synchronize): near the step time, the host is what the step waits for
    host: Dict[str, List[float]] = {library.name: [] for library in found}
    step = 0
    for library in found:  # warm-up: allocations, kernel loads, descriptor caches
        run_steps(library, batches, 0, args.warmup)
    step += args.warmup
    for _ in range(args.trials):
        batches.ready(step, args.steps)
        for library in found:
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            run_steps(library, batches, step, args.steps)
            host[library.name].append((time.perf_counter() - start) / args.steps)
            synchronize(device)
            times[library.name].append((time.perf_counter() - start) / args.steps)
        step += args.steps
    records = []
    for library in found:
        batches.ready(step, max(args.profile_steps, args.host_profile))
        profile = profile_steps(lambda count: run_steps(library, batches, step, count),
                                args.profile_steps, device)
        host_profile = (profile_host(lambda count: run_steps(library, batches, step, count),
                                     args.host_profile, device)
                        if args.host_profile else None)
        slowest = torch.tensor(times[library.name], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        median = statistics.median(slowest.tolist())
        losses = [float(loss) for loss in library.losses[:args.warmup + args.steps]]
        records.append({"shape": shape_name, **asdict(shape), "parameters": shape.parameters(),
                        "library": library.name, "step_s": slowest.tolist(),
                        "median_step_s": median,
                        "tokens_per_s": shape.batch * shape.seq * world_size / median,
                        "host_s": host[library.name],
                        "median_host_s": statistics.median(host[library.name]),
                        "profile_ms_per_step": profile, "host_profile": host_profile,
                        "first_losses": losses,
                        **_exchanges(library.hooks)})
    base = next((r["median_step_s"] for r in records if r["library"] == baseline), None)
    for record in records:
        record["speedup_vs_baseline"] = base / record["median_step_s"] if base else None
    del found
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


def _exchanges(hooks: Any) -> Dict[str, Any]:
    """How many of the hooks' calls went without a descriptor exchange (this rank's)."""
    if hooks is None:
        return {}
    return {"without_exchange": {
        "all_gather": [hooks.all_gather.without_exchange, hooks.all_gather.calls],
        "reduce_scatter": [hooks.reduce_scatter.without_exchange, hooks.reduce_scatter.calls]},
        # the host's time inside the hooks (the whole run, warm-up included), per call
        "host_us_per_call": {
            kind: round(hook.host_seconds / hook.calls * 1e6, 1) if hook.calls else None
            for kind, hook in (("all_gather", hooks.all_gather),
                               ("reduce_scatter", hooks.reduce_scatter))}}


def table(result: Dict[str, Any]) -> str:
    baseline = result["baseline"]
    lines = [f"FSDP2 training step, {result['world_size']} ranks, {result['meta']['device']}, "
             f"bf16 compute, fp32 reduction; median of {result['trials']} trials x "
             f"{result['steps']} steps",
             "",
             f"| shape | params | library | step ms | host ms | tokens/s | {baseline} time / this | "
             f"exposed comm ms/step | comm ms/step | idle ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for record in result["records"]:
        profile = record["profile_ms_per_step"] or {}

        def cell(key):
            return f"{profile[key]:.2f}" if key in profile else "—"
        ratio = record["speedup_vs_baseline"]
        lines.append(
            f"| {record['shape']} ({ModelShape(**{k: record[k] for k in ('dim', 'layers', 'heads', 'seq', 'batch', 'vocab')}).label()}) "
            f"| {_count(record['parameters'])} | {record['library']} "
            f"| {record['median_step_s'] * 1000:.1f} | {record['median_host_s'] * 1000:.1f} "
            f"| {record['tokens_per_s']:,.0f} "
            f"| {'—' if ratio is None else f'{ratio:.3f}x'} | {cell('exposed')} "
            f"| {cell('communication')} | {cell('idle')} |")
    counted = [record for record in result["records"] if "without_exchange" in record]
    if counted:
        lines.append("")
        lines.append("Calls without a descriptor exchange (rank 0, the whole run): " + "; ".join(
            f"{record['shape']} {record['library']}: "
            + ", ".join(f"{done} of {calls} {kind.replace('_', '-')}s" for kind, (done, calls)
                        in record["without_exchange"].items())
            + " (host µs per call: " + ", ".join(
                f"{kind.replace('_', '-')} {value}" for kind, value
                in record.get("host_us_per_call", {}).items()) + ")"
            for record in counted))
    lines.append("")
    lines.append("step ms: the slowest rank's; host ms: rank 0's time to enqueue a step (before "
                 "the synchronize). Columns from the device timeline (torch.profiler, kernels "
                 "and copies): exposed comm = communication while no compute runs; idle = "
                 "nothing runs (hoccl's waits on its peers are stream memory operations, idle "
                 "here; NCCL waits inside its kernels)")
    for record in result["records"]:
        if record.get("host_profile"):
            lines.append("")
            lines.append(f"Host profile, {record['shape']} {record['library']} (rank 0; calls, "
                         f"ms of its own and in all per step):")
            lines += [f"    {own:8.3f} {total:8.3f} {calls:7.1f}  {where}"
                      for where, calls, own, total in record["host_profile"][:15]]
    return "\n".join(lines)


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.2f} B" if parameters >= 1e9 else f"{parameters / 1e6:.2f} M"


def plot(result: Dict[str, Any], folder: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    records = result["records"]
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    names = list(dict.fromkeys(r["library"] for r in records))
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(names))
    for index, name in enumerate(names):
        rows = {r["shape"]: r for r in records if r["library"] == name}
        positions = [shapes.index(shape) + index * width for shape in shapes]
        axes[0].bar(positions, [rows[s]["median_step_s"] * 1000 if s in rows else 0
                                for s in shapes], width, label=name)
        axes[1].bar(positions, [(rows[s]["profile_ms_per_step"] or {}).get("exposed", 0)
                                if s in rows else 0 for s in shapes], width, label=name)
    if not any(r["profile_ms_per_step"] for r in records):
        axes[1].text(0.5, 0.5, "no device timeline (CPU run)", ha="center", va="center",
                     transform=axes[1].transAxes)
    for axis, label in zip(axes, ("step time (ms)", "exposed communication (ms/step)")):
        axis.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(shapes))])
        axis.set_xticklabels(shapes)
        axis.set_ylabel(label)
        axis.grid(True, axis="y", alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(f"FSDP2 step, {result['world_size']} x {result['meta']['device']}")
    figure.tight_layout()
    path = os.path.join(folder, "train.png")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def metadata(device: torch.device) -> Dict[str, Any]:
    import hoccl
    info = {"command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(),
            "host": platform.node(), "python": sys.version.split()[0],
            "torch": torch.__version__, "hoccl": hoccl.__version__,
            "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                       else f"CPU ({platform.processor() or platform.machine()})")}
    if device.type == "cuda":
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as error:  # report, do not fail the benchmark
            info["nccl"] = f"unknown ({error})"
    return info


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hoccl.bench.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="compute,comm,large",
                        help=f"comma-separated names of {sorted(SHAPES)}, or "
                             f"dim:layers:heads:seq:batch")
    parser.add_argument("--libraries", default="",
                        help="comma-separated: the baseline (nccl on GPUs, gloo on CPUs), hoccl, "
                             "hoccl-hooks, hoccl-hooks-plain, each hoccl one optionally with "
                             "+setting=value; default: baseline,hoccl,hoccl-hooks")
    parser.add_argument("--baseline", choices=("nccl", "gloo"), default=None,
                        help="the default process group's backend and the library the others "
                             "are compared with (default: nccl on GPUs, gloo on CPUs); gloo on "
                             "GPUs is for runs where NCCL cannot run (ranks sharing one GPU): "
                             "list only hoccl libraries then")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trial")
    parser.add_argument("--trials", type=int, default=5, help="trials per library, interleaved")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per library")
    parser.add_argument("--profile-steps", type=int, default=3,
                        help="profiled steps per library for the exposed-communication figures")
    parser.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                        help="also profile the host (cProfile) over this many more steps per "
                             "library: the functions with the most time of their own go to "
                             "the JSON and, for rank 0, under the table")
    parser.add_argument("--max-sms", type=int, default=8, help="hoccl's SM cap for sums")
    parser.add_argument("--out", default="results/train", help="folder for JSON, Markdown, PNG")
    return parser.parse_args(argv)


def shapes_from(text: str) -> List[Tuple[str, ModelShape]]:
    found = []
    for item in text.split(","):
        if item in SHAPES:
            found.append((item, SHAPES[item]))
        else:
            dim, layers, heads, seq, size = (int(part) for part in item.split(":"))
            found.append((item, ModelShape(dim, layers, heads, seq, size)))
    return found


def main(argv=None) -> None:
    args = arguments(argv)
    import torch.distributed as dist
    import hoccl.torch  # noqa: F401  registers the backend
    baseline = args.baseline or ("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size, device = init_distributed(baseline)
    names = list(dict.fromkeys((args.libraries or f"{baseline},hoccl,hoccl-hooks").split(",")))
    try:
        groups = hoccl_groups(names, baseline, args.max_sms)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    records = []
    for shape_name, shape in shapes_from(args.shapes):
        if rank == 0:
            print(f"# {shape_name}: {shape.label()}, {_count(shape.parameters())} parameters",
                  flush=True)
        records += measure(shape_name, shape, names, args, rank, world_size, device,
                           groups, baseline)
    result = {"meta": metadata(device), "world_size": world_size, "baseline": baseline,
              "steps": args.steps, "trials": args.trials, "records": records}
    if rank == 0:
        from ._harness import report
        report(result, args.out, "train", table(result))
        try:
            print("wrote", plot(result, args.out))
        except ImportError as error:
            print(f"# plot skipped: {error}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
