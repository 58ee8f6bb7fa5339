"""What the benchmark programs share: ranks, libraries, buffers, timing, bandwidth formulas."""

from __future__ import annotations

import os
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

__all__ = ["COLLECTIVES", "FORMS", "Ranks", "Library", "Hoccl", "HocclAuto", "TorchNccl",
           "Nccl4py", "Gloo", "libraries",
           "setup_ranks", "make_buffers", "count_wrong", "time_loop", "bus_factor", "parse_size",
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


class Hoccl(Library):
    """hoccl with its default options (``hoccl``), or a variant: ``hoccl-peer`` (own block
    through the peer: zero SMs), ``hoccl-local``, ``hoccl-reg`` (every buffer registered
    with ``hoccl.empty``: calls go without a descriptor exchange), and options appended
    like ``hoccl+max_sms=32+copy_sms=32+chunk_bytes=128M``."""

    def __init__(self, ranks: Ranks, route: Optional[str], name: str, settings: Dict[str, Any],
                 registered: bool = False):
        comm = ranks.comms[0]
        self.ranks, self.name, self.settings = ranks, name, settings
        self.registered = registered
        self.windows: List[Tuple[Any, Any]] = []
        self.route = route or comm.options.self_route
        self.defaults = {"max_sms": comm.max_sms, "copy_sms": comm.copy_sms,
                         "fuse_sums": comm.fuse_sums,
                         "chunk_bytes": comm.options.chunk_bytes,
                         "one_shot_bytes": comm.options.one_shot_bytes,
                         "pull_bytes": comm.options.pull_bytes,
                         "kernel_bytes": comm.options.kernel_bytes,
                         "kernel_sms": comm.options.kernel_sms}
        sums = settings.get("max_sms", self.defaults["max_sms"])
        copies = settings.get("copy_sms", self.defaults["copy_sms"])
        moves = "0" if self.route == "peer" else f"≤ {copies} for the own block out of place"
        pulled = " (pulled: the peers' reads too)" if settings.get("pull_bytes") else ""
        per_chunk = "" if settings.get("fuse_sums", self.defaults["fuse_sums"]) else \
            " (a launch per chunk)"
        self.sms = f"moves: {moves} (in place: 0); sums{pulled}: ≤ {sums}{per_chunk}"
        # variants are measured only where what they change matters
        self.moves_only = route is not None or set(settings) == {"copy_sms"}
        self.sums_only = bool(settings) and set(settings) <= {"max_sms", "chunk_bytes",
                                                              "pull_bytes", "fuse_sums"}
        self.all_reduce_only = set(settings) == {"one_shot_bytes"}

    def sms_for(self, collective: str, nbytes: int = 0) -> str:
        """A call of ``nbytes`` (the largest buffer) that runs as a direct kernel says so,
        with its blocks (one per SM)."""
        from ..sched.algorithms import KERNEL_COLLECTIVES, KERNEL_MAX_RANKS, kernel_blocks_for
        limit = self.settings.get("kernel_bytes", self.defaults["kernel_bytes"])
        if (collective in KERNEL_COLLECTIVES and 0 < nbytes <= limit
                and self.ranks.world_size <= KERNEL_MAX_RANKS):
            cap = self.settings.get("kernel_sms", self.defaults["kernel_sms"])
            return f"direct kernel: {kernel_blocks_for(nbytes, cap)} SMs (no copy engine)"
        return self.sms

    def supports(self, collective: str, form: str) -> bool:
        if self.moves_only:
            return form == "out" and collective in ("all_gather", "all_to_all")
        if self.sums_only:
            return collective in ("reduce_scatter", "all_reduce")
        if self.all_reduce_only:
            return collective == "all_reduce"
        return True

    def prepare(self) -> None:
        for comm in self.ranks.comms:
            comm.set_options(self_route=self.route, **{**self.defaults, **self.settings})

    def empty(self, rank_index, count, dtype):
        if not self.registered:
            return super().empty(rank_index, count, dtype)
        import hoccl
        comm = self.ranks.comms[rank_index]
        tensor = hoccl.empty(count, str(dtype), comm, framework="torch")
        self.windows.append((comm, tensor))
        return tensor

    def release(self) -> None:
        for comm, tensor in self.windows:
            comm.deregister(tensor)
        self.windows.clear()

    def run_ranks(self, collective: str, buffers: Sequence[Any], stream_of: Any) -> None:
        if collective != "sendrecv":
            return super().run_ranks(collective, buffers, stream_of)
        import hoccl
        # one group for every local rank's send and receive: a process driving several
        # ranks cannot wait for one rank's receive before the next rank's send is made
        with hoccl.group():
            for index, (send, recv, _) in enumerate(buffers):
                comm = self.ranks.comms[index]
                to, source = self.ranks.pair(comm.rank)
                comm.send(send, to, stream=stream_of(index))
                comm.recv(recv, source, stream=stream_of(index))

    def run(self, rank_index, collective, send, recv, stream):
        comm = self.ranks.comms[rank_index]
        if collective == "sendrecv":
            self.run_ranks(collective, [(send, recv, None)], lambda index: stream)
        elif collective in ("reduce_scatter", "all_reduce"):
            getattr(comm, collective)(send, recv, "sum", stream=stream)
        elif collective == "broadcast":
            comm.broadcast(send, recv, ROOT, stream=stream)
        else:
            getattr(comm, collective)(send, recv, stream=stream)


class HocclAuto(Hoccl):
    """hoccl as a user gets it who sets nothing (``hoccl-auto``): each call's path and
    settings come from the machine's tuning table (``python -m hoccl.tune``, else a table
    shipped for the machine, else the defaults; ``comm.explain``), plus the settings
    appended to the name (``hoccl-auto+max_sms=32``), which override the table.

    ``hoccl`` and its variants instead set every option explicitly before each
    measurement (``Hoccl.prepare``), and a setting that is given overrides the table,
    so they always run their own settings.  Given settings stay given on a communicator,
    and ``setup_ranks`` gives ``max_sms`` and ``chunk_bytes`` too: this library therefore
    runs on communicators of its own, opened with only its settings."""

    def __init__(self, ranks: Ranks, name: str, settings: Dict[str, Any]):
        import hoccl
        comms: List[Any]
        if ranks.mpi is None:
            comms = hoccl.init_local(list(ranks.devices), backend=ranks.backend, **settings)
        else:
            comms = [hoccl.init(backend=ranks.backend, **settings)]
        super().__init__(Ranks(comms, ranks.world_size, ranks.mpi, ranks.devices,
                               ranks.backend), None, name, settings)

    def prepare(self) -> None:
        """Nothing: the table (and the settings given at init) decide."""

    def sms_for(self, collective: str, nbytes: int = 0) -> str:
        """The path the table gives a call of ``nbytes`` (nccl-tests' size), and where
        that came from, before what the path occupies."""
        comm = self.ranks.comms[0]
        blocks = comm.world_size if collective in ("all_gather", "reduce_scatter",
                                                   "all_to_all") else 1
        chosen = comm.explain(collective, nbytes - nbytes % blocks, "uint8")
        row = f"row {chosen['row']} of {chosen['table']}" if chosen["row"] is not None \
            else chosen["table"]
        if chosen["path"] == "direct":
            from ..sched.algorithms import kernel_blocks_for
            blocks = kernel_blocks_for(nbytes, chosen["settings"]["kernel_sms"])
            return f"direct kernel ({row}): {blocks} SMs (no copy engine)"
        return f"{chosen['path']} ({row}): {self.sms}"


class TorchNccl(Library):
    """NCCL through torch.distributed (its default settings)."""
    name = "nccl"
    sms = "NCCL kernels (CTAs per channel)"

    def __init__(self, ranks: Ranks):
        import torch
        import torch.distributed as dist
        self.ranks, self.dist = ranks, dist
        if not dist.is_initialized():
            port = ranks.mpi.bcast(29500 + os.getpid() % 2000 if ranks.mpi.rank == 0 else None)
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(port)
            dist.init_process_group("nccl", rank=ranks.mpi.rank, world_size=ranks.world_size,
                                    device_id=torch.device(f"cuda:{ranks.devices[0]}"))

        # its group: the default one, or its own where another library made the default
        self.group = (None if dist.get_backend() == "nccl" else
                      torch_group(ranks, "nccl"))

    def supports(self, collective, form):
        # torch's all_reduce and broadcast are in place only
        return not (collective in ("all_reduce", "broadcast") and form == "out")

    def run(self, rank_index, collective, send, recv, stream):
        import torch
        with torch.cuda.stream(stream):
            torch_call(self.dist, self.group, self.ranks, collective, send, recv)


def torch_group(ranks: Ranks, backend: str) -> Any:
    """A torch.distributed group of ``backend`` over every rank: the default group, made
    here from the MPI ranks where there is none yet, else a new group (every rank makes
    the libraries in the same order, so every rank makes the same groups)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return dist.new_group(backend=backend)
    port = None
    if ranks.mpi.rank == 0:  # a port nobody listens on, chosen by the system
        import socket
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(ranks.mpi.bcast(port))
    dist.init_process_group(backend, rank=ranks.mpi.rank, world_size=ranks.world_size)
    return None


def torch_call(dist: Any, group: Any, ranks: Ranks, collective: str, send: Any,
               recv: Any) -> None:
    """One call of ``collective`` through torch.distributed on ``group``; each returns
    when its work is enqueued (NCCL) or done (gloo)."""
    if collective == "sendrecv":
        to, source = ranks.pair(ranks.mpi.rank)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, to, group),
                                        dist.P2POp(dist.irecv, recv, source, group)])
        for work in works:
            work.wait()
    elif collective == "all_gather":
        dist.all_gather_into_tensor(recv, send, group=group)
    elif collective == "reduce_scatter":
        dist.reduce_scatter_tensor(recv, send, group=group)
    elif collective == "all_reduce":
        dist.all_reduce(recv, group=group)
    elif collective == "broadcast":
        dist.broadcast(recv, src=ROOT, group=group)
    else:
        dist.all_to_all_single(recv, send, group=group)


class Gloo(Library):
    """gloo through torch.distributed, on the same tensors: the CPU library a job has
    wherever torch is.  On GPU tensors its sends and receives go through host copies
    (gloo's point to point takes host memory only), counted in its time."""
    name = "gloo"
    sms = "none (the host's CPUs)"

    def __init__(self, ranks: Ranks):
        import torch.distributed as dist
        self.ranks, self.dist = ranks, dist
        if not dist.is_initialized():
            self.group = torch_group(ranks, "gloo")
        else:
            self.group = None if dist.get_backend() == "gloo" else torch_group(ranks, "gloo")

    def supports(self, collective, form):
        # all_reduce and broadcast in place only, as torch has them; gloo has no
        # reduce_scatter of one tensor
        return collective != "reduce_scatter" and not (
            collective in ("all_reduce", "broadcast") and form == "out")

    def run(self, rank_index, collective, send, recv, stream):
        if collective == "sendrecv" and send.device.type == "cuda":
            staged_send, staged_recv = send.cpu(), recv.cpu()
            torch_call(self.dist, self.group, self.ranks, collective, staged_send, staged_recv)
            recv.copy_(staged_recv)
        else:
            torch_call(self.dist, self.group, self.ranks, collective, send, recv)
        if send.device.type == "cuda":  # gloo's work on GPU tensors ends on a stream
            import torch
            torch.cuda.current_stream(send.device).synchronize()


class Nccl4py(Library):
    """NCCL through nccl4py: default mode, or the zero-SM mode (CTA policy ZERO with
    symmetric windows on NCCL-allocated buffers), which exists for all_gather and all_to_all."""

    def __init__(self, ranks: Ranks, zero: bool):
        import nccl.core as nccl
        self.nccl, self.ranks, self.zero = nccl, ranks, zero
        self.name = "nccl-zero" if zero else "nccl4py"
        self.sms = ("0 for remote blocks; own block copied on SMs" if zero
                    else "NCCL kernels (CTAs per channel)")
        uid = nccl.get_unique_id() if ranks.mpi.rank == 0 else None
        uid = ranks.mpi.bcast(uid)
        config = nccl.NCCLConfig(cta_policy=nccl.CTAPolicy.ZERO) if zero else None
        self.comm = nccl.Communicator.init(ranks.world_size, ranks.mpi.rank, uid, config)
        self.windows: List[Any] = []

    def supports(self, collective, form):
        if collective == "sendrecv":
            return False
        return not self.zero or collective in ("all_gather", "all_to_all", "broadcast")

    def sms_for(self, collective: str, nbytes: int = 0) -> str:
        if self.zero and collective == "broadcast":
            return "CTA policy ZERO (NCCL uses zero CTAs where it can)"
        return self.sms

    def empty(self, rank_index, count, dtype):
        if not self.zero:
            return super().empty(rank_index, count, dtype)
        from nccl.core.interop import torch as nccl_torch
        tensor = nccl_torch.empty(count, dtype=dtype, device=self.ranks.devices[rank_index])
        self.windows.append(self.comm.register_window(tensor, self.nccl.WindowFlag.COLL_SYMMETRIC))
        return tensor

    def release(self) -> None:
        for window in self.windows:
            window.close()
        self.windows.clear()

    def run(self, rank_index, collective, send, recv, stream):
        handle = stream.cuda_stream
        if collective == "all_gather":
            self.comm.allgather(send, recv, stream=handle)
        elif collective == "reduce_scatter":
            self.comm.reduce_scatter(send, recv, self.nccl.NcclRedOp.SUM, stream=handle)
        elif collective == "all_reduce":
            self.comm.allreduce(send, recv, self.nccl.NcclRedOp.SUM, stream=handle)
        elif collective == "broadcast":
            self.comm.broadcast(send, recv, ROOT, stream=handle)
        else:
            self.comm.alltoall(send, recv, stream=handle)


def libraries(ranks: Ranks, wanted: List[str]) -> List[Library]:
    """The libraries asked for that can run here (NCCL baselines need mpirun)."""
    found: List[Library] = []
    for name in wanted:
        base, *assignments = name.split("+")
        settings = {key: parse_size(value) for key, value in
                    (assignment.split("=") for assignment in assignments)}
        try:
            if base == "hoccl-auto":
                found.append(HocclAuto(ranks, name, settings))
            elif base in ("hoccl", "hoccl-local", "hoccl-peer", "hoccl-reg"):
                route = base.split("-")[1] if base in ("hoccl-local", "hoccl-peer") else None
                found.append(Hoccl(ranks, route, name, settings, registered=base == "hoccl-reg"))
            elif name == "gloo" and ranks.mpi is None:
                ranks.say(f"# {name}: skipped (it needs mpirun, one rank per process)")
            elif name == "gloo":
                found.append(Gloo(ranks))
            elif ranks.mpi is None or ranks.backend != "cuda":
                ranks.say(f"# {name}: skipped (NCCL baselines need mpirun, one rank per "
                          f"process, and the cuda backend)")
            elif name == "nccl":
                found.append(TorchNccl(ranks))
            elif name in ("nccl4py", "nccl-zero"):
                found.append(Nccl4py(ranks, zero=name == "nccl-zero"))
            else:
                raise ValueError(f"unknown library {name!r}")
        except ImportError as error:
            ranks.say(f"# {name}: skipped ({error})")
    return found


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
