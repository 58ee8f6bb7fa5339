"""The cost model an unmeasured cuda machine takes its paths from (hoccl.sched._path_model,
pure): the direct kernels and the one-shot all_reduce at small sizes, copy engines at
large ones; its table is a valid selector table; the host backend keeps its defaults;
init_local on the host backend, given the model's table, names "model" in explain and
keeps every collective exact on the model's paths."""

import logging

import numpy as np
import pytest

import hoccl
from hoccl import tuning
from hoccl.sched import Options, Shape
from hoccl.sched._path_model import NVLINK, costs, model_table
from hoccl.sched.select import ANY_SIZE, MACHINE_KEYS, Table, choose
from hoccl.testing import check_collective

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


def _machine(backend="cuda", world_size=2, ranks_per_gpu=1, link="nvlink"):
    return {"backend": backend, "gpu": "NVIDIA Z100", "world_size": world_size,
            "ranks_per_gpu": ranks_per_gpu, "link": link, "links": world_size - 1,
            "driver": "99000", "hoccl": hoccl.__version__}


def _path(table, collective, nbytes, world_size=2):
    blocks = world_size if collective in ("all_gather", "reduce_scatter", "all_to_all") else 1
    shape = Shape(collective, world_size, nbytes // 4 // blocks, "float32", 4)
    return choose(table, shape, Options()).path


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_small_calls_take_a_kernel_or_one_shot_and_large_ones_copy_engines(world_size):
    table = model_table(_machine(world_size=world_size))
    for collective in COLLECTIVES:
        assert _path(table, collective, 8 << 10, world_size) == "direct", collective
        assert _path(table, collective, 1 << 30, world_size) == "push", collective
        assert _path(table, collective, 64 << 30, world_size) == "push", collective
    if world_size == 2:  # past the direct kernels' measured sizes: one shot
        assert _path(table, "all_reduce", 4 << 20) == "one_shot"


def test_the_cheapest_path_wins_by_the_constants():
    # 4 KiB: the direct kernel's latency is the smallest
    small = costs("all_reduce", 4096, 2, NVLINK)
    assert min(small, key=small.get) == "direct" and set(small) == {
        "push", "pull", "one_shot", "direct"}
    # 1 GiB: only the copy engines were measured there
    assert set(costs("all_reduce", 1 << 30, 2, NVLINK)) == {"push"}
    middle = costs("reduce_scatter", 4 << 20, 2, NVLINK)
    assert min(middle, key=middle.get) == "pull" and "direct" not in middle


def test_the_models_table_passes_the_selectors_checks_and_covers_every_size():
    for machine in (_machine(), _machine(world_size=8), _machine(ranks_per_gpu=2,
                                                                  link="shared-gpu"),
                    _machine(link="pcie")):
        table = model_table(machine)
        assert table.origin == "model" and table.mismatch(machine) is None
        again = Table.from_json(table.to_json(), "model")
        assert again == table
        for collective in COLLECTIVES:
            rows = [row for row in table.rows if row.collective == collective]
            assert rows[0].min_bytes == 0 and rows[-1].max_bytes == ANY_SIZE
            assert all(second.min_bytes == first.max_bytes + 1
                       for first, second in zip(rows, rows[1:]))
            assert all(row.source.startswith("model (") for row in rows)


def test_what_the_machine_changes():
    shared = model_table(_machine(ranks_per_gpu=2, link="shared-gpu"))
    assert "direct" not in {row.path for row in shared.rows}   # kernels spin on a shared GPU
    assert _path(shared, "all_reduce", 8 << 10) == "one_shot"
    pcie = model_table(_machine(link="pcie"))
    assert {row.path for row in pcie.rows} == {"push"}        # only copy engines measured
    assert model_table(_machine(backend="host")) is None      # the host keeps its defaults


def test_load_table_gives_an_unknown_cuda_machine_the_model_and_says_so_once(
        tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("HOCCL_TUNING_FILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="hoccl"):
        table, origin = tuning.load_table(_machine(), "init")
    assert origin == "model" and table == model_table(_machine())
    said = [record for record in caplog.records if "cost model" in record.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "gpu=NVIDIA Z100" in said[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hoccl"):
        assert tuning.load_table(_machine(backend="host"), "init") == (None, "defaults")
    assert "the defaults stand" in caplog.text
    # the measured machine keeps its shipped table
    shipped = Table.from_json((tuning.SHIPPED / "h200x2.json").read_text())
    measured, origin = tuning.load_table(dict(shipped.machine), "init")
    assert origin.endswith("h200x2.json") and measured.rows == shipped.rows
    # a named table of another machine: the model
    foreign = tmp_path / "foreign.json"
    foreign.write_text(shipped.to_json())
    monkeypatch.setenv("HOCCL_TUNING_FILE", str(foreign))
    assert tuning.load_table(_machine(), "init")[1] == "model"


@pytest.fixture
def modelled(tmp_path, monkeypatch):
    """Three host ranks given the model's table of a 3-GPU NVLink machine (what init
    gives such a cuda machine), through the same look-up."""
    monkeypatch.delenv("HOCCL_TUNING_FILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tuning, "model_table",
                        lambda machine: model_table({**machine, "backend": "cuda",
                                                     "link": "nvlink"}))
    comms = hoccl.init_local(3, backend="host")
    yield comms
    for comm in comms:
        comm.close()


def test_explain_names_the_model(modelled):
    told = modelled[0].explain("all_reduce", 4096)
    assert told["table"] == "model" and told["path"] == "direct"
    assert told["sources"]["kernel_bytes"].startswith("table row ")
    assert "model (NVLink)" in told["sources"]["kernel_bytes"]
    assert modelled[0].explain("all_reduce", 1 << 30)["path"] == "push"


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_every_collective_stays_exact_on_the_models_paths(modelled, collective):
    seeds = np.random.SeedSequence()
    for count in (0, 1, 1000, 300_000):
        for seed in seeds.generate_state(2):
            check_collective(modelled, collective, count=count, dtype="float32",
                             seed=int(seed), in_place=collective != "all_to_all")
    assert {modelled[0].explain(collective, 3 * 4 * 1000)["path"]} <= {"direct", "push"}


def test_every_constant_names_the_recorded_runs_it_comes_from():
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    for path, cost in NVLINK.items():
        named = re.findall(r"(?:results|docs)/[\w./-]+\.(?:log|md)", cost.source)
        assert named and all((root / name).is_file() for name in named), (path, cost.source)
