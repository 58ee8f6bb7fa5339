"""A cost model of collectives at scale: hosts × GPUs per host, NVLink and network.

Pure functions of a ``Machine`` (bandwidths in GB/s = 1e9 B/s, latencies in µs) and a
size in bytes (nccl-tests' size: the whole buffer of all_reduce, the whole output of
all_gather, the whole input of reduce_scatter and all_to_all), returning µs:

* ``nccl_ring``: NCCL's ring, after NCCL's tuning model (``src/graph/tuning.cc``) and
  nccl-tests' bus bandwidth (``doc/PERFORMANCE.md``): time = latency + bytes ·
  steps / (n · B), with 2(n−1) steps for all_reduce and n−1 for all_gather,
  reduce_scatter and all_to_all, and latency = base + intra-host steps · α_nvlink +
  inter-host steps · α_net (2(H−1) inter-host steps of all_reduce).  On a rail-optimised
  cluster (one NIC per GPU) a ring leaves each host once per channel and the G rings of
  a host use all G NICs, so B = min(NVLink per GPU, G · NIC per GPU).
* ``nccl_tree``: NCCL's double binary tree all_reduce (the NCCL 2.4 blog "Massively
  Scale Your Deep Learning Training with NCCL 2.4"; tuning.cc: algorithm bandwidth =
  bus bandwidth / 2): time = base + 2 · ((G−1) · α_nvlink + log2(H) · α_net) + 2 · S / B.
  NCCL's correction factors for trees at medium sizes are left out.
* ``hoccl_hierarchical``: hoccl's plans (``hoccl.sched.hierarchical``) as phases
  (``phases``): hoccl calls inside hosts (their measured bus bandwidth, ``reduce_gbps``
  for the SM-capped reductions, plus a host cost per call) and a ring over each rail on
  1/G of the data (per-GPU NIC; all of it for all_to_all), e.g. all_reduce one after
  another: (G−1)/G · S / B_reduce + 2(H−1)/H · (S/G) / B_nic + (G−1)/G · S / B_nvlink.
  ``pipelined=True`` runs them chunk by chunk as the runtime does (``phases``
  "pipelined": each level, inside hosts and between them, on a worker of its own): the
  first chunk through every phase, then one chunk per period of the busiest level
  (``pipeline_us``), each chunk paying its phases' host costs and latencies again (the
  runtime pipelines all_reduce, broadcast and reduce; for the other collectives the
  model shows what the same scheme would give).
  ``staged=True``: the engine between hosts is MPI or gloo on pinned host memory, its
  device-to-host and host-to-device copies (on copy engines) two more overlapped phases
  and all_reduce's sums on the host's CPUs.

Every figure is a model's, not a measurement: the constants are measured where
``Machine`` says so and assumed where it says so.

``python -m hoccl.sched.cost`` prints a table (1–64 hosts × 8 GPUs, 1 GiB by default).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Machine", "Phase", "phases", "host_shares", "pipeline_us", "best_chunks",
           "nccl_ring",
           "nccl_tree", "hoccl_hierarchical", "bus_bandwidth", "table", "main"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
#: ``hoccl.Config.phase_bytes``'s default: the chunk the runtime pipelines its phases in
PHASE_BYTES = 64 << 20


@dataclass(frozen=True)
class Machine:
    """A cluster: ``hosts`` × ``gpus_per_host``.  Defaults: hosts with NVSwitch and one
    400 Gb/s NIC per GPU.  Measured: ``nvlink_gbps`` and ``reduce_gbps`` are hoccl's
    1 GiB bus bandwidths inside a host (copies; reductions on the default 8 summing SMs)
    and ``hoccl_call_us`` its host cost of one call, from the 2-GPU results
    (docs/results.md); ``copy_call_us`` one ``cuMemcpyAsync`` from Python (DEVICE.md).
    NCCL's tuning constants for the Simple protocol: the latencies.  Assumed, not
    measured here: ``staging_gbps`` (pinned host memory over PCIe Gen5 x16, per
    direction), ``mpi_call_us`` (one MPI call's host cost) and ``host_reduce_gbps`` (the
    CPUs' sums of one rail's data, staged engine).  Pass another machine's figures to
    model it."""
    hosts: int
    gpus_per_host: int = 8
    nvlink_gbps: float = 380.0
    reduce_gbps: float = 205.0
    nic_gbps: float = 50.0
    hoccl_call_us: float = 120.0
    nvlink_latency_us: float = 3.4
    net_latency_us: float = 9.6
    nccl_base_us: float = 8.4
    copy_call_us: float = 3.0
    staging_gbps: float = 50.0
    mpi_call_us: float = 10.0
    host_reduce_gbps: float = 20.0

    @property
    def world_size(self) -> int:
        return self.hosts * self.gpus_per_host


def _bytes_per_us(gbps: float) -> float:
    return gbps * 1e3


def _steps(collective: str, ranks: int) -> int:
    return 2 * (ranks - 1) if collective == "all_reduce" else ranks - 1


def _ring_bandwidth(m: Machine) -> float:
    if m.hosts == 1:
        return m.nvlink_gbps
    return min(m.nvlink_gbps, m.gpus_per_host * m.nic_gbps)


def nccl_ring(collective: str, nbytes: float, m: Machine) -> float:
    """µs of NCCL's ring over the whole world (all_to_all: NCCL's point-to-point
    exchange, whose cross-host share (H−1)/H of every GPU's data leaves through NICs that
    no ring can share: (H−1)/H · S / B_nic)."""
    n, H = m.world_size, m.hosts
    if collective == "all_to_all" and H > 1:
        return (m.nccl_base_us + (n - 1) * m.net_latency_us
                + nbytes * (H - 1) / H / _bytes_per_us(m.nic_gbps))
    steps, inter = _steps(collective, n), _steps(collective, H)
    latency = (m.nccl_base_us + (steps - inter) * m.nvlink_latency_us
               + inter * m.net_latency_us)
    return latency + nbytes * steps / n / _bytes_per_us(_ring_bandwidth(m))


def nccl_tree(nbytes: float, m: Machine) -> float:
    """µs of NCCL's double binary tree all_reduce (chains inside hosts)."""
    latency = m.nccl_base_us + 2 * ((m.gpus_per_host - 1) * m.nvlink_latency_us
                                    + math.log2(m.hosts) * m.net_latency_us)
    return latency + 2 * nbytes / _bytes_per_us(_ring_bandwidth(m))


@dataclass(frozen=True)
class Phase:
    """One phase of a hierarchical collective, on the whole message: ``host_us`` (the
    host's cost of its calls) and ``latency_us`` paid once per chunk, ``transfer_us``
    spread over the chunks.  ``level`` is the worker that runs it: the phases of one
    level take turns (the inner engine runs a host's reduce_scatter and all_gather one
    after the other); phases of different levels overlap."""
    name: str
    level: str
    host_us: float
    latency_us: float
    transfer_us: float

    def chunk_us(self, chunks: int) -> float:
        return self.host_us + self.latency_us + self.transfer_us / chunks


def _rail(collective: str, nbytes: float, m: Machine, staged: bool = False) -> List[Phase]:
    """An NCCL ring over one rail (H ranks, one NIC each) moving ``nbytes`` per GPU; staged
    (MPI or gloo on pinned host memory): the device-to-host copy before it and the
    host-to-device copy after it on copy engines (``staging_gbps``, ``copy_call_us``
    each), and all_reduce's and reduce_scatter's sums on the host's CPUs
    (``host_reduce_gbps``).  Between two hosts the staged all_reduce is one all_gather and
    a fold of the whole message (the same bytes on the wire in one step, twice the sums)."""
    H = m.hosts
    steps = _steps(collective, H)
    pair = staged and collective == "all_reduce" and H == 2
    wire = Phase(f"rail {collective}", "rail", m.mpi_call_us if staged else 0.0,
                 m.nccl_base_us + (1 if pair else steps) * m.net_latency_us,
                 nbytes * steps / H / _bytes_per_us(m.nic_gbps))
    if not staged:
        return [wire]
    folded = nbytes if pair else nbytes * (H - 1) / H
    sums = (folded / _bytes_per_us(m.host_reduce_gbps)
            if collective in ("all_reduce", "reduce_scatter") else 0.0)
    wire = replace(wire, transfer_us=wire.transfer_us + sums)
    # all_gather's rail stages in this rank's block and stages out every host's
    size_in = nbytes / H if collective == "all_gather" else nbytes
    size_out = nbytes / H if collective == "reduce_scatter" else nbytes
    return [Phase("device to host", "stage in", m.copy_call_us, 0.0,
                  size_in / _bytes_per_us(m.staging_gbps)),
            wire,
            Phase("host to device", "stage out", m.copy_call_us, 0.0,
                  size_out / _bytes_per_us(m.staging_gbps))]


def _host(name: str, nbytes: float, gbps: float, calls: int, m: Machine) -> List[Phase]:
    """hoccl calls inside a host moving (G−1)/G of ``nbytes`` per GPU."""
    G = m.gpus_per_host
    if G == 1:
        return []
    return [Phase(f"host {name}", "host", calls * m.hoccl_call_us, 0.0,
                  nbytes * (G - 1) / G / _bytes_per_us(gbps))]


def phases(collective: str, nbytes: float, m: Machine, staged: bool = False) -> List[Phase]:
    """The phases of hoccl's hierarchical ``collective`` in the order a chunk goes through
    them (``staged``: the engine between hosts stages through pinned host memory)."""
    H, G = m.hosts, m.gpus_per_host
    if collective not in COLLECTIVES:
        raise ValueError(f"phases: collective must be one of {COLLECTIVES}; got "
                         f"{collective!r}")
    if H == 1:
        return []
    if collective == "all_reduce":
        return [*_host("reduce_scatter", nbytes, m.reduce_gbps, 1, m),
                *_rail("all_reduce", nbytes / G, m, staged),
                *_host("all_gather", nbytes, m.nvlink_gbps, 1, m)]
    if collective == "all_gather":
        return [*_rail("all_gather", nbytes / G, m, staged),
                *_host("all_gather", nbytes, m.nvlink_gbps, H, m)]
    if collective == "reduce_scatter":
        return [*_host("reduce_scatter", nbytes, m.reduce_gbps, H, m),
                *_rail("reduce_scatter", nbytes / G, m, staged)]
    return [*_host("all_to_all", nbytes, m.nvlink_gbps, H, m),
            *_rail("all_to_all", nbytes, m, staged)]


def pipeline_us(steps: Sequence[Phase], chunks: int) -> float:
    """µs of ``steps`` run chunk by chunk: the first chunk goes through every phase (the
    fill), then each level delivers one chunk per period, the period being the busiest
    level's time per chunk (its phases' host costs, latencies and transfers of one
    chunk): fill + (chunks − 1) · period.  One chunk is the phases one after another;
    as chunks grow with no per-chunk cost, it tends to the slowest level's transfer."""
    if not steps:
        return 0.0
    fill = sum(phase.chunk_us(chunks) for phase in steps)
    busy: Dict[str, float] = {}
    for phase in steps:
        busy[phase.level] = busy.get(phase.level, 0.0) + phase.chunk_us(chunks)
    return fill + (chunks - 1) * max(busy.values())


def best_chunks(steps: Sequence[Phase], nbytes: float, smallest: int = 1 << 20) -> int:
    """The number of chunks (a power of two, chunks of at least ``smallest`` bytes) that
    gives ``steps`` their shortest pipeline."""
    counts = [1 << k for k in range(31) if (1 << k) == 1 or nbytes / (1 << k) >= smallest]
    return min(counts, key=lambda chunks: pipeline_us(steps, chunks))


def host_shares(collective: str, nbytes: float, m: Machine, staged: bool = False
                ) -> List[Phase]:
    """all_gather's and reduce_scatter's phases as the runtime pipelines them, one chunk
    per host (its "share": a rail broadcast of one host's blocks then a host all_gather
    of them, or a host reduce_scatter of the blocks bound for one host then a rail
    reduce to it): per chunk one hoccl call and a broadcast's (reduce's) latency, H − 1
    network steps; on the network each share's bytes cross every rail once."""
    H, G = m.hosts, m.gpus_per_host
    shares = []
    for phase in phases(collective, nbytes, m, staged):
        if phase.level == "host":
            phase = replace(phase, host_us=m.hoccl_call_us)
        elif phase.level == "rail":
            sums = (nbytes / G * (H - 1) / H / _bytes_per_us(m.host_reduce_gbps)
                    if staged and collective == "reduce_scatter" else 0.0)
            phase = replace(phase, latency_us=m.nccl_base_us + (H - 1) * m.net_latency_us,
                            transfer_us=nbytes / G / _bytes_per_us(m.nic_gbps) + sums)
        shares.append(phase)
    return shares


def hoccl_hierarchical(collective: str, nbytes: float, m: Machine,
                       pipelined: bool = False, staged: bool = False,
                       chunk_bytes: Optional[int] = None) -> float:
    """µs of hoccl's hierarchical plan: host phases (hoccl) and rail phases (NCCL, or
    ``staged`` through pinned host memory), one after another, or (``pipelined``) chunk
    by chunk (``pipeline_us``): all_gather and reduce_scatter one chunk per host
    (``host_shares``) where each host's share holds ``chunk_bytes`` (None:
    ``PHASE_BYTES``), else in turn, as the runtime chooses; the others in chunks of
    ``chunk_bytes`` (None: the best power-of-two count, ``best_chunks``)."""
    H, G = m.hosts, m.gpus_per_host
    if collective not in COLLECTIVES:
        raise ValueError(f"hoccl_hierarchical: collective must be one of {COLLECTIVES}; "
                         f"got {collective!r}")
    if H == 1:  # one hoccl call (all_reduce pipelines its sums with its copies)
        gbps = m.reduce_gbps if collective == "reduce_scatter" else m.nvlink_gbps
        steps = _steps(collective, G)
        return m.hoccl_call_us + nbytes * steps / G / _bytes_per_us(gbps)
    found = phases(collective, nbytes, m, staged)
    if not pipelined:
        return pipeline_us(found, 1)
    if collective in ("all_gather", "reduce_scatter"):
        if nbytes / H < (chunk_bytes or PHASE_BYTES):
            return pipeline_us(found, 1)
        return pipeline_us(host_shares(collective, nbytes, m, staged), H)
    chunks = (best_chunks(found, nbytes) if chunk_bytes is None
              else max(1, math.ceil(nbytes / chunk_bytes)))
    return pipeline_us(found, chunks)


def bus_bandwidth(collective: str, nbytes: float, microseconds: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth in GB/s."""
    factor = 2 * (ranks - 1) / ranks if collective == "all_reduce" else (ranks - 1) / ranks
    return nbytes / microseconds / 1e3 * factor


def table(collective: str, nbytes: float, hosts: Sequence[int], base: Machine,
          chunk_bytes: int = PHASE_BYTES) -> List[Dict[str, float]]:
    """One row per host count: µs and bus bandwidth of each algorithm, and the chunk
    count of the pipeline ("hoccl pipelined": one per host for all_gather and
    reduce_scatter, else the best)."""
    rows = []
    for count in hosts:
        m = replace(base, hosts=count)
        shared = collective in ("all_gather", "reduce_scatter")
        row: Dict[str, float] = {"hosts": count, "gpus": m.world_size,
                                 "chunks": (count if nbytes / count >= PHASE_BYTES else 1)
                                 if shared else
                                 best_chunks(phases(collective, nbytes, m), nbytes)}
        times = {"nccl ring": nccl_ring(collective, nbytes, m),
                 "hoccl hier": hoccl_hierarchical(collective, nbytes, m),
                 "hoccl pipelined": hoccl_hierarchical(collective, nbytes, m, True),
                 f"pipelined {_label(chunk_bytes)} chunks": hoccl_hierarchical(
                     collective, nbytes, m, True, chunk_bytes=chunk_bytes),
                 "staged pipelined": hoccl_hierarchical(collective, nbytes, m, True, True)}
        if collective == "all_reduce" and count > 1:
            times["nccl tree"] = nccl_tree(nbytes, m)
        for name, micro in times.items():
            row[name] = micro
            row[name + " busbw"] = bus_bandwidth(collective, nbytes, micro, m.world_size)
        rows.append(row)
    return rows


def _label(nbytes: float) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{int(nbytes // size)}{unit}"
    return str(int(nbytes))


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units \
        else int(text)


def _verdict(rows: List[Dict[str, float]]) -> str:
    """Where the best pipeline is at or below NCCL's ring, and where not."""
    wins = [int(row["hosts"]) for row in rows
            if row["hosts"] > 1 and row["hoccl pipelined"] <= row["nccl ring"]]
    losses = [f"{int(row['hosts'])} ({row['hoccl pipelined'] / row['nccl ring']:.2f}x)"
              for row in rows if row["hosts"] > 1 and row["hoccl pipelined"] > row["nccl ring"]]
    return (f"pipelined at or below the ring at hosts {wins or 'none'}; above it at "
            f"{', '.join(losses) or 'none'}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hoccl.sched.cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collective", default="all_reduce,all_gather",
                        help=f"comma-separated, of {COLLECTIVES}")
    parser.add_argument("--size", default="1G", help="bytes (K, M, G suffixes)")
    parser.add_argument("--hosts", default="1,2,4,8,16,32,64")
    parser.add_argument("--chunk", default=_label(PHASE_BYTES),
                        help="the runtime's chunk of pipelined phases (Config.phase_bytes)")
    defaults = Machine(1)
    for name in ("gpus_per_host", "nvlink_gbps", "reduce_gbps", "nic_gbps", "hoccl_call_us",
                 "net_latency_us", "staging_gbps", "mpi_call_us", "host_reduce_gbps"):
        value = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args(argv)
    nbytes = _size(args.size)
    base = replace(defaults, **{name: getattr(args, name) for name in vars(args)
                                if hasattr(defaults, name)})
    print(f"# a model, not a measurement (hoccl.sched.cost): {base.gpus_per_host} GPUs per "
          f"host, NVLink {base.nvlink_gbps:g} GB/s (hoccl reductions {base.reduce_gbps:g}), "
          f"NIC {base.nic_gbps:g} GB/s per GPU, hoccl call {base.hoccl_call_us:g} us, net "
          f"step {base.net_latency_us:g} us; staged: PCIe {base.staging_gbps:g} GB/s, CPU "
          f"sums {base.host_reduce_gbps:g} GB/s (assumed)")
    for collective in args.collective.split(","):
        rows = table(collective, nbytes, [int(h) for h in args.hosts.split(",")], base,
                     _size(args.chunk))
        names = [key for key in rows[-1] if key not in ("hosts", "gpus", "chunks")
                 and not key.endswith("busbw")]
        print(f"\n{collective}, {args.size}: time ms (busbw GB/s); chunks: the pipeline's "
              f"(one per host for all_gather and reduce_scatter where a host's share "
              f"holds {_label(PHASE_BYTES)}, as built; else the best)")
        print("| hosts x gpus | " + " | ".join(names) + " | chunks |")
        print("|---" * (len(names) + 2) + "|")
        for row in rows:
            cells = [f"{row[name] / 1e3:.2f} ({row[name + ' busbw']:.0f})" if name in row
                     else "—" for name in names]
            print(f"| {row['hosts']} x {base.gpus_per_host} | " + " | ".join(cells)
                  + f" | {int(row['chunks'])} |")
        print(_verdict(rows))


if __name__ == "__main__":
    main()
