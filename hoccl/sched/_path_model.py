"""The paths a machine that was never measured takes: a cost model (pure).

``model_table(machine)`` scores every candidate path (``select.candidates``) of every
collective at every size from 4 KiB to 1 GiB (by 2×) and writes the cheapest into a
``select.Table``, so that the selector treats it as any measured table: rows of size
ranges, the user's settings over them, every rank on rank 0's.  A path's cost is that
of NCCL's own model (``src/graph/tuning.cc``: latency plus bytes over bandwidth)::

    µs = latency_us + (phases - 1) * phase_us + bytes a rank moves / bandwidth

with the bytes of nccl-tests' bus bandwidth (all_gather, reduce_scatter, all_to_all:
size·(n−1)/n; all_reduce: 2·size·(n−1)/n; broadcast: size), except the one-shot
all_reduce, which pushes its whole input to every peer ((n−1)·size).  A pushed
all_reduce has two phases (a reduce_scatter, then an all_gather); the rest one.

The constants (``NVLINK``) are conservative: measured on 2 × H200 over NVLink (the
recorded runs named in each ``PathCost.source``), each path's time at its smallest
measured size and the lowest bandwidth hoccl reached on it; a path is never chosen past
the largest size it was measured at (``PathCost.max_bytes``).  What the machine's facts
change:

* the cuda backend only: the host backend keeps its documented defaults (no model), so
  that a host communicator behaves the same on every machine;
* ranks sharing a GPU (``ranks_per_gpu`` > 1): no direct kernel (a kernel that waits for
  its peers spins through its context's time slice while the peer's waits: about 2.3 ms
  per call at every size on one H200, results/h200/session13/tune/README.md);
* a link other than NVLink (PCIe, none, unknown): copy engines only (the defaults),
  since no other path was measured on one;
* the world size: the bytes above, and the direct kernels' rank limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .select import ANY_SIZE, MACHINE_KEYS, Row, Table, candidates, rows_from

__all__ = ["PathCost", "NVLINK", "MODEL_SIZES", "costs", "excluded_paths", "paths_for", "model_table"]


@dataclass(frozen=True)
class PathCost:
    """One path's constants: µs per call of its smallest sizes (one phase, and each
    further phase), the bytes per µs a rank moves on it, the largest size the model
    takes it to, and the measurement these come from."""
    latency_us: float
    phase_us: float
    bytes_per_us: float
    max_bytes: int
    source: str


_TWO_H200 = ("results/h200x2/session7/figures-a/bench-small.log (2 x H200, NVLink, bf16, "
             "in place, in CUDA graphs)")
#: 2 × H200 over NVLink: conservative constants per path
NVLINK: Mapping[str, PathCost] = {
    # reduce_scatter 8 KiB 30.6 µs, all_reduce 43.4 µs (2 × H200); 205 GB/s, the lowest
    # of hoccl's 1 GiB copy-engine figures (reduce_scatter on 8 SMs)
    "push": PathCost(30.6, 12.8, 205e3, ANY_SIZE,
                     f"{_TWO_H200}; 1 GiB reduce_scatter 205 GB/s "
                     f"(docs/results/h200x2-2026-11-30.md)"),
    # reduce_scatter 8 KiB 18.3 µs, all_reduce 31.7 µs; 16 MiB reduce_scatter 76.7 µs:
    # 8.4 MB in 58.4 µs, 144 GB/s (2 × H200)
    "pull": PathCost(18.3, 13.4, 144e3, 16 << 20, _TWO_H200),
    # all_reduce 8 KiB 30.6 µs; 16 MiB 123.2 µs: 16.8 MB in 92.6 µs, 181 GB/s (2 × H200)
    "one_shot": PathCost(30.6, 0.0, 181e3, 16 << 20, _TWO_H200),
    # 7.6 µs for a 64 KiB all_reduce on one H200 (loopback, docs/results/one-gpu.md): twice
    # that over NVLink, never measured there, and 100 GB/s, below every copy path;
    # measured up to 1 MiB
    "direct": PathCost(15.2, 0.0, 100e3, 1 << 20,
                       "results/h200/session9/README.md (one H200, loopback, in graphs)"),
}
#: the sizes the model scores: 4 KiB to 1 GiB by 2×
MODEL_SIZES = tuple(4096 << shift for shift in range(19))
_ONE_PHASE = {"reduce_scatter", "all_gather", "all_to_all", "broadcast"}


def _moved(path: str, collective: str, size: int, world_size: int) -> float:
    """Bytes a rank moves for the call."""
    if collective == "all_reduce":
        return size * (world_size - 1) * (1.0 if path == "one_shot" else 2.0 / world_size)
    if collective == "broadcast":
        return float(size)
    return size * (world_size - 1) / world_size


def costs(collective: str, size: int, world_size: int,
          paths: Mapping[str, PathCost]) -> Dict[str, float]:
    """µs per call of each of ``paths`` a call of ``collective`` and ``size`` can take
    (``select.candidates``, within each path's ``max_bytes``)."""
    found = {}
    for path in candidates(collective, world_size):
        cost = paths.get(path)
        if cost is None or size > cost.max_bytes:
            continue
        phases = 1 if collective in _ONE_PHASE or path == "one_shot" else 2
        found[path] = (cost.latency_us + (phases - 1) * cost.phase_us
                       + _moved(path, collective, size, world_size) / cost.bytes_per_us)
    return found


def excluded_paths(machine: Mapping[str, Any]) -> Tuple[str, ...]:
    """Paths neither the model nor the tuner offers on ``machine``: the direct kernel where
    ranks share a GPU (its timing there is the time slice's, not the path's)."""
    return ("direct",) if machine.get("ranks_per_gpu", 1) > 1 else ()


def paths_for(machine: Mapping[str, Any]) -> Tuple[Optional[Mapping[str, PathCost]], str]:
    """The paths the model scores on ``machine`` (None: no model, the defaults) and why."""
    if machine["backend"] != "cuda":
        return None, f"the {machine['backend']} backend keeps its defaults"
    excluded = excluded_paths(machine)
    if excluded:
        return ({path: cost for path, cost in NVLINK.items() if path not in excluded},
                f"{machine['ranks_per_gpu']} ranks per GPU: no direct kernel")
    if machine["link"] != "nvlink":
        return {"push": NVLINK["push"]}, f"link {machine['link']}: copy engines only"
    return NVLINK, "NVLink"


def model_table(machine: Mapping[str, Any],
                collectives: Sequence[str] = ("all_gather", "reduce_scatter", "all_reduce",
                                              "all_to_all", "broadcast")
                ) -> Optional[Table]:
    """The model's table for ``machine`` (``select.MACHINE_KEYS``), or None where the
    model does not apply (``paths_for``)."""
    paths, why = paths_for(machine)
    if paths is None:
        return None
    world_size = machine["world_size"]
    rows: List[Row] = []
    for collective in collectives:
        picks = []
        for size in MODEL_SIZES:
            scored = costs(collective, size, world_size, paths)
            picks.append((size, min(scored, key=lambda path: (scored[path], path)), ()))
        rows += rows_from(collective, picks, True,
                          lambda sizes: f"model ({why}): cheapest at {sizes[0]}..{sizes[-1]} "
                                        f"bytes", midpoint=False)
    sources = "; ".join(sorted({f"{path}: {cost.source}" for path, cost in paths.items()}))
    return Table(tuple((key, machine[key]) for key in MACHINE_KEYS), tuple(rows), "model",
                 f"the cost model's conservative constants ({why}), from {sources}")
