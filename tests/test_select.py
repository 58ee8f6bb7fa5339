"""Choosing each call's path from a tuning table (hoccl.sched.select, pure) and its use by
communicators: rows followed, unset settings from the table, the user's settings over it,
every rank on rank 0's table, every collective exact on the chosen paths, and tables
that cannot be used refused or passed over, never used wrongly."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import hoccl
from hoccl.sched import Options, Shape
from hoccl.sched.select import (MACHINE_KEYS, PATHS, Table, TableError, candidates, choose,
                                path_options, size_of)
from hoccl.testing import check_collective
from hoccl.tuning import machine_of

from test_mpi import MPI_ENV, _mpiexec

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


def _machine(world_size=3):
    return {"backend": "host", "gpu": "host", "world_size": world_size, "ranks_per_gpu": 1,
            "link": "host", "links": 0, "driver": "none", "hoccl": hoccl.__version__}


def _table(rows, machine=None):
    return {"format": "hoccl-tuning", "version": 2, "machine": machine or _machine(),
            "rows": rows}


#: small calls as direct kernels (all_gather, all_to_all, broadcast) or one-shot
#: (all_reduce) or pulled (reduce_scatter); larger ones pushed in small chunks
ROWS = [
    {"collective": "all_gather", "min_bytes": 0, "max_bytes": 4096, "path": "direct",
     "settings": {"kernel_sms": 2}, "source": "test"},
    {"collective": "all_to_all", "min_bytes": 0, "max_bytes": 4096, "path": "direct"},
    {"collective": "broadcast", "min_bytes": 0, "max_bytes": 4096, "path": "direct"},
    {"collective": "all_reduce", "min_bytes": 0, "max_bytes": 2048, "path": "one_shot"},
    {"collective": "all_reduce", "min_bytes": 2049, "max_bytes": 1 << 40, "path": "push",
     "settings": {"chunk_bytes": 1024}},
    {"collective": "reduce_scatter", "min_bytes": 0, "max_bytes": 1 << 16, "path": "pull"},
]


def test_a_row_sets_the_path_and_its_settings_and_the_user_wins():
    table = Table.from_dict(_table(ROWS))
    small = Shape("all_gather", 3, 100, "float32", 4)
    choice = choose(table, small, Options())
    assert choice.path == "direct" and choice.options.kernel_bytes == 4096
    assert choice.options.kernel_sms == 2 and choice.row == 0
    assert dict(choice.sources)["kernel_sms"] == "table row 0 (test)"
    large = Shape("all_gather", 3, 1000, "float32", 4)  # 12000 bytes: no row, the defaults
    assert choose(table, large, Options()).options == Options()
    user = choose(table, small, Options(kernel_bytes=0, kernel_sms=4), {"kernel_bytes",
                                                                         "kernel_sms"})
    assert user.path == "push" and user.options.kernel_sms == 4
    assert dict(user.sources)["kernel_bytes"] == "user"
    chunked = choose(table, Shape("all_reduce", 3, 4096, "float32", 4), Options())
    assert chunked.path == "push" and chunked.options.chunk_bytes == 1024
    assert choose(table, Shape("all_reduce", 3, 8, "float32", 4), Options()).path == "one_shot"
    assert choose(table, Shape("reduce_scatter", 3, 8, "float32", 4), Options()).path == "pull"
    assert choose(None, small, Options()).options == Options()


def test_rows_narrowed_to_a_form_or_dtype_apply_to_those_calls_only():
    from hoccl._dtypes import NAMES
    from hoccl.sched.select import DTYPES
    assert DTYPES == NAMES
    rows = [{"collective": "all_reduce", "min_bytes": 0, "max_bytes": 1 << 20, "path": "pull",
             "forms": ["in"], "dtypes": ["bfloat16"]},
            {"collective": "all_reduce", "min_bytes": 0, "max_bytes": 1 << 20,
             "path": "one_shot", "forms": ["out"]}]
    table = Table.from_dict(_table(rows))
    assert Table.from_json(table.to_json()) == table
    def path(in_place, dtype, itemsize):
        shape = Shape("all_reduce", 3, 64, dtype, itemsize, in_place=in_place)
        return choose(table, shape, Options()).path
    assert path(True, "bfloat16", 2) == "pull"
    assert path(True, "float32", 4) == "push"       # no row for in-place float32
    assert path(False, "float32", 4) == "one_shot"
    with pytest.raises(TableError, match="forms must be a list of"):
        Table.from_dict(_table([{**rows[0], "forms": ["sideways"]}]))
    with pytest.raises(TableError, match="dtypes must be a list of"):
        Table.from_dict(_table([{**rows[0], "dtypes": "bfloat16"}]))


def test_rows_keyed_by_registered_and_captured_and_beside_compute():
    """A row narrowed to a trait applies to calls that have it, and to calls whose
    caller does not know it (None); the first row that covers a call wins."""
    rows = [{"collective": "all_reduce", "min_bytes": 0, "max_bytes": 1 << 20,
             "path": "push", "settings": {"max_sms": 32, "chunk_bytes": 4096},
             "beside_compute": True},
            {"collective": "all_reduce", "min_bytes": 0, "max_bytes": 1 << 20, "path": "pull",
             "registered": True, "captured": False},
            {"collective": "all_reduce", "min_bytes": 0, "max_bytes": 1 << 20, "path": "direct",
             "captured": True},
            {"collective": "all_reduce", "min_bytes": 0, "max_bytes": 1 << 20,
             "path": "one_shot"}]
    table = Table.from_dict(_table(rows))
    assert Table.from_json(table.to_json()) == table
    assert table.rows[0].to_dict()["beside_compute"] is True
    shape = Shape("all_reduce", 3, 64, "float32", 4)

    def path(**traits):
        return choose(table, shape, Options(), **traits).path
    assert path() == "push"                         # not known: the first row
    assert path(beside_compute=True) == "push"
    assert path(beside_compute=False) == "pull"
    assert path(beside_compute=False, registered=True, captured=False) == "pull"
    assert path(beside_compute=False, registered=False, captured=False) == "one_shot"
    assert path(beside_compute=False, registered=False, captured=True) == "direct"
    assert path(beside_compute=False, registered=True, captured=True) == "direct"


def test_a_row_sets_max_sms_and_the_user_wins():
    rows = [{"collective": "reduce_scatter", "min_bytes": 0, "max_bytes": 1 << 30,
             "path": "push", "settings": {"max_sms": 32}, "source": "s"}]
    table = Table.from_dict(_table(rows))
    shape = Shape("reduce_scatter", 3, 64, "float32", 4)
    choice = choose(table, shape, Options())
    assert choice.max_sms == 32 and dict(choice.sources)["max_sms"] == "table row 0 (s)"
    assert choice.describe()["settings"]["max_sms"] == 32
    user = choose(table, shape, Options(), {"max_sms"})
    assert user.max_sms is None and dict(user.sources)["max_sms"] == "user"
    assert choose(None, shape, Options()).max_sms is None


def test_a_version_1_table_reads_as_version_2_with_rows_for_every_call():
    old = {**_table(ROWS), "version": 1}
    table = Table.from_dict(old, "old.json")
    assert table == Table.from_dict(_table(ROWS), "old.json")
    assert all(row.traits == () for row in table.rows)
    assert json.loads(table.to_json())["version"] == 2
    shape = Shape("reduce_scatter", 3, 8, "float32", 4)
    assert choose(table, shape, Options(), registered=False, captured=True).path == "pull"


@pytest.mark.parametrize("collective", COLLECTIVES + ("reduce",))
def test_path_options_make_build_plan_take_the_path(collective):
    from hoccl.sched import build_plan
    from hoccl.sched.algorithms import path_of
    shape = Shape(collective, 3, 64, "float32", 4)
    for path in candidates(collective, 3):
        options = path_options(path, size_of(shape), Options())
        assert path_of(shape, options) == path
        plan = build_plan(shape, options)
        assert bool(plan.kernel_blocks) == (path == "direct")


@pytest.mark.parametrize("broken, message", [
    ({"format": "other"}, "format must be"),
    ({"version": 99}, "version 99 is not"),
    ({"machine": {"gpu": "x"}}, "machine must name exactly"),
    ({"rows": {}}, "rows must be a list"),
    ({"rows": [{"collective": "all_gather", "min_bytes": 5, "max_bytes": 1, "path": "push"}]},
     "min_bytes <= max_bytes"),
    ({"rows": [{"collective": "all_gather", "min_bytes": 0, "max_bytes": 1, "path": "pull"}]},
     "cannot take path 'pull'"),
    ({"rows": [{"collective": "all_gather", "min_bytes": 0, "max_bytes": 1, "path": "fly"}]},
     "a path of"),
    ({"rows": [{"collective": "all_gather", "min_bytes": 0, "max_bytes": 1, "path": "push",
                "settings": {"lanes": 3}}]}, "settings may name only"),
    ({"rows": [{"collective": "all_gather", "min_bytes": 0, "max_bytes": 1, "path": "push",
                "settings": {"max_sms": 0}}]}, "max_sms must be a positive int"),
    ({"rows": [{"collective": "all_gather", "min_bytes": 0, "max_bytes": 1, "path": "push",
                "registered": "yes"}]}, "registered must be true or false"),
    ({"rows": [{"collective": "all_gather", "min_bytes": 0, "max_bytes": 1, "path": "push",
                "settings": {"chunk_bytes": 0}}]}, "chunk_bytes must be"),
    ({"rows": [{"collective": "all_gather", "min_bytes": 0, "max_bytes": 9, "path": "push"},
               {"collective": "all_gather", "min_bytes": 9, "max_bytes": 20, "path": "push"}]},
     "overlap"),
])
def test_a_table_that_cannot_be_used_is_refused_saying_why(broken, message):
    with pytest.raises(TableError, match=message):
        Table.from_dict({**_table([]), **broken}, "t.json")
    with pytest.raises(TableError, match="not JSON"):
        Table.from_json("{", "t.json")


def test_a_table_round_trips_through_json():
    table = Table.from_dict(_table(ROWS), "a")
    assert Table.from_json(table.to_json(), "a") == table
    assert set(dict(table.machine)) == set(MACHINE_KEYS)
    assert table.mismatch(_machine()) is None
    assert "world_size 3 (this machine: 4)" in table.mismatch(_machine(4))
    assert set(PATHS) >= {row.path for row in table.rows}


@pytest.fixture
def tuned(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(_table(ROWS)))
    monkeypatch.setenv("HOCCL_TUNING_FILE", str(path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    comms = hoccl.init_local(3, backend="host")
    yield comms
    for comm in comms:
        comm.close()


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("count", [0, 1, 5, 300, 1100])
def test_every_collective_stays_exact_on_the_paths_a_table_chooses(tuned, collective, count):
    assert tuned[0].tuning is not None
    engine = tuned[0]._engine

    def kernels():  # the direct kernels this rank ran: its pad's epoch
        return engine.device.peek(engine.pad.kernel_counter, 1)[0]
    before = kernels()
    for root in (0, 2) if collective == "broadcast" else (0,):
        check_collective(tuned, collective, count=count, dtype="float32", root=root,
                         seed=np.random.SeedSequence().entropy % (1 << 32))
        check_collective(tuned, collective, count=count, dtype="int32", root=root,
                         in_place=collective != "all_to_all",
                         seed=np.random.SeedSequence().entropy % (1 << 32))
    shape = Shape(collective, 3, count, "float32", 4)
    direct = choose(tuned[0].tuning, shape, Options()).path == "direct"
    if count:  # a call of no elements moves nothing, kernel or not
        assert (kernels() > before) == direct, (collective, count)


def test_explain_says_what_a_call_gets_and_from_where(tuned):
    told = tuned[0].explain("all_gather", 3 * 400)
    assert told["path"] == "direct" and told["row"] == 0 and told["table"].endswith("table.json")
    assert told["sources"]["kernel_sms"] == "table row 0 (test)"
    assert tuned[0].explain("all_gather", 3 * 4000)["path"] == "push"
    tuned[0].set_options(kernel_bytes=0)
    assert tuned[0].explain("all_gather", 3 * 400)["path"] == "push"
    with pytest.raises(hoccl.InvalidArgumentError, match="explain: nbytes must be"):
        tuned[0].explain("all_gather", 7)
    with pytest.raises(hoccl.InvalidArgumentError, match="explain: collective must be"):
        tuned[0].explain("gossip", 8)


def test_a_named_table_that_cannot_be_read_is_an_error_and_another_machines_is_not_used(
        tmp_path, monkeypatch, caplog):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "hoccl-tuning", "version": 1')
    monkeypatch.setenv("HOCCL_TUNING_FILE", str(bad))
    with pytest.raises(hoccl.InvalidArgumentError, match="init_local: HOCCL_TUNING_FILE=.*not JSON"):
        hoccl.init_local(2, backend="host")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_table(ROWS, _machine(3))))
    monkeypatch.setenv("HOCCL_TUNING_FILE", str(other))
    with caplog.at_level("WARNING", logger="hoccl"):
        comms = hoccl.init_local(2, backend="host")  # a table of 3 ranks: not used
    try:
        assert comms[0].tuning is None and "another machine" in caplog.text
        check_collective(comms, "all_gather", count=5, dtype="float32")
    finally:
        for comm in comms:
            comm.close()


def test_a_cached_table_that_cannot_be_read_is_passed_over(tmp_path, monkeypatch, caplog):
    from hoccl.tuning import cache_dir, table_name
    monkeypatch.delenv("HOCCL_TUNING_FILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    comms = hoccl.init_local(2, backend="host")
    machine = machine_of(comms[0]._engine.device, 2, 1)
    for comm in comms:
        comm.close()
    cache_dir().mkdir(parents=True)
    (cache_dir() / table_name(machine)).write_text("garbage")
    with caplog.at_level("WARNING", logger="hoccl"):
        comms = hoccl.init_local(2, backend="host")
    try:
        assert comms[0].tuning is None and "cannot be used" in caplog.text
    finally:
        for comm in comms:
            comm.close()
    (cache_dir() / table_name(machine)).write_text(json.dumps(_table(ROWS, machine)))
    comms = hoccl.init_local(2, backend="host")
    try:
        assert comms[0].tuning is not None and comms[0].explain("all_gather", 80)["row"] == 0
    finally:
        for comm in comms:
            comm.close()


RANKS_DIFFER = r"""
import os, sys
import numpy as np
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
os.environ["HOCCL_TUNING_FILE"] = sys.argv[1 + rank]  # every rank names a table of its own
import hoccl
from hoccl.testing import expected, poison
comm = hoccl.init(backend="host", timeout=20)
told = comm.explain("all_gather", 3 * 40)
rng = np.random.default_rng(5)
inputs = [rng.standard_normal(10).astype(np.float32) for _ in range(3)]
out = poison(30, "float32")
comm.all_gather(inputs[rank], out)
comm.synchronize()
exact = out.view(np.uint32).tolist() == expected("all_gather", inputs)[rank].view(np.uint32).tolist()
print(f"rank {rank}: path {told['path']} table {os.path.basename(told['table'])} exact {exact}")
comm.close()
"""


@pytest.mark.mpi
def test_ranks_naming_different_tables_all_use_rank_0s(tmp_path):
    program = tmp_path / "ranks_differ.py"
    program.write_text(RANKS_DIFFER)
    files = []
    for rank, path in enumerate(("direct", "push", "push")):
        table = tmp_path / f"rank{rank}.json"
        table.write_text(json.dumps(_table([{"collective": "all_gather", "min_bytes": 0,
                                             "max_bytes": 1 << 20, "path": path}])))
        files.append(str(table))
    result = subprocess.run([_mpiexec(), "-n", "3", sys.executable, str(program), *files],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, **MPI_ENV})
    output = result.stdout + result.stderr
    for rank in range(3):
        assert f"rank {rank}: path direct table rank0.json exact True" in output, output[-3000:]


def test_an_eager_call_takes_no_row_narrowed_to_captured_calls(tmp_path, monkeypatch):
    """The prepared call asks the selector with its capture known: a row for captured
    calls (a direct kernel here) is passed over by eager calls, which take the next row."""
    rows = [{"collective": "all_reduce", "min_bytes": 0, "max_bytes": 1 << 20, "path": "direct",
             "captured": True},
            {"collective": "all_reduce", "min_bytes": 0, "max_bytes": 1 << 20,
             "path": "one_shot"}]
    path = tmp_path / "table.json"
    path.write_text(json.dumps(_table(rows)))
    monkeypatch.setenv("HOCCL_TUNING_FILE", str(path))
    comms = hoccl.init_local(3, backend="host")
    try:
        engine = comms[0]._engine
        shape = Shape("all_reduce", 3, 100, "float32", 4)
        assert engine.preparer.choice(shape, captured=True).path == "direct"
        assert engine.preparer.choice(shape, captured=False).path == "one_shot"
        check_collective(comms, "all_reduce", count=100, dtype="float32",
                         seed=np.random.SeedSequence().entropy % (1 << 32))
        eager = engine.preparer.cache.get(("shape", shape, False))
        assert eager is not None and eager.plan.kernel_blocks == 0
        one_shot = engine.preparer.choice(shape, captured=False).options
        assert eager.plan == engine.preparer.plan(shape, one_shot)
        assert eager.plan != engine.preparer.plan(
            shape, engine.preparer.choice(shape, captured=True).options)
    finally:
        for comm in comms:
            comm.close()


@pytest.mark.parametrize("given", [None, 5])
def test_a_rows_max_sms_caps_the_calls_reductions_unless_the_user_set_it(tmp_path, monkeypatch,
                                                                          given):
    """A row's ``max_sms`` reaches every reduction of the calls it covers (the host
    device records each launch's cap); calls of other rows, and every call once the user
    gives ``max_sms``, take the communicator's.  Results stay exact."""
    rows = [{"collective": "all_reduce", "min_bytes": 0, "max_bytes": 1 << 12, "path": "push",
             "settings": {"max_sms": 3, "chunk_bytes": 256}},
            {"collective": "reduce_scatter", "min_bytes": 0, "max_bytes": 1 << 12,
             "path": "push", "settings": {"chunk_bytes": 256}}]
    path = tmp_path / "table.json"
    path.write_text(json.dumps(_table(rows)))
    monkeypatch.setenv("HOCCL_TUNING_FILE", str(path))
    settings = {} if given is None else {"max_sms": given}
    comms = hoccl.init_local(3, backend="host", **settings)
    caps = []
    try:
        for comm in comms:
            device = comm._engine.device
            for name in ("reduce", "reduce_chunks"):
                def spy(*args, _run=getattr(device, name), sms=None, **kwargs):
                    caps.append(sms)
                    return _run(*args, sms=sms, **kwargs)
                monkeypatch.setattr(device, name, spy)
        own = comms[0].max_sms
        for collective, count, want in (("all_reduce", 300, 3 if given is None else given),
                                        ("reduce_scatter", 100, own)):
            caps.clear()
            check_collective(comms, collective, count=count, dtype="float32",
                             seed=np.random.SeedSequence().entropy % (1 << 32))
            assert caps and set(caps) == {want}, (collective, sorted(set(caps)))
        assert comms[0].explain("all_reduce", 1200)["settings"]["max_sms"] == (
            3 if given is None else None)
    finally:
        for comm in comms:
            comm.close()
