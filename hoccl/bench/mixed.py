"""python -m hoccl.bench.mixed: a job whose ranks are on different devices, beside gloo.

  # one H200: ranks 0-1 on the GPU (host 0), ranks 2-3 on the CPU (host 1), MPI between
  mpirun -np 4 python -m hoccl.bench.mixed --devices cuda,cuda,cpu,cpu --local-size 2
  # CPU only (every host on hoccl's host backend), small sizes
  mpiexec -n 4 python -m hoccl.bench.mixed --devices cpu --sizes 64K,1M --phase-bytes 1M

Each rank's tensors are on its own device.  hoccl runs all_reduce, all_gather and
point-to-point (``sendrecv``: every rank sends its tensor to the rank of its local rank on
the next host and receives from the one on the host before, in one ``hoccl.group()``, so
every byte crosses hosts both ways, as a pipeline's activations and gradients do) as one
communicator across the simulated hosts (``--local-size`` consecutive ranks per host, an
engine inside each chosen by what the host has, ``--inter-host`` between them); torch's
gloo, what a mixed job has today, does the same calls on the same tensors (``isend`` and
``irecv``, then their waits).  Every library's output is checked against numpy once per
size (inputs are small integers, so every order of summation gives the same bits; outputs
are poisoned with NaN first).  A sendrecv's busbw is its algbw: the bytes one rank sends
over the time.
``--host-memory shared`` puts the CPU ranks' tensors in host memory that the peers on
the machine map (``hoccl.host_empty``), ``both`` times hoccl on each kind beside gloo.

At ``--phase-bytes`` (default 256 MiB) hoccl's all_reduce also runs with its phases
pipelined and sequential (``Config.phases``), and each phase alone (inside hosts, between
hosts) at the size it has in the collective.  Printed, not asserted: hoccl's bus
bandwidth over gloo's at each size from 64 MiB, pipelined over the slowest phase alone,
and sequential over pipelined.  Writes mixed.json, mixed.md and mixed.png to ``--out``.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ._harness import bus_factor, human, metadata, parse_size, report

__all__ = ["main", "arguments", "sweep", "ratios", "table", "plot", "peers", "expected"]

COLLECTIVES = ("all_reduce", "all_gather")
#: what each size measures: the collectives, then point-to-point across hosts
MEASURED = COLLECTIVES + ("sendrecv",)
#: the sizes from which hoccl's bus bandwidth is compared with gloo's
COMPARED_FROM = 64 << 20


def arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hoccl.bench.mixed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="cpu",
                        help="each rank's device, comma-separated (cuda or cpu), or one for all")
    parser.add_argument("--local-size", type=int, default=2,
                        help="ranks per simulated host (consecutive ranks)")
    parser.add_argument("--intra-host", default="",
                        help="each rank's engine inside its host (cuda, host, torch), "
                             "comma-separated, or one for all; default: what the host has")
    parser.add_argument("--inter-host", default="mpi",
                        help="the engine between hosts (mpi, gloo, ucx, hoccl), or several, "
                             "comma-separated: one hoccl communicator each, measured in turn "
                             "on the same tensors (the first as 'hoccl', the others as "
                             "'hoccl ENGINE'; the phase study on the first)")
    parser.add_argument("--sizes", default="1M,4M,16M,64M,256M",
                        help="nccl-tests' sizes, comma-separated (up to 1G)")
    parser.add_argument("--phase-bytes", default="256M",
                        help="the size of the pipelined / sequential / phase-alone study")
    parser.add_argument("--phase-chunk", default="",
                        help="the chunk of pipelined phases (Config.phase_bytes; default its "
                             "default)")
    parser.add_argument("--dtype", default="float32", help="numpy / torch dtype name")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per measurement")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    parser.add_argument("--libraries", default="hoccl,gloo",
                        help="hoccl, gloo, copy (sendrecv only: each rank copies its own "
                             "tensor into its output on its device, the same bytes as a "
                             "sendrecv moves: the floor a transfer between hosts is held to)")
    parser.add_argument("--host-memory", choices=("plain", "shared", "both"), default="plain",
                        help="the CPU ranks' tensors: plain (torch's own), shared "
                             "(hoccl.host_empty: the peers on this machine map them), or both "
                             "(hoccl measured on each, as 'hoccl' and 'hoccl shared'); the "
                             "phase study takes shared memory unless plain")
    parser.add_argument("--out", default="results/mixed", help="folder for JSON, MD and PNG")
    return parser.parse_args(argv)


def _per_rank(text: str, world_size: int, what: str) -> List[str]:
    values = [value.strip() for value in text.split(",") if value.strip()]
    if len(values) == 1:
        values *= world_size
    if len(values) != world_size:
        sys.exit(f"python -m hoccl.bench.mixed: --{what} needs one value or one per rank "
                 f"({world_size}); got {len(values)}")
    return values


class Job:
    """This rank's place in the mixed job: its MPI world, device, and the libraries."""

    def __init__(self, args: argparse.Namespace):
        if "ucx" in args.inter_host.split(","):
            from .._hierarchy.ucx import preload
            preload()  # UCX's libraries before MPI's own copy (``hoccl._hierarchy.ucx``)
        from mpi4py import MPI
        import torch
        self.mpi = MPI.COMM_WORLD
        self.rank, self.world_size = self.mpi.rank, self.mpi.size
        self.kind = _per_rank(args.devices, self.world_size, "devices")[self.rank]
        if self.kind not in ("cuda", "cpu"):
            sys.exit(f"python -m hoccl.bench.mixed: --devices takes cuda or cpu; got "
                     f"{self.kind!r}")
        self.device = torch.device("cuda", 0) if self.kind == "cuda" else torch.device("cpu")
        if self.kind == "cuda":
            torch.cuda.set_device(self.device)
        self.torch = torch
        self.args = args

    def hoccl(self, inter_host: Optional[str] = None, **settings: Any) -> Any:
        """A hoccl communicator across the simulated hosts, ``inter_host`` between them
        (default: the first of ``--inter-host``)."""
        import hoccl
        intra = (_per_rank(self.args.intra_host, self.world_size, "intra-host")[self.rank]
                 if self.args.intra_host else None)
        if intra is not None:
            settings["intra_host"] = intra
        if self.args.phase_chunk:
            settings["phase_bytes"] = parse_size(self.args.phase_chunk)
        return hoccl.init(backend="cuda" if self.kind == "cuda" else "host",
                          device=0 if self.kind == "cuda" else None,
                          local_size=self.args.local_size,
                          inter_host=inter_host or self.args.inter_host.split(",")[0],
                          **settings)

    def gloo(self) -> Any:
        """torch's gloo over every rank (a store on rank 0's host)."""
        import torch.distributed as dist
        address = self.mpi.bcast(socket.gethostname() if self.rank == 0 else None)
        port = self.mpi.bcast(_free_port() if self.rank == 0 else None)
        # a bounded wait: a call one rank cannot make must not hold the others for long
        timeout = timedelta(seconds=120)
        store = dist.TCPStore(address, port, self.world_size, self.rank == 0, timeout=timeout)
        return dist.ProcessGroupGloo(store, self.rank, self.world_size, timeout)

    def max(self, value: float) -> float:
        from mpi4py import MPI
        return self.mpi.allreduce(value, op=MPI.MAX)

    def sum(self, value: int) -> int:
        from mpi4py import MPI
        return self.mpi.allreduce(value, op=MPI.SUM)

    def say(self, *text: Any) -> None:
        if self.rank == 0:
            print(*text, flush=True)

    def synchronize(self) -> None:
        if self.kind == "cuda":
            self.torch.cuda.synchronize(self.device)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def pattern(rank: int, count: int, dtype: Any) -> np.ndarray:
    """Rank ``rank``'s input: small integers, so sums of a few ranks are exact in any order."""
    return ((np.arange(count, dtype=np.int64) * 7 + 13 * rank) % 5).astype(dtype)


def peers(rank: int, world_size: int, local_size: int) -> Tuple[int, int]:
    """(the rank a sendrecv sends to, the rank it receives from): the ranks of this local
    rank on the next host and on the host before."""
    return (rank + local_size) % world_size, (rank - local_size) % world_size


def expected(collective: str, world_size: int, count: int, dtype: Any,
             source: int = 0) -> np.ndarray:
    """What every rank's output holds (a sendrecv's: its ``source``'s input)."""
    if collective == "sendrecv":
        return pattern(source, count, dtype)
    inputs = [pattern(rank, count, dtype) for rank in range(world_size)]
    if collective == "all_gather":
        return np.concatenate(inputs)
    return np.sum(np.stack(inputs).astype(np.float64), axis=0).astype(dtype)


def wrong_elements(got: np.ndarray, want: np.ndarray) -> int:
    """Elements whose bits differ (a NaN poison left unwritten counts)."""
    bits = np.dtype(f"u{want.dtype.itemsize}")
    return int(np.count_nonzero(got.view(bits) != want.view(bits)))


def _counts(collective: str, nbytes: int, itemsize: int, world_size: int) -> Tuple[int, int]:
    """(input elements, output elements) of nccl-tests' size ``nbytes``."""
    if collective == "sendrecv":
        count = max(nbytes // itemsize, 1)
        return count, count
    total = max(nbytes // itemsize // world_size * world_size, world_size)
    return (total // world_size, total) if collective == "all_gather" else (total, total)


def _caller(library: str, handle: Any, collective: str,
            pair: Tuple[int, int] = (0, 0)) -> Callable[[Any, Any], None]:
    """One call of ``collective`` on ``handle`` (a hoccl communicator or a gloo group);
    a sendrecv's ``pair``: (the rank it sends to, the rank it receives from)."""
    if collective == "sendrecv":
        return _pair_caller(library, handle, pair)
    if library == "gloo":
        if collective == "all_reduce":
            def gloo_all_reduce(send: Any, recv: Any) -> None:
                recv.copy_(send)
                handle.allreduce([recv]).wait()
            return gloo_all_reduce

        def gloo_all_gather(send: Any, recv: Any) -> None:
            handle.allgather([list(recv.chunk(handle.size()))], [send]).wait()
        return gloo_all_gather

    def hoccl_call(send: Any, recv: Any) -> None:
        if send.device.type == "cpu":  # hoccl's host backend takes numpy views
            send, recv = send.numpy(), recv.numpy()
        getattr(handle, collective)(send, recv)
        handle.synchronize()
    return hoccl_call


def _pair_caller(library: str, handle: Any, pair: Tuple[int, int]
                 ) -> Callable[[Any, Any], None]:
    """A send of ``send`` to ``pair[0]`` and a receive into ``recv`` from ``pair[1]``, in
    flight together: one ``hoccl.group()``, or gloo's ``send`` and ``recv`` posted before
    either is waited for."""
    to, source = pair
    if library == "copy":
        def device_copy(send: Any, recv: Any) -> None:
            recv.copy_(send)
        return device_copy
    if library == "gloo":
        def gloo_sendrecv(send: Any, recv: Any) -> None:
            works = [handle.send([send], to, 0), handle.recv([recv], source, 0)]
            for work in works:
                work.wait()
        return gloo_sendrecv

    def hoccl_sendrecv(send: Any, recv: Any) -> None:
        import hoccl
        if send.device.type == "cpu":
            send, recv = send.numpy(), recv.numpy()
        with hoccl.group():
            handle.send(send, to)
            handle.recv(recv, source)
        handle.synchronize()
    return hoccl_sendrecv


def _tensor(job: Job, values: np.ndarray, shared: bool) -> Any:
    """``values`` on this rank's device; on a CPU rank in shared host memory
    (``hoccl.host_empty``) when ``shared``."""
    torch = job.torch
    if shared and job.kind == "cpu":
        import hoccl
        tensor = hoccl.host_empty(values.shape, values.dtype, framework="torch")
        tensor.copy_(torch.from_numpy(values))
        return tensor
    return torch.from_numpy(values).to(job.device)


def measure(job: Job, library: str, handle: Any, collective: str, nbytes: int,
            dtype: str, shared: bool = False) -> Dict[str, Any]:
    """Check once against numpy (outputs poisoned first), then time ``--iters`` calls:
    the slowest rank's µs per call.  A gloo call that gloo cannot make on a device
    tensor is made on host copies (``staged`` in the record).  ``shared``: a CPU rank's
    tensors in shared host memory (the record's library gets " shared")."""
    itemsize = np.dtype(dtype).itemsize
    send_count, recv_count = _counts(collective, nbytes, itemsize, job.world_size)
    send = _tensor(job, pattern(job.rank, send_count, dtype), shared)
    recv = _tensor(job, np.full(recv_count, np.nan, dtype=dtype), shared)
    pair = peers(job.rank, job.world_size, job.args.local_size)
    call = _caller(library, handle, collective, pair)
    record: Dict[str, Any] = dict(collective=collective, bytes=nbytes,
                                  library=library + (" shared" if shared else ""))
    want = (pattern(job.rank, send_count, dtype) if library == "copy"
            else expected(collective, job.world_size, send_count, dtype, pair[1]))
    if library == "gloo" and collective == "sendrecv" and job.kind == "cuda":
        # gloo's send and recv take a tensor's pointer as host memory, whatever its device
        call, record["staged"] = _staged(call), True

    def once() -> None:
        call(send, recv)
        job.synchronize()
    try:
        job.mpi.Barrier()
        try:
            once()
        except RuntimeError:
            if library != "gloo" or job.kind != "cuda":
                raise
            call, record["staged"] = _staged(call), True
            recv.fill_(float("nan"))
            once()
        wrong = wrong_elements(recv.cpu().numpy(), want)
        micros = _time(job, once)
    except Exception as error:  # a library that cannot do this call: reported, not fatal
        failed = f"{type(error).__name__}: {error}"
        record.update(error=failed)
        job.say(f"  {collective:10s} {human(nbytes):>5s} {library:17s} failed: {failed[:300]}")
        return record
    algbw = nbytes / micros / 1e3
    record.update(time_us=micros, algbw=algbw, busbw=algbw * bus_factor(collective, job.world_size),
                  wrong=job.sum(wrong), checked="numpy")
    job.say(f"  {collective:10s} {human(nbytes):>5s} {record['library']:17s} {micros:12.1f} us "
            f"{record['busbw']:8.2f} GB/s  wrong {record['wrong']}")
    return record


def _staged(call: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """``call`` on host copies of device tensors (what a gloo user does for a call that
    gloo cannot do on the device)."""
    def staged(send: Any, recv: Any) -> None:
        host_recv = recv.cpu()
        call(send.cpu(), host_recv)
        recv.copy_(host_recv)
    return staged


def _phase_callers(job: Job, comm: Any, nbytes: int, dtype: str, shared: bool
                   ) -> Dict[str, Callable[[], None]]:
    """all_reduce's phases alone, each at the size it has inside an all_reduce of
    ``nbytes`` per rank, on the engines the communicator runs them on: the host's
    reduce_scatter (the engine inside the host), the rails' all_reduce of 1/local_size
    of it (the engine between hosts), the host's all_gather.  Each call returns once
    its work is done."""
    torch = job.torch
    # the level engines, as the communicator's phases call them
    host, rail = comm._levels["host"], comm._levels["rail"]
    local = job.args.local_size
    count = max(nbytes // np.dtype(dtype).itemsize // local * local, local)
    whole = _tensor(job, np.ones(count, dtype), shared)
    part = _tensor(job, np.ones(count // local, dtype), shared)
    part_out = _tensor(job, np.zeros(count // local, dtype), shared)
    if job.kind == "cpu":  # as the communicator hands the host backend's engines
        whole, part, part_out = whole.numpy(), part.numpy(), part_out.numpy()

    def on(engine: Any, step: Callable[[Any], None]) -> Callable[[], None]:
        def once() -> None:
            stream = torch.cuda.current_stream().cuda_stream if job.kind == "cuda" else None
            step(stream)
            engine.synchronize()
            job.synchronize()
        return once
    return {
        "host reduce_scatter": on(host, lambda s: host.reduce_scatter(whole, part, "sum",
                                                                      stream=s)),
        "rail all_reduce": on(rail, lambda s: rail.all_reduce(part, part_out, "sum", stream=s)),
        "host all_gather": on(host, lambda s: host.all_gather(part, whole, stream=s))}


def phase_study(job: Job, comm: Any, nbytes: int, dtype: str,
                shared: bool = False) -> List[Dict[str, Any]]:
    """hoccl's collectives at ``nbytes`` with phases pipelined and sequential (checked
    against numpy), and all_reduce's phases alone (timed only); ``shared``: on a CPU
    rank in shared host memory."""
    records = []
    for collective in COLLECTIVES:
        for phases in ("pipelined", "sequential"):
            comm.set_options(phases=phases)
            record = measure(job, "hoccl", comm, collective, nbytes, dtype, shared)
            records.append({**record, "library": f"hoccl {phases}", "phases": phases})
    comm.set_options(phases="auto")
    for name, once in _phase_callers(job, comm, nbytes, dtype, shared).items():
        micros = _time(job, once)
        records.append(dict(collective="all_reduce", bytes=nbytes, library=f"phase {name}",
                            phase=name, time_us=micros))
        job.say(f"  all_reduce {human(nbytes):>5s} {'phase ' + name:26s} {micros:12.1f} us")
    return records


def _time(job: Job, once: Callable[[], None]) -> float:
    """The slowest rank's µs per call of ``once`` over ``--iters`` calls after warm-up."""
    for _ in range(job.args.warmup):
        once()
    job.mpi.Barrier()
    started = time.perf_counter()
    for _ in range(job.args.iters):
        once()
    return job.max((time.perf_counter() - started) * 1e6 / job.args.iters)


def ratios(result: Dict[str, Any]) -> Dict[str, Any]:
    """The figures the mixed job is judged by (printed, never asserted): hoccl's bus
    bandwidth over gloo's at each size from 64 MiB (sendrecv's too), and at the phase
    study's size the pipelined all_reduce over its slowest phase alone and the sequential
    over the pipelined (targets: ≥ 3, ≤ 1.15, ≥ 1.3)."""
    good = [r for r in result["records"] if "error" not in r]
    over_gloo: Dict[str, Dict[str, float]] = {}
    for collective in MEASURED:
        by = {(r["library"], r["bytes"]): r for r in good if r["collective"] == collective}
        names = dict.fromkeys(r["library"] for r in good if r["library"].startswith("hoccl"))
        for name in ["hoccl", *[other for other in names if other != "hoccl"]]:
            found = {human(nbytes): by[(name, nbytes)]["busbw"] / by[("gloo", nbytes)]["busbw"]
                     for (library, nbytes) in by if library == name
                     and nbytes >= COMPARED_FROM and ("gloo", nbytes) in by}
            if found or name == "hoccl":
                over_gloo[collective + name[len("hoccl"):]] = found
    study = {r["library"]: r["time_us"] for r in result["phases"] if "error" not in r
             and r["collective"] == "all_reduce"}
    alone = [micros for name, micros in study.items() if name.startswith("phase ")]
    phases: Dict[str, float] = {}
    if "hoccl pipelined" in study and alone:
        phases["pipelined / slowest phase alone"] = study["hoccl pipelined"] / max(alone)
    if "hoccl pipelined" in study and "hoccl sequential" in study:
        phases["sequential / pipelined"] = study["hoccl sequential"] / study["hoccl pipelined"]
    return {"hoccl busbw / gloo busbw": over_gloo, "all_reduce phases": phases}


def table(result: Dict[str, Any]) -> str:
    lines = [f"# hoccl.bench.mixed: {result['world_size']} ranks on {result['devices']}, "
             f"{result['local_size']} per host, {result['dtype']}"]
    lines += [f"- rank {rank}: {engines}" for rank, engines in enumerate(result["engines"])]
    good = [r for r in result["records"] if "error" not in r]
    for collective in MEASURED:
        rows = [r for r in good if r["collective"] == collective]
        names = list(dict.fromkeys(r["library"] for r in rows))
        lines += [f"\n## {collective}, busbw GB/s (time us)",
                  "| size | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for nbytes in sorted({r["bytes"] for r in rows}):
            by = {r["library"]: r for r in rows if r["bytes"] == nbytes}
            cells = [f"{by[name]['busbw']:.2f} ({by[name]['time_us']:.0f})"
                     + (f" WRONG {by[name]['wrong']}" if by[name]["wrong"] else "")
                     if name in by else "" for name in names]
            lines.append(f"| {human(nbytes)} | " + " | ".join(cells) + " |")
    lines += [f"\n## phases at {human(result['phase_bytes'])} (pipelined in chunks of "
              f"{human(result['phase_chunk'] or 0)}; CPU ranks' tensors in "
              f"{result.get('study_memory', 'plain')} memory), time us",
              "| collective | run | time us | wrong |", "|---|---|---|---|"]
    for r in result["phases"]:
        if "error" not in r:
            lines.append(f"| {r['collective']} | {r['library']} | {r['time_us']:.0f} | "
                         f"{r.get('wrong', '')} |")
    found = result["ratios"]
    lines.append("\n## ratios (targets: hoccl / gloo >= 3 from 64M; pipelined / slowest "
                 "phase <= 1.15; sequential / pipelined >= 1.3)")
    for collective, by_size in found["hoccl busbw / gloo busbw"].items():
        name = (f"{collective[:-len(' shared')]} hoccl on shared host memory"
                if collective.endswith(" shared") else f"{collective} hoccl")
        lines.append(f"- {name} / gloo busbw: " + (", ".join(
            f"{size} {ratio:.2f}x" for size, ratio in by_size.items()) or "no size from 64M"))
    for name, ratio in found["all_reduce phases"].items():
        lines.append(f"- all_reduce {name}: {ratio:.2f}x")
    return "\n".join(lines)


def plot(result: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    good = [r for r in result["records"] if "error" not in r]
    figure, axes = plt.subplots(1, len(MEASURED), figsize=(16, 4.2))
    for axis, collective in zip(axes, MEASURED):
        for name in dict.fromkeys(r["library"] for r in good):
            series = sorted((r["bytes"], r["busbw"]) for r in good
                            if r["library"] == name and r["collective"] == collective)
            axis.plot([s for s, _ in series], [b for _, b in series], marker="o", label=name,
                      linestyle="-" if name.startswith("hoccl") else "--")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("size (bytes)")
        axis.set_ylabel("bus bandwidth (GB/s)")
        axis.set_title(f"{collective}, {result['devices']}")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _engines(described: Dict[str, Any]) -> str:
    return (f"host {described['host']}: {described['intra_host']} inside, "
            f"{described['inter_host']} between")


def sweep(job: Job, comm: Any, others: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Every rank's measurements (rank 0's records hold everyone's: figures are the
    slowest rank's, wrong elements the sum over ranks).  ``others``: more hoccl
    communicators by the engine between their hosts, measured as "hoccl ENGINE"."""
    args = job.args
    sizes = [parse_size(text) for text in args.sizes.split(",")]
    wanted = args.libraries.split(",")
    handles = {"hoccl": comm, "gloo": job.gloo() if "gloo" in wanted else None, "copy": None}
    for engine, other in (others or {}).items():
        handles[f"hoccl {engine}"] = other
    if "hoccl" in wanted:
        at = wanted.index("hoccl") + 1
        wanted[at:at] = [f"hoccl {engine}" for engine in others or {}]
    devices = job.mpi.allgather(job.kind)
    engines = job.mpi.allgather(None if comm is None else _engines(comm.describe()))
    job.say(f"# hoccl.bench.mixed: devices {devices}, {args.local_size} ranks per host")
    runs = [(library, shared) for library in wanted
            for shared in ((False, True) if library.startswith("hoccl")
                           and args.host_memory == "both" else (args.host_memory == "shared",))]
    records = [measure(job, library, handles[library], collective, nbytes, args.dtype, shared)
               for collective in MEASURED for nbytes in sizes for library, shared in runs
               if library != "copy" or collective == "sendrecv"]
    phase_bytes = parse_size(args.phase_bytes)
    study_shared = args.host_memory != "plain"
    study = (phase_study(job, comm, phase_bytes, args.dtype, study_shared)
             if comm is not None else [])
    return {"world_size": job.world_size, "devices": devices, "local_size": args.local_size,
            "dtype": args.dtype, "engines": engines, "phase_bytes": phase_bytes,
            "records": records, "phases": study, "host_memory": args.host_memory,
            "study_memory": "shared" if study_shared else "plain",
            "phase_chunk": None if comm is None else comm.config.phase_bytes}


def main(argv: Optional[List[str]] = None) -> None:
    import os
    args = arguments(argv)
    job = Job(args)
    measured = "hoccl" in args.libraries.split(",")
    first, *rest = args.inter_host.split(",")
    comm = job.hoccl(first) if measured else None
    others = {engine: job.hoccl(engine) for engine in rest} if measured else {}
    try:
        result = sweep(job, comm, others)
    finally:
        for made in [comm, *others.values()]:
            if made is not None:
                made.close()
    if job.rank != 0:
        return
    result = {"meta": metadata(sys.argv), **result}
    result["ratios"] = ratios(result)
    report(result, args.out, "mixed", table(result))
    try:
        plot(result, os.path.join(args.out, "mixed.png"))
        print("wrote", os.path.join(args.out, "mixed.png"))
    except ImportError as error:
        print(f"# plot skipped: {error}")


if __name__ == "__main__":
    main()
