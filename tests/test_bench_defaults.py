"""python -m hoccl.bench as a user first runs it, on the host backend (no GPU): defaults
chosen per backend, results written after every size (a run stopped halfway leaves its
JSON and table), a progress bar, and one line saying how to get the plots.  Sizes and
counts are asserted, never timings."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hoccl.bench import __main__ as bench  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HOST = ["--local", "2", "--backend", "host"]
TINY = [*HOST, "--collectives", "all_reduce", "--max-bytes", "16K", "--time-budget", "0.001",
        "--warmup", "0"]


def test_the_host_backend_defaults_to_hoccl_alone_up_to_4_mib():
    args = bench.arguments(HOST)
    assert args.libraries == "hoccl"
    sizes = bench.sizes_of(args)
    assert sizes[0] == 1 << 10 and sizes[-1] == 4 << 20 and len(sizes) == 7
    forms = sum(len(forms) for forms in bench.FORMS.values())
    assert len(bench.points_of(args)) == forms * len(sizes) == 70


def test_the_cuda_backend_keeps_every_library_up_to_1_gib():
    args = bench.arguments(["--local", "2"])
    assert {"hoccl-peer", "hoccl+max_sms=32", "nccl", "nccl-zero"} <= set(args.libraries.split(","))
    assert bench.sizes_of(args)[-1] == 1 << 30


def test_given_options_override_the_backend_defaults():
    args = bench.arguments([*HOST, "--libraries", "hoccl,hoccl-auto", "--max-bytes", "64KiB"])
    assert args.libraries == "hoccl,hoccl-auto" and bench.sizes_of(args)[-1] == 64 << 10


def test_a_run_stopped_halfway_leaves_its_json_and_table(monkeypatch, tmp_path):
    real, calls = bench.measure, []

    def measure(*args, **kwargs):
        calls.append(args[5])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(bench, "measure", measure)
    with pytest.raises(SystemExit, match="stopped; what was measured is in"):
        bench.main([*TINY, "--forms", "out", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["collective"], r["bytes"], r["wrong"]) for r in result["records"]] == [
        ("all_reduce", 1 << 10, 0), ("all_reduce", 4 << 10, 0)]
    rows = [line for line in (tmp_path / "bench.md").read_text().splitlines()
            if line.startswith("| 1K") or line.startswith("| 4K") or line.startswith("| 16K")]
    assert [row.split(" | ")[0] for row in rows] == ["| 1K", "| 4K"]
    assert not list(tmp_path.glob("*.part"))


def test_without_matplotlib_one_line_says_how_to_get_the_plots(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    bench.main([*TINY, "--sizes", "1K", "--out", str(tmp_path)])
    printed = capsys.readouterr().out.replace(str(tmp_path), "OUT").splitlines()
    about_plots = [line for line in printed if "plot" in line]
    assert about_plots == ["# plots skipped: matplotlib is not installed "
                           "(pip install 'hoccl[bench]')"]
    assert printed[0] == "# hoccl.bench: 2 sizes to measure; JSON and table go to OUT/ as they come"
    assert len(json.loads((tmp_path / "bench.json").read_text())["records"]) == 2


def test_the_command_with_no_option_measures_every_size_and_writes_its_files(tmp_path):
    """The README's benchmark command on the host backend, as a user runs it: 70 sizes,
    every result checked, the JSON and table written, a progress bar on stderr."""
    result = subprocess.run([sys.executable, "-m", "hoccl.bench", *HOST], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    records = json.loads((tmp_path / "results" / "bench" / "bench.json").read_text())["records"]
    assert len(records) == 70 and {r["library"] for r in records} == {"hoccl"}
    assert max(r["bytes"] for r in records) == 4 << 20
    assert all(r["wrong"] == 0 for r in records), [r for r in records if r["wrong"]]
    assert (tmp_path / "results" / "bench" / "bench.md").read_text().count("\n## ") == 10
    assert "70/70" in result.stderr


def test_a_missing_package_is_named_in_one_line_with_how_to_install_it():
    from hoccl.bench._harness import require_installed
    require_installed("python -m hoccl.tune", ("tqdm", "humanfriendly"))  # both installed
    with pytest.raises(SystemExit) as stopped:
        require_installed("python -m hoccl.tune", ("tqdm", "hoccl_no_such_package", "torch"))
    expected = "python -m hoccl.tune: needs hoccl_no_such_package; install them with pip " \
               "install hoccl_no_such_package"
    assert str(stopped.value) == expected


@pytest.mark.mpi
@pytest.mark.parametrize("local_size", [1, 2])
def test_across_hosts_every_call_runs_beside_gloo_and_is_checked(tmp_path, local_size):
    """Simulated hosts under mpiexec (2 ranks a host apart, or 4 ranks as 2 hosts of 2):
    the defaults add gloo on the same tensors; sendrecv crosses hosts; every record
    checked, none wrong, and the table has the hoccl / gloo column."""
    from test_torch import launch
    ranks = 2 * local_size
    code, output = launch(ranks, "-m", "hoccl.bench", "--backend", "host", "--collectives",
                          "sendrecv,all_reduce,all_gather", "--sizes", "1K,64K",
                          "--time-budget", "0.001", "--warmup", "0", "--out", tmp_path,
                          env={"HOCCL_LOCAL_SIZE": str(local_size)}, timeout=300)
    assert code == 0, output[-6000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["world_size"] == ranks and result["local_size"] == local_size
    records = result["records"]
    for record in records:
        assert "error" not in record and record["wrong"] == 0, record
    measured = {(r["collective"], r["form"], r["bytes"], r["library"]) for r in records}
    for nbytes in (1 << 10, 64 << 10):
        assert {("sendrecv", "out", nbytes, "hoccl"), ("sendrecv", "out", nbytes, "gloo"),
                ("all_reduce", "in", nbytes, "gloo"), ("all_gather", "out", nbytes, "gloo"),
                ("all_reduce", "out", nbytes, "hoccl")} <= measured
    table = (tmp_path / "bench.md").read_text()
    assert "## sendrecv (out-of-place)" in table and "hoccl / gloo |" in table


def test_a_sendrecv_pairs_the_same_local_rank_on_neighbouring_hosts():
    from hoccl.bench._harness import Ranks
    across = Ranks([], 6, None, [], "host", local_size=2)
    assert [across.pair(rank) for rank in range(6)] == [
        (2, 4), (3, 5), (4, 0), (5, 1), (0, 2), (1, 3)]
    flat = Ranks([], 3, None, [], "host", local_size=3)
    assert [flat.pair(rank) for rank in range(3)] == [(1, 2), (2, 0), (0, 1)]
