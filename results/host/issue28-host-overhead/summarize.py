"""Best round and median (µs per call, slowest rank) of each side, size and collective,
and the Python calls inside hoccl per call (``calls-*.txt``), from the text outputs
beside this file, into summary.json; prints a table."""

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
best = {}
for path in sorted(HERE.glob("*-round*.txt")):
    *kind, side, size, _ = path.stem.split("-")
    for line in path.read_text().splitlines():
        found = re.match(r"(all_gather|reduce_scatter|all_reduce)\s+([\d.]+)\s+([\d.]+)\s+(.*)",
                         line)
        if found:
            key = ("-".join(kind) or "unregistered", size, found.group(1))
            rounds = [float(value) for value in found.group(4).split()]
            best.setdefault(key, {}).setdefault(side, []).extend(rounds)
summary = []
print(f"{'buffers':13s} {'size':5s} {'collective':15s} {'before min':>10s} {'after min':>10s} "
      f"{'before median':>14s} {'after median':>13s}")
for (kind, size, collective), sides in sorted(best.items()):
    row = {"buffers": kind, "size": size, "collective": collective}
    for side in ("before", "after"):
        rounds = sorted(sides[side])
        row[f"{side}_min_us"] = rounds[0]
        row[f"{side}_median_us"] = rounds[len(rounds) // 2]
        row[f"{side}_rounds"] = len(rounds)
    summary.append(row)
    print(f"{kind:13s} {size:5s} {collective:15s} {row['before_min_us']:10.1f} {row['after_min_us']:10.1f} "
          f"{row['before_median_us']:14.1f} {row['after_median_us']:13.1f}")
calls = {}
for path in sorted(HERE.glob("calls-*.txt")):
    *kind, side, size = path.stem.split("-")[1:]
    for line in path.read_text().splitlines():
        found = re.match(r"(all_gather|reduce_scatter|all_reduce)\s+([\d.]+) Python calls", line)
        if found:
            key = ("-".join(kind) or "unregistered", size, found.group(1))
            calls.setdefault(key, {})[side] = float(found.group(2))
print(f"\n{'buffers':13s} {'size':5s} {'collective':15s} {'calls before':>12s} {'calls after':>11s}")
for row in summary:
    counted = calls.get((row["buffers"], row["size"], row["collective"]))
    if counted:
        row["calls_before"], row["calls_after"] = counted["before"], counted["after"]
        print(f"{row['buffers']:13s} {row['size']:5s} {row['collective']:15s} "
              f"{counted['before']:12.1f} {counted['after']:11.1f}")
(HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
