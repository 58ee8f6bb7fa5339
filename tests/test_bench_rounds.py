"""python -m hoccl.bench in rounds, on the host backend (no GPU): with --rounds R every
library's loop is timed R times, the libraries in turn at each size, and each record's
time is the median of its rounds; results are checked in the first round, and a library
that fails there is recorded once and timed no more.  The printed lines stay readable by
tools/criteria.py.  No timing is asserted."""

import importlib.util
import statistics
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hoccl.bench import __main__ as bench  # noqa: E402

_SPEC = importlib.util.spec_from_file_location(
    "criteria", Path(__file__).resolve().parent.parent / "tools" / "criteria.py")
criteria = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(criteria)

LIBRARIES = ("hoccl", "hoccl-auto")
SIZES = (1 << 10, 4 << 10)


def _sweep(*options):
    args = bench.arguments(["--backend", "host", "--local", "2", "--collectives", "all_reduce",
                            "--libraries", ",".join(LIBRARIES), "--time-budget", "0.001",
                            "--warmup", "0", *options])
    result, leader = bench.sweep(args)
    assert leader and result["backend"] == "host"
    return result["records"]


def _timed_loops(monkeypatch):
    """Every timed loop's (library, µs) in the order they ran, leaving out the probe that
    sizes a loop (3 calls)."""
    loops = []

    def time_loop(library, ranks, collective, buffers, iters, warmup, stream_of):
        micros = real(library, ranks, collective, buffers, iters, warmup, stream_of)
        if iters != 3:
            loops.append((library.name, micros))
        return micros
    real = bench.time_loop
    monkeypatch.setattr(bench, "time_loop", time_loop)
    return loops


def test_two_rounds_time_the_libraries_in_turn_and_record_the_median(monkeypatch, capsys,
                                                                      tmp_path):
    loops = _timed_loops(monkeypatch)
    records = _sweep("--rounds", "2", "--sizes", ",".join(map(str, SIZES)))
    points = [(form, nbytes) for form in ("out", "in") for nbytes in SIZES]
    assert [name for name, _ in loops] == list(LIBRARIES) * 2 * len(points)
    assert [(r["form"], r["bytes"], r["library"]) for r in records] == [
        (form, nbytes, name) for form, nbytes in points for name in LIBRARIES]
    for index, record in enumerate(records):
        point, library = divmod(index, len(LIBRARIES))
        first, second = (loops[len(LIBRARIES) * (2 * point + round_index) + library][1]
                         for round_index in range(2))
        assert record["rounds_us"] == [first, second], record
        assert record["time_us"] == statistics.median(record["rounds_us"]), record
        assert record["algbw"] == pytest.approx(record["bytes"] / record["time_us"] / 1e3)
        assert record["wrong"] == 0, record
    # the printed lines give criteria.py the same records when the JSON is missing
    log = tmp_path / "bench-auto.log"
    log.write_text(capsys.readouterr().out)
    printed = criteria.bench_log_records(str(log))
    assert [(r["form"], r["bytes"], r["library"]) for r in printed] == [
        (r["form"], r["bytes"], r["library"]) for r in records]
    for line, record in zip(printed, records):
        assert line["time_us"] == pytest.approx(record["time_us"], abs=0.05)
        assert line["rounds_us"] == pytest.approx(record["rounds_us"], abs=0.05)


def test_a_library_that_fails_its_check_is_recorded_once_and_not_timed(monkeypatch):
    loops = _timed_loops(monkeypatch)
    check = bench.count_wrong

    def count_wrong(library, *args, **kwargs):
        if library.name == "hoccl-auto":
            raise RuntimeError("cannot run this size")
        return check(library, *args, **kwargs)
    monkeypatch.setattr(bench, "count_wrong", count_wrong)
    records = _sweep("--rounds", "3", "--sizes", "1K", "--forms", "out")
    assert [name for name, _ in loops] == ["hoccl"] * 3
    failed, timed = records
    assert failed == dict(collective="all_reduce", form="out", bytes=1 << 10,
                          library="hoccl-auto", error="cannot run this size")
    assert timed["library"] == "hoccl" and timed["wrong"] == 0
    assert timed["rounds_us"] == [micros for _, micros in loops]
    assert timed["time_us"] == sorted(timed["rounds_us"])[1]


@pytest.mark.parametrize("options, words", [(["--rounds", "0"], "--rounds must be at least 1"),
                                            (["--backend", "host", "--graph"],
                                             "--graph needs the cuda backend")])
def test_the_options_refuse_no_rounds_and_graphs_without_the_cuda_backend(options, words,
                                                                           capsys):
    with pytest.raises(SystemExit):
        bench.arguments(options)
    assert words in capsys.readouterr().err
