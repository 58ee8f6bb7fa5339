"""``python -m hoccl.bench.host_cost`` on the host backend: one row per variant and
collective with its figures, in the table and the JSON (the figures themselves are the
device machine's to measure; here the program is checked, not timed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])


def test_host_cost_benchmark_writes_a_row_per_variant_and_collective(tmp_path):
    out = tmp_path / "host_cost"
    result = subprocess.run(
        [sys.executable, "-m", "hoccl.bench.host_cost", "--backend", "host", "--size", "64K",
         "--burst", "4", "--bursts", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((out / "host_cost.json").read_text())
    got = {(row["variant"], row["collective"]) for row in data["rows"]}
    assert got == {(variant, collective) for variant in ("hoccl-registered", "hoccl-plain")
                   for collective in ("all_gather", "all_reduce", "reduce_scatter")}, got
    for row in data["rows"]:
        assert row["world"] == 1 and row["min_us"] <= row["us_per_call"], row
        assert row["us_per_call"] > 0 and row["cpu_us_per_call"] > 0, row
    table = (out / "host_cost.md").read_text()
    assert table.count("| hoccl-") == 6 and "µs/call" in table, table


def test_host_cost_benchmark_refuses_bad_arguments():
    result = subprocess.run(
        [sys.executable, "-m", "hoccl.bench.host_cost", "--backend", "host",
         "--collectives", "all_gather,alltoall"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 2 and "unknown ['alltoall']" in result.stderr, result.stderr
