"""The mixed-job benchmark (``python -m hoccl.bench.mixed``): its smoke run under
``mpiexec -n 4`` on CPUs (two simulated hosts, tiny sizes) writes results of the expected
structure, every one checked against numpy with no wrong element; its checker counts a
planted fault; its ratios are what the records say.  No timing is asserted."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from test_torch import launch  # noqa: E402

from hoccl.bench.mixed import expected, pattern, ratios, wrong_elements  # noqa: E402


@pytest.mark.mpi
def test_the_smoke_run_checks_every_result_against_numpy_and_writes_its_files(tmp_path):
    code, output = launch(4, "-m", "hoccl.bench.mixed", "--devices", "cpu", "--local-size",
                          "2", "--sizes", "16K,64K", "--phase-bytes", "64K", "--phase-chunk", "16K",
                          "--iters", "1",
                          "--warmup", "0", "--out", tmp_path, timeout=300)
    assert code == 0, output[-6000:]
    result = json.loads((tmp_path / "mixed.json").read_text())
    assert result["world_size"] == 4 and result["devices"] == ["cpu"] * 4
    assert result["local_size"] == 2 and len(result["engines"]) == 4
    assert result["phase_chunk"] == 16 << 10  # the pipelined all_reduce has 4 chunks
    records = result["records"]
    assert {(r["collective"], r["bytes"], r["library"]) for r in records} == {
        (collective, size, library) for collective in ("all_reduce", "all_gather", "sendrecv")
        for size in (16 << 10, 64 << 10) for library in ("hoccl", "gloo")}
    for record in records:
        assert "error" not in record, record
        assert record["checked"] == "numpy" and record["wrong"] == 0, record
        assert record["time_us"] > 0 and record["busbw"] > 0, record
    study = {r["library"]: r for r in result["phases"]}
    assert {"hoccl pipelined", "hoccl sequential"} <= set(study)
    for name in ("hoccl pipelined", "hoccl sequential"):
        assert study[name]["checked"] == "numpy" and study[name]["wrong"] == 0, study[name]
    assert {name for name in study if name.startswith("phase ")} == {
        "phase host reduce_scatter", "phase rail all_reduce", "phase host all_gather"}
    assert set(result["ratios"]["all_reduce phases"]) == {
        "pipelined / slowest phase alone", "sequential / pipelined"}
    text = (tmp_path / "mixed.md").read_text()
    assert "pipelined / slowest phase alone" in text and "hoccl / gloo busbw" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "mixed.png").stat().st_size > 0


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "sendrecv"])
def test_the_checker_counts_a_flipped_bit_and_an_unwritten_element(collective):
    want = expected(collective, 3, 101, "float32", source=2)
    assert wrong_elements(want.copy(), want) == 0
    flipped = want.copy()
    flipped.view(np.uint32)[17] ^= 1
    assert wrong_elements(flipped, want) == 1
    unwritten = want.copy()
    unwritten[-5:] = np.nan
    assert wrong_elements(unwritten, want) == 5


def test_the_expected_results_are_numpys_sum_and_concatenation():
    inputs = [pattern(rank, 7, "float32") for rank in range(3)]
    assert np.array_equal(expected("all_reduce", 3, 7, "float32"), inputs[0] + inputs[1] + inputs[2])
    assert np.array_equal(expected("all_gather", 3, 7, "float32"), np.concatenate(inputs))
    assert np.array_equal(expected("sendrecv", 3, 7, "float32", source=1), inputs[1])


def test_a_sendrecv_crosses_to_the_next_host_and_back():
    from hoccl.bench.mixed import peers
    assert [peers(rank, 4, 2) for rank in range(4)] == [(2, 2), (3, 3), (0, 0), (1, 1)]
    assert [peers(rank, 6, 2) for rank in range(6)] == [(2, 4), (3, 5), (4, 0), (5, 1),
                                                        (0, 2), (1, 3)]


def test_the_ratios_are_the_records_quotients():
    def record(collective, library, nbytes, busbw):
        return dict(collective=collective, library=library, bytes=nbytes, busbw=busbw)
    result = {"records": [record("all_reduce", "hoccl", 64 << 20, 9.0),
                          record("all_reduce", "gloo", 64 << 20, 3.0),
                          record("all_reduce", "hoccl", 1 << 20, 5.0),
                          record("all_reduce", "gloo", 1 << 20, 1.0),
                          record("all_gather", "hoccl", 256 << 20, 4.0),
                          record("all_gather", "gloo", 256 << 20, 2.0),
                          record("sendrecv", "hoccl", 64 << 20, 6.0),
                          record("sendrecv", "gloo", 64 << 20, 1.5)],
              "phases": [dict(collective="all_reduce", library=name, time_us=micros)
                         for name, micros in (("hoccl pipelined", 110.0),
                                              ("hoccl sequential", 220.0),
                                              ("phase host reduce_scatter", 100.0),
                                              ("phase rail all_reduce", 50.0))]}
    found = ratios(result)
    assert found["hoccl busbw / gloo busbw"] == {"all_reduce": {"64M": 3.0},
                                                 "all_gather": {"256M": 2.0},
                                                 "sendrecv": {"64M": 4.0}}
    assert found["all_reduce phases"] == {"pipelined / slowest phase alone": 1.1,
                                          "sequential / pipelined": 2.0}


@pytest.mark.mpi
def test_several_engines_between_hosts_are_measured_on_the_same_tensors(tmp_path):
    """``--inter-host mpi,ucx``: one hoccl communicator per engine, each checked against
    numpy beside gloo ("hoccl" the first, "hoccl ucx" the second)."""
    pytest.importorskip("ucxx")
    code, output = launch(4, "-m", "hoccl.bench.mixed", "--devices", "cpu", "--local-size",
                          "2", "--sizes", "16K", "--phase-bytes", "16K", "--iters", "1",
                          "--warmup", "0", "--inter-host", "mpi,ucx", "--out", tmp_path,
                          timeout=300)
    assert code == 0, output[-6000:]
    result = json.loads((tmp_path / "mixed.json").read_text())
    records = result["records"]
    assert {(r["collective"], r["library"]) for r in records} == {
        (collective, library) for collective in ("all_reduce", "all_gather", "sendrecv")
        for library in ("hoccl", "hoccl ucx", "gloo")}
    for record in records:
        assert "error" not in record and record["wrong"] == 0, record
    assert any("mpi" in engine for engine in result["engines"]), result["engines"]
