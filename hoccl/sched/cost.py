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
* ``hoccl_hierarchical``: hoccl's plans (``hoccl.sched.hierarchical``) as they run now,
  one phase after another: hoccl calls inside hosts (their measured bus bandwidth,
  ``reduce_gbps`` for the SM-capped reductions, plus a host cost per call) and an NCCL
  ring over each rail on 1/G of the data (per-GPU NIC; all of it for all_to_all), e.g.
  all_reduce:
  (G−1)/G · S / B_reduce + 2(H−1)/H · (S/G) / B_nic + (G−1)/G · S / B_nvlink.
  ``pipelined=True`` gives the bound a chunked overlap of the phases would reach
  (the slowest phase plus the others' latencies): not implemented, shown for contrast.

``python -m hoccl.sched.cost`` prints a table (1–64 hosts × 8 GPUs, 1 GiB by default).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Machine", "nccl_ring", "nccl_tree", "hoccl_hierarchical", "bus_bandwidth",
           "table", "main"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Machine:
    """A cluster: ``hosts`` × ``gpus_per_host``.  Defaults: hosts with NVSwitch and one
    400 Gb/s NIC per GPU.  ``nvlink_gbps`` and ``reduce_gbps`` are hoccl's 1 GiB bus
    bandwidths inside a host (copies; reductions on the default 8 summing SMs) and
    ``hoccl_call_us`` its host cost of one call, taken from the current 2-GPU results
    (docs/results.md): pass another machine's figures to model it.  The latencies are
    NCCL's tuning constants for the Simple protocol."""
    hosts: int
    gpus_per_host: int = 8
    nvlink_gbps: float = 380.0
    reduce_gbps: float = 205.0
    nic_gbps: float = 50.0
    hoccl_call_us: float = 120.0
    nvlink_latency_us: float = 3.4
    net_latency_us: float = 9.6
    nccl_base_us: float = 8.4

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


def _rail(collective: str, nbytes: float, m: Machine) -> Tuple[float, float]:
    """(latency, transfer) µs of an NCCL ring over one rail (H ranks, one NIC each)."""
    H = m.hosts
    if H == 1:
        return 0.0, 0.0
    steps = _steps(collective, H)
    return (m.nccl_base_us + steps * m.net_latency_us,
            nbytes * steps / H / _bytes_per_us(m.nic_gbps))


def _host(nbytes: float, gbps: float, calls: int, m: Machine) -> Tuple[float, float]:
    """(latency, transfer) µs of hoccl calls inside a host moving (G−1)/G of ``nbytes``
    per GPU."""
    G = m.gpus_per_host
    if G == 1:
        return 0.0, 0.0
    return calls * m.hoccl_call_us, nbytes * (G - 1) / G / _bytes_per_us(gbps)


def hoccl_hierarchical(collective: str, nbytes: float, m: Machine,
                       pipelined: bool = False) -> float:
    """µs of hoccl's hierarchical plan: host phases (hoccl) and rail phases (NCCL), one
    after another, or (``pipelined``) with their transfers overlapped."""
    H, G = m.hosts, m.gpus_per_host
    if H == 1:  # one hoccl call (all_reduce pipelines its sums with its copies)
        gbps = m.reduce_gbps if collective == "reduce_scatter" else m.nvlink_gbps
        steps = _steps(collective, G)
        return m.hoccl_call_us + nbytes * steps / G / _bytes_per_us(gbps)
    if collective == "all_reduce":
        phases = [_host(nbytes, m.reduce_gbps, 1, m), _rail("all_reduce", nbytes / G, m),
                  _host(nbytes, m.nvlink_gbps, 1, m)]
    elif collective == "all_gather":
        phases = [_rail("all_gather", nbytes / G, m), _host(nbytes, m.nvlink_gbps, H, m)]
    elif collective == "reduce_scatter":
        phases = [_host(nbytes, m.reduce_gbps, H, m), _rail("reduce_scatter", nbytes / G, m)]
    elif collective == "all_to_all":
        phases = [_host(nbytes, m.nvlink_gbps, H, m), _rail("all_to_all", nbytes, m)]
    else:
        raise ValueError(f"hoccl_hierarchical: collective must be one of {COLLECTIVES}; "
                         f"got {collective!r}")
    latency = sum(phase[0] for phase in phases)
    transfers = [phase[1] for phase in phases]
    return latency + (max(transfers) if pipelined else sum(transfers))


def bus_bandwidth(collective: str, nbytes: float, microseconds: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth in GB/s."""
    factor = 2 * (ranks - 1) / ranks if collective == "all_reduce" else (ranks - 1) / ranks
    return nbytes / microseconds / 1e3 * factor


def table(collective: str, nbytes: float, hosts: Sequence[int], base: Machine
          ) -> List[Dict[str, float]]:
    """One row per host count: µs and bus bandwidth of each algorithm."""
    rows = []
    for count in hosts:
        m = replace(base, hosts=count)
        row: Dict[str, float] = {"hosts": count, "gpus": m.world_size}
        times = {"nccl ring": nccl_ring(collective, nbytes, m),
                 "hoccl hier": hoccl_hierarchical(collective, nbytes, m),
                 "hoccl hier pipelined": hoccl_hierarchical(collective, nbytes, m, True)}
        if collective == "all_reduce" and count > 1:
            times["nccl tree"] = nccl_tree(nbytes, m)
        for name, micro in times.items():
            row[name] = micro
            row[name + " busbw"] = bus_bandwidth(collective, nbytes, micro, m.world_size)
        rows.append(row)
    return rows


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units \
        else int(text)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hoccl.sched.cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collective", default="all_reduce,all_gather",
                        help=f"comma-separated, of {COLLECTIVES}")
    parser.add_argument("--size", default="1G", help="bytes (K, M, G suffixes)")
    parser.add_argument("--hosts", default="1,2,4,8,16,32,64")
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--nvlink-gbps", type=float, default=Machine.nvlink_gbps)
    parser.add_argument("--reduce-gbps", type=float, default=Machine.reduce_gbps)
    parser.add_argument("--nic-gbps", type=float, default=Machine.nic_gbps)
    parser.add_argument("--hoccl-call-us", type=float, default=Machine.hoccl_call_us)
    parser.add_argument("--net-latency-us", type=float, default=Machine.net_latency_us)
    args = parser.parse_args(argv)
    nbytes = _size(args.size)
    base = Machine(1, args.gpus_per_host, args.nvlink_gbps, args.reduce_gbps, args.nic_gbps,
                   args.hoccl_call_us, net_latency_us=args.net_latency_us)
    print(f"# model: {args.gpus_per_host} GPUs per host, NVLink {args.nvlink_gbps:g} GB/s "
          f"(hoccl reductions {args.reduce_gbps:g}), NIC {args.nic_gbps:g} GB/s per GPU, "
          f"hoccl call {args.hoccl_call_us:g} us, net step {args.net_latency_us:g} us")
    for collective in args.collective.split(","):
        rows = table(collective, nbytes, [int(h) for h in args.hosts.split(",")], base)
        names = [key for key in rows[-1] if key not in ("hosts", "gpus")
                 and not key.endswith("busbw")]
        print(f"\n{collective}, {args.size}: time ms (busbw GB/s)")
        print("| hosts x gpus | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for row in rows:
            cells = [f"{row[name] / 1e3:.2f} ({row[name + ' busbw']:.0f})" if name in row
                     else "—" for name in names]
            print(f"| {row['hosts']} x {args.gpus_per_host} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
