"""Memory of a program that makes groups often: ``init_local(RANKS)``/``close()`` cycles on
the host backend.

Run: ``python tools/memory_cycles.py [--cycles 10000] [--ranks 3] [--every 1000]``

Each cycle makes a group of ``--ranks`` host ranks and closes it (an all_reduce every
``--every`` cycles, checked exactly).  After 20 warm-up cycles it prints, every
``--every`` cycles, the memory Python has allocated since (``tracemalloc``), the
process's resident set (``/proc/self/status``: VmRSS) and the signal pads handed out or
kept and free for reuse (``hoccl.backends.host``): a flat footprint is the same figure
row after row.  ``--json PATH`` writes the rows.
"""

import argparse
import json
import time
import tracemalloc

import hoccl
from hoccl.backends.host import _PADS
from hoccl.testing import check_collective


def resident_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=10000)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    def cycle(index: int) -> None:
        comms = hoccl.init_local(args.ranks, backend="host")
        if index % args.every == 0:
            check_collective(comms, "all_reduce", count=7, dtype="float32", seed=index)
        for comm in comms:
            comm.close()
    for index in range(20):
        cycle(index)
    tracemalloc.start()
    base, rss = tracemalloc.get_traced_memory()[0], resident_kib()
    started = time.monotonic()
    rows = []
    print(f"{'cycles':>8} {'traced growth B':>16} {'RSS growth KiB':>15} {'pads kept':>10} "
          f"{'pads free':>10} {'s':>7}")
    for index in range(1, args.cycles + 1):
        cycle(index)
        if index % args.every == 0 or index == args.cycles:
            kept, free = _PADS.counts()
            row = dict(cycles=index, traced_growth=tracemalloc.get_traced_memory()[0] - base,
                       rss_growth_kib=resident_kib() - rss, pads_kept=kept, pads_free=free,
                       seconds=round(time.monotonic() - started, 1))
            rows.append(row)
            print(f"{index:>8} {row['traced_growth']:>16} {row['rss_growth_kib']:>15} "
                  f"{kept:>10} {free:>10} {row['seconds']:>7}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(ranks=args.ranks, rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
