"""What the benchmark programs share: ranks, libraries, buffers, timing, bandwidth formulas."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._report import metadata, report

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
               "sendrecv")
#: forms each collective is measured in
FORMS = {"all_gather": ("out", "in"), "reduce_scatter": ("out", "in"),
         "all_reduce": ("out", "in"), "all_to_all": ("out",), "broadcast": ("out", "in"),
         "sendrecv": ("out",)}
#: the root of the benchmarks' broadcasts
ROOT = 0

__all__ = ["COLLECTIVES", "FORMS", "Ranks", "Library", "setup_ranks", "make_buffers", "count_wrong", "time_loop", "bus_factor", "parse_size",
           "human", "metadata", "report"]


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' busbw / algbw (broadcast and sendrecv: 1, as nccl-tests counts them)."""
    if collective in ("broadcast", "sendrecv"):
        return 1.0
    return 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


def fill_defaults(args: Any, quick: Dict[str, Any], full: Dict[str, Any]) -> Any:
    """Options left unset (None) take ``quick``'s value with ``--quick``, else ``full``'s."""
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def parse_size(text: str) -> int:
    """Bytes from ``"4M"``, ``"64KiB"``, ``"1.5G"`` or ``"1024"``: binary units, as
    nccl-tests reads them (humanfriendly's ``parse_size``)."""
    import humanfriendly
    try:
        return humanfriendly.parse_size(str(text), binary=True)
    except humanfriendly.InvalidSize:
        raise ValueError(f"{text!r} is not a size (bytes, or a number ending in K, M or G)") \
            from None


def human(nbytes: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


@dataclass
class Ranks:
    """The ranks this process drives: one under mpirun, several with --local.  On the
    host backend (a check of the programs without GPUs) their buffers are CPU tensors and
    their work is timed by the host's clock."""
    comms: List[Any]
    world_size: int
    mpi: Any = None  # mpi4py communicator, or None
    devices: List[int] = field(default_factory=list)
    backend: str = "cuda"
    #: ranks per host (the world where every rank is on one host): a sendrecv goes to the
    #: same local rank on the next host
    local_size: int = 0
    #: prints the leader's lines where not ``print`` (above a progress bar)
    write: Optional[Callable[[str], None]] = None

    def pair(self, rank: int) -> Tuple[int, int]:
        """(the rank ``rank``'s sendrecv sends to, the rank it receives from): the same local
        rank on the next host and on the one before, across hosts; else the next and the
        previous rank."""
        step = self.local_size if 0 < self.local_size < self.world_size else 1
        return (rank + step) % self.world_size, (rank - step) % self.world_size

    def device(self, index: int) -> str:
        """The torch device of local rank ``index``'s buffers."""
        return f"cuda:{self.devices[index]}" if self.backend == "cuda" else "cpu"

    def synchronize(self) -> None:
        """Wait until the work every local rank enqueued has finished."""
        if self.backend == "cuda":
            import torch
            for device in self.devices:
                torch.cuda.synchronize(device)
        else:
            for comm in self.comms:
                comm.synchronize()

    @property
    def leader(self) -> bool:
        return self.mpi is None or self.mpi.rank == 0

    def barrier(self) -> None:
        if self.mpi is not None:
            self.mpi.Barrier()

    def max(self, value: float) -> float:
        if self.mpi is None:
            return value
        from mpi4py import MPI
        return self.mpi.allreduce(value, op=MPI.MAX)

    def sum(self, value: float) -> float:
        if self.mpi is None:
            return value
        from mpi4py import MPI
        return self.mpi.allreduce(value, op=MPI.SUM)

    def say(self, *args) -> None:
        if not self.leader:
            return
        if self.write is not None:
            self.write(" ".join(map(str, args)))
        else:
            print(*args, flush=True)


def require_installed(program: str, names: Sequence[str]) -> None:
    """Exit with one line naming the packages of ``names`` that are missing and how to
    install them (on a machine that installed hoccl without its dependencies)."""
    import importlib.util
    how = {"torch": "'hoccl[torch]'", "mpi4py": "'hoccl[mpi]'"}
    # an imported module is there (humanfriendly's module object has no __spec__)
    missing = [name for name in names
               if name not in sys.modules and importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"{program}: needs {', '.join(missing)}; install them with pip install "
                 + " ".join(how.get(name, name) for name in missing))


def require(program: str, local: int, backend: str = "cuda") -> None:
    """Exit with one line naming what is missing and how to get it: torch (NCCL through
    torch.distributed, the arrays), tqdm and humanfriendly (the progress bar, sizes),
    visible CUDA GPUs (unless ``backend`` is "host"), mpi4py unless ``local``; not
    matplotlib (without it the plots are skipped)."""
    require_installed(program, ("torch", "tqdm", "humanfriendly")
                      + (() if local else ("mpi4py",)))
    if backend == "host":
        return
    from ..backends import cuda_device_count
    if cuda_device_count() == 0:
        sys.exit(f"{program}: needs NVIDIA GPUs, and none is visible (or cuda-python is "
                 f"missing: pip install 'hoccl[cuda]'); on a machine without GPUs run "
                 f"examples/run_all.py, which uses the host backend")


def setup_ranks(local: int, backend: str = "cuda", **options) -> Ranks:
    import torch
    import hoccl
    if local:
        comms = hoccl.init_local(list(range(local)), backend=backend, **options)
        return Ranks(comms, local, None, list(range(local)), backend)
    from mpi4py import MPI
    comm = hoccl.init(backend=backend, **options)
    topology = getattr(comm, "topology", None)  # a communicator across hosts has one
    local_size = topology.local_size if topology is not None else comm.world_size
    if backend == "host":
        return Ranks([comm], comm.world_size, MPI.COMM_WORLD, [], backend, local_size)
    assert comm.device is not None
    torch.cuda.set_device(comm.device)
    return Ranks([comm], comm.world_size, MPI.COMM_WORLD, [comm.device],
                 local_size=local_size)


# -- libraries -------------------------------------------------------------------------------
class Library:
    """One way to run a collective on this process's ranks."""
    name = ""
    sms = ""  # how many SMs it occupies, in words
    ranks: Any = None  # the Ranks it runs on

    def sms_for(self, collective: str, nbytes: int = 0) -> str:
        """``sms`` for one collective of ``nbytes`` (where a library uses SMs differently
        per call)."""
        return self.sms

    def supports(self, collective: str, form: str) -> bool:
        return True

    def prepare(self) -> None:
        """Set the library up for the next measurement."""

    def release(self) -> None:
        """Free what the last measurement's buffers registered."""

    def empty(self, rank_index: int, count: int, dtype: Any) -> Any:
        import torch
        return torch.empty(count, dtype=dtype, device=self.ranks.device(rank_index))

    def run(self, rank_index: int, collective: str, send: Any, recv: Any, stream: Any) -> None:
        raise NotImplementedError

    def run_ranks(self, collective: str, buffers: Sequence[Any], stream_of: Any) -> None:
        """One call on every local rank: (send, recv, _) of ``buffers`` per rank."""
        for index, (send, recv, _) in enumerate(buffers):
            self.run(index, collective, send, recv, stream_of(index))


# -- buffers and checking ------------------------------------------------------------------
def counts_for(collective: str, nbytes: int, itemsize: int, n: int):
    """(send elements, recv elements) for nccl-tests' "size" = ``nbytes``."""
    if collective == "sendrecv":
        count = max(nbytes // itemsize, 1)
        return count, count
    total = max(nbytes // itemsize // n * n, n)
    if collective == "all_gather":
        return total // n, total
    if collective == "reduce_scatter":
        return total, total // n
    return total, total


def pattern(rank: int, count: int, dtype: Any, device: str) -> Any:
    """Rank-specific small integers: exact in every dtype, and in sums of a few ranks."""
    import torch
    values = (torch.arange(count, device=device, dtype=torch.int64) * 7 + 13 * rank) % 5
    return values.to(dtype)


def expected(collective: str, rank: int, n: int, send_count: int, dtype: Any, device: str,
             source: int = 0):
    """What ``rank`` holds after the call (a sendrecv's: its ``source``'s input)."""
    import torch
    if collective == "sendrecv":
        return pattern(source, send_count, dtype, device)
    inputs = [pattern(r, send_count, dtype, device) for r in range(n)]
    if collective == "broadcast":
        return inputs[ROOT]
    if collective == "all_gather":
        return torch.cat(inputs)
    if collective == "all_reduce":
        return sum(x.float() for x in inputs).to(dtype)
    block = send_count // n
    if collective == "reduce_scatter":
        return sum(x[rank * block:(rank + 1) * block].float() for x in inputs).to(dtype)
    return torch.cat([x[rank * block:(rank + 1) * block] for x in inputs])


def make_buffers(library: Library, ranks: Ranks, collective: str, form: str, nbytes: int,
                 dtype: Any):
    """Per local rank: (send, recv, the recv view to check, send pattern)."""
    import torch
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = ranks.world_size
    buffers = []
    for index, comm in enumerate(ranks.comms):
        rank = comm.rank
        send_count, recv_count = counts_for(collective, nbytes, itemsize, n)
        if form == "in" and collective == "all_gather":
            recv = library.empty(index, recv_count, dtype)
            send = recv[rank * send_count:(rank + 1) * send_count]
        elif form == "in" and collective == "reduce_scatter":
            send = library.empty(index, send_count, dtype)
            recv = send[rank * recv_count:(rank + 1) * recv_count]
        elif form == "in":
            send = recv = library.empty(index, send_count, dtype)
        else:
            send = library.empty(index, send_count, dtype)
            recv = library.empty(index, recv_count, dtype)
        buffers.append((send, recv, send_count))
    return buffers


def count_wrong(library: Library, ranks: Ranks, collective: str, form: str, buffers, dtype,
                stream_of, run=None) -> int:
    """Fill the inputs with the pattern, poison the outputs, run once (``run()``, e.g. a
    graph's replay, instead of one call per rank when given), count wrong elements."""
    n = ranks.world_size
    for index, (comm, (send, recv, send_count)) in enumerate(zip(ranks.comms, buffers)):
        recv.fill_(float("nan") if dtype.is_floating_point else 99)
        send.copy_(pattern(comm.rank, send_count, dtype, ranks.device(index)))
    ranks.synchronize()
    ranks.barrier()
    if run is not None:
        run()
    else:
        library.run_ranks(collective, buffers, stream_of)
    library.ranks.synchronize()
    wrong = 0
    for index, (comm, (send, recv, send_count)) in enumerate(zip(ranks.comms, buffers)):
        want = expected(collective, comm.rank, n, send_count, dtype, ranks.device(index),
                        ranks.pair(comm.rank)[1])
        wrong += int((recv.float() != want.float()).sum().item())
    return int(ranks.sum(wrong))


def time_loop(library: Library, ranks: Ranks, collective: str, buffers, iters: int, warmup: int,
              stream_of) -> float:
    """Median-free nccl-tests style: average µs per call over ``iters`` back-to-back calls,
    the slowest rank's (on the host backend: by the host's clock, until every local rank
    has finished)."""
    import torch

    def once():
        library.run_ranks(collective, buffers, stream_of)
    for _ in range(warmup):
        once()
    library.ranks.synchronize()
    ranks.barrier()
    if ranks.backend != "cuda":
        began = time.perf_counter()
        for _ in range(iters):
            once()
        library.ranks.synchronize()
        return ranks.max((time.perf_counter() - began) * 1e6 / iters)
    starts = [torch.cuda.Event(enable_timing=True) for _ in ranks.devices]
    for index, start in enumerate(starts):
        start.record(stream_of(index))
    for _ in range(iters):
        once()
    ends = [torch.cuda.Event(enable_timing=True) for _ in ranks.devices]
    for index, end in enumerate(ends):
        end.record(stream_of(index))
    for end in ends:
        end.synchronize()
    return ranks.max(max(start.elapsed_time(end) * 1000 / iters
                         for start, end in zip(starts, ends)))


def time_graph(library: Library, ranks: Ranks, collective: str, buffers, calls: int,
               replays: int, stream_of):
    """µs per call of ``calls`` calls captured into one CUDA graph per rank
    (``torch.cuda.graph`` on the rank's stream), replayed ``replays`` times back to back;
    the slowest rank's, and a function replaying a graph of one such call (for
    ``count_wrong``).
    One rank per process only (a capture holds one thread's stream)."""
    import torch
    if len(ranks.devices) != 1:
        raise RuntimeError("graphs are timed with one rank per process (mpirun)")
    device, (send, recv, _) = ranks.devices[0], buffers[0]
    stream = stream_of(0)
    torch.cuda.synchronize(device)
    ranks.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            library.run(0, collective, send, recv, stream)
    with torch.cuda.stream(stream):
        graph.replay()  # warm
    torch.cuda.synchronize(device)
    ranks.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for _ in range(replays):
            graph.replay()
        end.record(stream)
    end.synchronize()
    micros = start.elapsed_time(end) * 1000 / (replays * calls)
    del graph
    # checked on a graph of one call (calls in place on one buffer compound: an in-place
    # all_reduce captured 20 times sums 20 times)
    torch.cuda.synchronize(device)
    ranks.barrier()
    single = torch.cuda.CUDAGraph()
    with torch.cuda.graph(single, stream=stream):
        library.run(0, collective, send, recv, stream)

    def replay_once():
        with torch.cuda.stream(stream):
            single.replay()
    return ranks.max(micros), replay_once
