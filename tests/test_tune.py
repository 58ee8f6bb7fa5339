"""python -m hoccl.tune on the host backend: the table it writes parses, covers every
size it measured, is what init loads from HOCCL_TUNING_FILE, and keeps every collective
exact on the paths it chose; a wrong candidate is never chosen; a damaged table or one
of another machine is refused or logged, never followed; the same under mpiexec."""

import json
import logging
import os
import re
import subprocess
import sys
import types

import pytest

import hoccl
import hoccl._progress
from hoccl import InvalidArgumentError, tune, tuning
from hoccl.bench._harness import Ranks
from hoccl.sched.select import MACHINE_KEYS, Table, TableError, choose, size_of
from hoccl.testing import FAULTS, ArrayModule, PlantedFault, check_collective

from test_mpi import MPI_ENV, _mpiexec

RANKS = 3
COLLECTIVES = tune.COLLECTIVES


def _measured_sizes(collective, max_bytes, ranks=RANKS):
    """The sizes the tuner measures (its nominal sizes rounded to whole blocks)."""
    return [size_of(tune.shape_at(collective, size, ranks, "float32", 4))
            for size in tune.sizes_between(4 << 10, max_bytes, 4)]


def _tune(*args, env=None, launcher=()):
    command = [*launcher, sys.executable, "-m", "hoccl.tune", "--backend", "host", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, **MPI_ENV, **(env or {})})
    return result.returncode, result.stdout + result.stderr


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A table tuned on 3 host ranks up to 64 KiB, and what the tuner printed."""
    path = tmp_path_factory.mktemp("tune") / "table.json"
    returncode, output = _tune("--local", str(RANKS), "--max-bytes", "64K", "--budget", "20",
                               "--output", str(path))
    assert returncode == 0, output[-4000:]
    return path, output


def _assert_covers(table, max_bytes, ranks=RANKS, traits=(), collectives=COLLECTIVES):
    """Rows of ``traits`` cover every measured size of ``collectives``, contiguously."""
    for collective in collectives:
        rows = sorted((row for row in table.rows
                       if row.collective == collective and row.traits == traits),
                      key=lambda row: row.min_bytes)
        assert rows and rows[0].min_bytes == 0, (collective, rows)
        for first, second in zip(rows, rows[1:]):
            assert second.min_bytes == first.max_bytes + 1, (collective, first, second)
        for size in _measured_sizes(collective, max_bytes, ranks):
            assert table.row_for(collective, size, traits=dict(traits)) is not None, (
                collective, size)
        for row in rows:
            assert "python -m hoccl.tune" in row.source and hoccl.__version__ in row.source


def test_the_tuned_table_parses_and_covers_every_measured_size(tuned):
    path, output = tuned
    table = Table.from_json(path.read_text(), str(path))
    machine = dict(table.machine)
    assert tuple(machine) == MACHINE_KEYS
    assert {key: machine[key] for key in ("backend", "gpu", "world_size", "ranks_per_gpu",
                                          "hoccl")} == {
        "backend": "host", "gpu": "host", "world_size": RANKS, "ranks_per_gpu": 1,
        "hoccl": hoccl.__version__}
    _assert_covers(table, 64 << 10)
    assert f"rows written to {path}" in output
    assert re.search(r"100%\|[^|]*\| (\d+)/\1\b", output), output[-2000:]  # the bar's end
    assert output.index(f"the table goes to {path}") < output.index("all_gather")


def test_init_loads_the_tuned_table_and_every_collective_stays_exact(tuned, monkeypatch):
    path, _ = tuned
    table = Table.from_json(path.read_text(), str(path))
    monkeypatch.setenv("HOCCL_TUNING_FILE", str(path))
    comms = hoccl.init_local(RANKS, backend="host")
    try:
        assert comms[0].tuning is not None and comms[0].tuning.rows == table.rows
        assert all(comm.tuning.rows == table.rows for comm in comms)
        seed = 0
        for collective in COLLECTIVES:
            blocks = RANKS if collective in ("all_gather", "reduce_scatter", "all_to_all") else 1
            for size in _measured_sizes(collective, 64 << 10):
                index, row = table.row_for(collective, size)
                explained = comms[0].explain(collective, size)
                assert explained["table"] == str(path) and explained["row"] == index
                assert explained["path"] == row.path, (collective, size, explained)
                # the measured size, and one just below it (another count, the same row)
                for count in (size // 4 // blocks, size // 4 // blocks - 1):
                    for dtype in ("float32", "int32"):
                        seed += 1
                        check_collective(comms, collective, count=count, dtype=dtype,
                                         seed=seed)
    finally:
        for comm in comms:
            comm.close()


def test_a_damaged_tuning_file_is_refused_with_a_clear_error(tuned, tmp_path, monkeypatch):
    path, _ = tuned
    cut = tmp_path / "cut.json"
    cut.write_text(path.read_text()[:200])
    data = json.loads(path.read_text())
    data["rows"][0]["max_bytes"] = data["rows"][0]["min_bytes"] - 1  # an empty range
    bad_row = tmp_path / "bad_row.json"
    bad_row.write_text(json.dumps(data))
    for broken, says in ((cut, "not JSON"), (bad_row, "row 0")):
        with pytest.raises(TableError, match=says):
            Table.from_json(broken.read_text(), str(broken))
        monkeypatch.setenv("HOCCL_TUNING_FILE", str(broken))
        with pytest.raises(InvalidArgumentError, match=f"HOCCL_TUNING_FILE={broken}.*{says}"):
            hoccl.init_local(RANKS, backend="host")


def test_a_table_of_another_machine_is_logged_and_the_defaults_stay_exact(
        tuned, tmp_path, monkeypatch, caplog):
    path, _ = tuned
    data = json.loads(path.read_text())
    data["machine"]["world_size"] = RANKS + 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    monkeypatch.setenv("HOCCL_TUNING_FILE", str(other))
    with caplog.at_level(logging.WARNING, logger="hoccl"):
        comms = hoccl.init_local(RANKS, backend="host")
    try:
        assert "another machine" in caplog.text and "world_size" in caplog.text
        assert comms[0].tuning is None
        assert comms[0].explain("all_reduce", 4096)["table"] == "defaults"
        for seed, collective in enumerate(COLLECTIVES):
            check_collective(comms, collective, count=1000, dtype="float32", seed=seed)
    finally:
        for comm in comms:
            comm.close()


def test_a_damaged_table_in_the_cache_is_passed_over(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("HOCCL_TUNING_FILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probe = hoccl.init_local(RANKS, backend="host")
    machine = tune.machine_of(Ranks(probe, RANKS))
    for comm in probe:
        comm.close()
    cached = tuning.cache_dir() / tuning.table_name(machine)
    cached.parent.mkdir(parents=True)
    cached.write_text('{"format": "hoccl-tuning", "version": 1, "rows": [')
    with caplog.at_level(logging.WARNING, logger="hoccl"):
        comms = hoccl.init_local(RANKS, backend="host")
    try:
        assert str(cached) in caplog.text and "passed over" in caplog.text
        assert comms[0].tuning is None
        check_collective(comms, "all_reduce", count=1000, dtype="float32", seed=1)
    finally:
        for comm in comms:
            comm.close()


def test_the_tuner_writes_to_the_cache_by_default_and_init_finds_it(tmp_path, monkeypatch):
    monkeypatch.delenv("HOCCL_TUNING_FILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = ["--local", "2", "--backend", "host", "--collectives", "all_gather",
            "--max-bytes", "4K", "--samples", "1"]
    assert tune.main(argv) == 0
    comms = hoccl.init_local(2, backend="host")
    try:
        assert comms[0].tuning is not None
        assert comms[0].explain("all_gather", 4096)["table"].startswith(
            str(tmp_path / "hoccl" / "tuning"))
    finally:
        for comm in comms:
            comm.close()


@pytest.mark.parametrize("fault", FAULTS)
def test_a_wrong_candidate_is_never_chosen(tmp_path, capsys, fault):
    """Every output corrupted after the call (PlantedFault): every candidate is wrong,
    none becomes a row, and the tuner says so and exits with status 2."""
    output = tmp_path / "table.json"
    arrays = PlantedFault(ArrayModule("numpy"), fault, block=1)
    argv = ["--local", "2", "--backend", "host", "--collectives", "all_reduce,all_gather",
            "--max-bytes", "4K", "--samples", "1", "--output", str(output)]
    assert tune.main(argv, arrays=arrays) == 2
    printed = capsys.readouterr()
    assert "WRONG, not chosen" in printed.err
    assert Table.from_json(output.read_text()).rows == ()


def test_sizes_past_the_budget_are_skipped_and_left_to_the_defaults(tmp_path, capsys):
    output = tmp_path / "table.json"
    argv = ["--local", "2", "--backend", "host", "--collectives", "broadcast",
            "--max-bytes", "64K", "--budget", "0.001", "--samples", "1",
            "--output", str(output)]
    assert tune.main(argv) == 0
    assert "broadcast from 16K up skipped" in capsys.readouterr().err
    table = Table.from_json(output.read_text())
    assert "skipped by the budget" in table.note and "broadcast from 16K" in table.note
    assert table.row_for("broadcast", 4096) is not None
    assert table.row_for("broadcast", 16 << 10) is None  # the defaults


def test_the_budget_is_kept_candidate_by_candidate(tmp_path, monkeypatch, capsys):
    """Measurements take 0.1 s of a planted clock up to 16 KiB and 2 s above, more than
    the smaller sizes predict: the tuner starts no candidate that would end past the
    budget, and leaves the size it could not finish to the defaults."""
    clock = [0.0]
    planted = types.SimpleNamespace(monotonic=lambda: clock[0])
    monkeypatch.setattr(tune, "time", planted)  # the tuner's clock and its bar's, only
    monkeypatch.setattr(hoccl._progress, "time", planted)

    def measure(ranks, args, shape, candidate, *rest, **options):
        clock[0] += 0.1 if size_of(shape) <= 16 << 10 else 2.0
        return tune.Measurement(shape.collective, size_of(shape), candidate, 1e-3,
                                shape=shape)
    monkeypatch.setattr(tune, "measure", measure)
    output = tmp_path / "table.json"
    argv = ["--local", "2", "--backend", "host", "--collectives", "all_reduce",
            "--max-bytes", "1M", "--budget", "10", "--output", str(output)]
    assert tune.main(argv) == 0
    assert 8.0 < clock[0] <= 10.0
    err = capsys.readouterr().err
    assert "all_reduce from 64K up skipped: its candidates would pass the budget" in err
    table = Table.from_json(output.read_text())
    assert table.row_for("all_reduce", 16 << 10) is not None
    assert table.row_for("all_reduce", 64 << 10) is None


def _found(path, size, seconds=1.0, chunk=None):
    return tune.Measurement("all_reduce", size, tune.Candidate(path, chunk), seconds)


def test_rows_merge_equal_neighbours_and_cover_the_sizes_contiguously():
    chosen = [(4096, _found("direct", 4096)), (16384, _found("direct", 16384)),
              (65536, _found("pull", 65536)), (262144, _found("push", 262144, chunk=65536))]
    rows = tune.rows_of("all_reduce", chosen, complete=True, run="run")
    assert [(row.min_bytes, row.max_bytes, row.path) for row in rows] == [
        (0, 32768, "direct"), (32769, 131072, "pull"), (131073, 1 << 62, "push")]
    assert rows[2].settings == (("chunk_bytes", 65536),)
    assert rows[0].source == "run: measured at 4K, 16K"
    # a sweep the budget cut ends at its last size; so does a direct kernel at the end
    cut = tune.rows_of("all_reduce", chosen[:3], complete=False, run="run")
    assert cut[-1].max_bytes == 65536
    direct = tune.rows_of("all_reduce", chosen[:2], complete=True, run="run")
    assert direct[-1].max_bytes == 16384


def test_winners_are_the_fastest_correct_candidates():
    measured = [_found("push", 4096, 3.0), _found("pull", 4096, 1.0),
                tune.Measurement("all_reduce", 4096, tune.Candidate("direct"), None, "wrong",
                                 "planted")]
    assert [(size, found.candidate.path) for size, found in tune.winners(measured)] == [
        (4096, "pull")]


def test_close_candidates_are_timed_again_in_turn_and_their_median_counts():
    """push 1.00 and pull 1.04 at one size are within CLOSE: both are timed twice more,
    alternately, and pull's later timings (0.90, 0.91) make it the winner; broadcast's
    one candidate and a far one (3.0) are not timed again."""
    push, pull, far = (_found("push", 1 << 20, 1.00), _found("pull", 1 << 20, 1.04),
                       _found("push", 1 << 20, 3.0, chunk=65536))
    alone = tune.Measurement("broadcast", 1 << 20, tune.Candidate("push"), 1.0)
    for one in (push, pull, far, alone):
        one.rounds, one.spent = (one.seconds,), 0.5
    later = {"push": [1.02, 1.01], "pull": [0.90, 0.91]}
    order = []

    def again(one):
        order.append(one.candidate.path)
        return tune.Measurement(one.collective, one.size, one.candidate,
                                later[one.candidate.path].pop(0))
    results = {"all_reduce": [push, pull, far], "broadcast": [alone]}
    assert tune.winners(results["all_reduce"])[0][1] is push
    assert tune.refine(results, again, lambda predicted: True) == 4
    assert order == ["push", "pull", "push", "pull"]
    assert (push.rounds, pull.rounds, far.rounds) == ((1.0, 1.02, 1.01), (1.04, 0.90, 0.91),
                                                      (3.0,))
    assert (push.seconds, pull.seconds) == (1.01, 0.91)
    assert tune.winners(results["all_reduce"])[0][1] is pull


def test_refining_stops_at_the_budget_and_drops_a_candidate_found_wrong():
    push, pull = _found("push", 4096, 1.00), _found("pull", 4096, 1.01)
    for one in (push, pull):
        one.rounds, one.spent = (one.seconds,), 1.0
    left = [True, True, False]

    def wrong_pull(one):
        if one.candidate.path == "pull":
            return tune.Measurement(one.collective, one.size, one.candidate, None, "wrong",
                                    "planted")
        return tune.Measurement(one.collective, one.size, one.candidate, 1.5)
    assert tune.refine({"all_reduce": [push, pull]}, wrong_pull,
                       lambda predicted: left.pop(0)) == 2
    assert (pull.seconds, pull.verdict) == (None, "wrong")
    assert push.rounds == (1.0, 1.5)  # the second round found one candidate: no more
    assert [found.candidate.path for _, found in tune.winners([push, pull])] == ["push"]
    late = [_found("push", 4096, 1.00), _found("pull", 4096, 1.01)]
    for one in late:
        one.rounds = (one.seconds,)
    assert tune.refine({"all_reduce": late}, wrong_pull, lambda predicted: False) == 0
    assert [one.rounds for one in late] == [(1.0,), (1.01,)]


def test_a_chunk_of_its_own_must_win_by_the_margin():
    """A candidate that sets a chunk size of its own is chosen over the same path with the
    communicator's chunk only when it is more than MARGIN faster: on noise, the simpler."""
    near = [_found("pull", 1 << 20, 1.00), _found("pull", 1 << 20, 0.97, chunk=65536)]
    assert tune.winners(near)[0][1].candidate.chunk_bytes is None
    far = [_found("pull", 1 << 20, 1.00), _found("pull", 1 << 20, 0.90, chunk=65536)]
    assert tune.winners(far)[0][1].candidate.chunk_bytes == 65536
    paths = [_found("push", 1 << 20, 1.00), _found("pull", 1 << 20, 0.99)]
    assert tune.winners(paths)[0][1].candidate.path == "pull"  # equal settings: the fastest


@pytest.mark.parametrize("faster, chosen", [(0.97, None), (0.94, 1 << 18)])
def test_the_margin_holds_for_the_candidates_the_tuner_makes(faster, chosen):
    """The tuner's own candidates: the communicator's chunk is the candidate of no
    setting, so a chunk of its own (and an SM cap) must win by MARGIN over it."""
    made = tune.candidates_at("reduce_scatter", 2, 1 << 20, 32 << 20, sms=(32,))
    assert [c for c in made if c.path == "pull"][0] == tune.Candidate("pull")
    measured = [tune.Measurement("reduce_scatter", 1 << 20, c,
                                 1.0 if c.chunk_bytes is None else faster)
                for c in made if c.path == "pull"]
    assert tune.winners(measured)[0][1].candidate == tune.Candidate("pull", chosen)
    assert 1 - faster > tune.MARGIN if chosen else 1 - faster < tune.MARGIN


def test_candidates_are_the_selectors_paths_and_a_few_chunks():
    at_64k = tune.candidates_at("all_reduce", 2, 64 << 10, 32 << 20)
    assert [(c.path, c.chunk_bytes) for c in at_64k] == [
        ("push", None), ("push", 16 << 10), ("push", 4 << 10), ("pull", None),
        ("pull", 16 << 10), ("pull", 4 << 10), ("one_shot", None), ("direct", None)]
    assert [c.path for c in tune.candidates_at("all_gather", 9, 1 << 20, 32 << 20)] == ["push"]
    capped = tune.candidates_at("reduce_scatter", 2, 4 << 10, 32 << 20, sms=(32,))
    assert [(c.path, c.max_sms) for c in capped] == [
        ("push", None), ("push", 32), ("pull", None), ("pull", 32), ("direct", None)]


def test_ranks_sharing_a_gpu_time_no_direct_kernel():
    """A direct kernel spins through its context's time slice while a peer on the same GPU
    waits: the tuner leaves it out there, as the model does."""
    from hoccl.sched._path_model import excluded_paths
    shared, alone = {"ranks_per_gpu": 2}, {"ranks_per_gpu": 1}
    assert excluded_paths(shared) == ("direct",) and excluded_paths(alone) == ()
    for collective in ("all_gather", "all_reduce", "broadcast"):
        every = [c.path for c in tune.candidates_at(collective, 2, 16 << 10, 32 << 20)]
        kept = [c.path for c in tune.candidates_at(collective, 2, 16 << 10, 32 << 20,
                                                   excluded=excluded_paths(shared))]
        assert "direct" in every and "direct" not in kept
        assert kept == [path for path in every if path != "direct"]


def test_beside_compute_writes_rows_for_overlapped_calls_that_init_takes(tmp_path,
                                                                          monkeypatch):
    """--beside-compute on the host backend (a numpy matmul beside the calls): the table
    has the plain rows and, first, rows marked beside_compute for the reductions; init
    takes them; a call that says it runs apart from compute passes them over; every
    collective stays exact."""
    path = tmp_path / "table.json"
    returncode, output = _tune("--local", "2", "--beside-compute", "--max-bytes", "16K",
                               "--budget", "20", "--samples", "2", "--output", str(path))
    assert returncode == 0, output[-4000:]
    assert "the reductions beside a float32 numpy matmul" in output
    table = Table.from_json(path.read_text(), str(path))
    beside = [row for row in table.rows if dict(row.traits).get("beside_compute")]
    assert {row.collective for row in beside} == {"reduce_scatter", "all_reduce"}
    assert table.rows[:len(beside)] == tuple(beside)  # first: they win where they apply
    _assert_covers(table, 16 << 10, ranks=2)
    _assert_covers(table, 16 << 10, ranks=2, traits=tune.BESIDE,
                   collectives=("reduce_scatter", "all_reduce"))
    monkeypatch.setenv("HOCCL_TUNING_FILE", str(path))
    comms = hoccl.init_local(2, backend="host")
    try:
        assert comms[0].tuning.origin == str(path)
        for seed, collective in enumerate(COLLECTIVES):
            for count in (1, 700, 2048):
                shape = tune.shape_at(collective, count * 4 * 2, 2, "float32", 4)
                plain = choose(comms[0].tuning, shape, comms[0].options, beside_compute=False)
                taken = choose(comms[0].tuning, shape, comms[0].options)
                assert taken == choose(comms[0].tuning, shape, comms[0].options,
                                       beside_compute=True)
                row = comms[0].tuning.rows[taken.row]
                if collective in ("reduce_scatter", "all_reduce"):
                    assert row in beside and comms[0].tuning.rows[plain.row] not in beside
                else:
                    assert row not in beside and plain == taken
                check_collective(comms, collective, count=shape.count, dtype="float32",
                                 seed=seed * 10 + count)
    finally:
        for comm in comms:
            comm.close()


@pytest.mark.mpi
def test_the_tuner_under_mpiexec_and_a_check_of_its_table(tmp_path):
    path = tmp_path / "table.json"
    returncode, output = _tune("--max-bytes", "16K", "--budget", "20", "--samples", "2",
                               "--output", str(path), launcher=(_mpiexec(), "-n", str(RANKS)))
    assert returncode == 0, output[-4000:]
    table = Table.from_json(path.read_text(), str(path))
    _assert_covers(table, 16 << 10)
    assert "3 processes" in table.rows[0].source
    check = (
        "import sys, hoccl\n"
        "from hoccl.testing import check_collective\n"
        "comm = hoccl.init(backend='host')\n"
        "assert comm.tuning is not None and comm.tuning.origin == sys.argv[1], comm.tuning\n"
        "for seed, collective in enumerate(%r):\n"
        "    for count in (1000, 1366):\n"
        "        path = comm.explain(collective, count * 4 * (3 if collective in\n"
        "            ('all_gather', 'reduce_scatter', 'all_to_all') else 1))['path']\n"
        "        check_collective([comm], collective, count=count, dtype='float32', seed=seed)\n"
        "        print(comm.rank, collective, count, path, 'exact', flush=True)\n"
        "comm.close()\n" % (COLLECTIVES,))
    result = subprocess.run([_mpiexec(), "-n", str(RANKS), sys.executable, "-c", check, str(path)],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, **MPI_ENV, "HOCCL_TUNING_FILE": str(path)})
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert result.stdout.count("exact") == RANKS * len(COLLECTIVES) * 2


def test_the_shipped_tables_parse_and_name_the_runs_they_come_from():
    from pathlib import Path
    shipped = sorted(tuning.SHIPPED.glob("*.json"))
    assert shipped, f"no table in {tuning.SHIPPED}"
    root = Path(__file__).resolve().parent.parent
    for path in shipped:
        table = Table.from_json(path.read_text(), str(path))
        assert table.rows and table.note
        for row in table.rows:
            named = row.source.split(" ")[0]
            assert (root / named).is_file() and "commit " in row.source, row.source
    h200 = Table.from_json((tuning.SHIPPED / "h200x2.json").read_text())
    machine = dict(h200.machine)
    assert {key: machine[key] for key in ("backend", "gpu", "world_size", "ranks_per_gpu",
                                          "link", "hoccl")} == {
        "backend": "cuda", "gpu": "NVIDIA H200", "world_size": 2, "ranks_per_gpu": 1,
        "link": "nvlink", "hoccl": hoccl.__version__}
