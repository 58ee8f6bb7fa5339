"""The libraries the benchmarks measure side by side: hoccl (its default options, or a
variant), hoccl as a user who sets nothing gets it, NCCL through torch.distributed and
through nccl4py (its zero-SM mode too), and gloo; ``libraries`` makes those asked for
that can run here."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._harness import ROOT, Library, Ranks, parse_size

__all__ = ["Hoccl", "HocclAuto", "TorchNccl", "Gloo", "Nccl4py", "libraries", "torch_group",
           "torch_call"]


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
