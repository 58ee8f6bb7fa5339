"""Repeated calls of one shape reuse what the engine worked out for the first (the
prepared call: the shape's plan, the addresses, the bound program, in the engine's one
bounded cache): every later call must still write its own buffers with its own data,
and anything that changes the layout must be seen.  Host backend, every
rank in this process (the cross-process path: tests/mpi/run_checks.py)."""

import numpy as np
import pytest

import hoccl
from hoccl._engine import PREPARED_CALLS, PreparedCall, ShapePlan
from hoccl.testing import assert_exact, expected, is_poison, poison, random_array

N = 3
COUNT = 24


def _in_place_round(comms, collective, full, rng):
    """Fresh data into each rank's ``full`` buffer (poison where the result goes), one
    in-place ``collective``, then each rank's result checked against numpy."""
    inputs = []
    for rank, buffer in enumerate(full):
        if collective == "all_gather":
            buffer[:] = poison(buffer.size, "float32")
            own = random_array(rng, COUNT, "float32")
            buffer[rank * COUNT:(rank + 1) * COUNT] = own
            inputs.append(own)
        else:
            buffer[:] = random_array(rng, buffer.size, "float32")
            inputs.append(buffer.copy())
    for rank, (comm, buffer) in enumerate(zip(comms, full)):
        if collective == "all_gather":
            comm.all_gather(buffer[rank * COUNT:(rank + 1) * COUNT], buffer)
        elif collective == "reduce_scatter":
            comm.reduce_scatter(buffer, buffer[rank * COUNT:(rank + 1) * COUNT], "sum")
        else:
            comm.all_reduce(buffer, buffer, "sum")
    for comm in comms:
        comm.synchronize()
    want = expected(collective, inputs, op="sum")
    for rank, buffer in enumerate(full):
        got = buffer if collective != "reduce_scatter" else buffer[rank * COUNT:(rank + 1) * COUNT]
        assert_exact(f"{collective}: rank {rank}", want[rank], got)


def _full_buffers(collective):
    size = COUNT * N if collective != "all_reduce" else COUNT
    return [np.empty(size, np.float32) for _ in range(N)]


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_repeated_calls_on_the_same_buffers_write_fresh_data_each_time(init_local, collective):
    comms = init_local(N, backend="host", chunk_bytes=32)
    rng = np.random.default_rng(1)
    full = _full_buffers(collective)
    for _ in range(20):
        _in_place_round(comms, collective, full, rng)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_a_repeated_shape_on_other_buffers_writes_those_and_leaves_the_first_alone(
        init_local, collective):
    comms = init_local(N, backend="host", chunk_bytes=32)
    rng = np.random.default_rng(2)
    first, second = _full_buffers(collective), _full_buffers(collective)
    for buffers, idle in ((first, second), (second, first), (first, second)):
        for buffer in idle:
            buffer[:] = poison(buffer.size, "float32")
        _in_place_round(comms, collective, buffers, rng)
        for rank, buffer in enumerate(idle):
            assert is_poison(buffer).all(), f"rank {rank}: a call wrote into another buffer"


@pytest.mark.parametrize("collective", ["all_gather", "all_reduce"])
def test_a_peer_switching_buffers_alone_is_written_in_its_new_ones(init_local, collective):
    """Rank 0's buffers stay the same, so only the peers' descriptors tell rank 0 where
    its copies must now go."""
    comms = init_local(2, backend="host")
    rng = np.random.default_rng(8)
    size = COUNT * 2 if collective == "all_gather" else COUNT
    sends = [np.empty(COUNT if collective == "all_gather" else size, np.float32)
             for _ in range(2)]
    own_output = np.empty(size, np.float32)
    peer_outputs = [np.empty(size, np.float32) for _ in range(2)]
    for round_ in range(6):
        for send in sends:
            send[:] = random_array(rng, send.size, "float32")
        outputs = [own_output, peer_outputs[round_ % 2]]
        idle = peer_outputs[1 - round_ % 2]
        for buffer in outputs + [idle]:
            buffer[:] = poison(size, "float32")
        for comm, send, output in zip(comms, sends, outputs):
            getattr(comm, collective)(send, output)
        for comm in comms:
            comm.synchronize()
        want = expected(collective, [send.copy() for send in sends], op="sum")
        for rank, output in enumerate(outputs):
            assert_exact(f"round {round_}: rank {rank}", want[rank], output)
        assert is_poison(idle).all(), f"round {round_}: rank 1's other buffer was written"


def test_out_of_place_and_in_place_calls_of_one_count_alternate_correctly(init_local):
    comms = init_local(N, backend="host")
    rng = np.random.default_rng(3)
    full = _full_buffers("all_gather")
    for round_ in range(6):
        if round_ % 2:
            _in_place_round(comms, "all_gather", full, rng)
            continue
        sends = [random_array(rng, COUNT, "float32") for _ in range(N)]
        recvs = [poison(COUNT * N, "float32") for _ in range(N)]
        for comm, send, recv in zip(comms, sends, recvs):
            comm.all_gather(send, recv)
        for comm in comms:
            comm.synchronize()
        for rank, recv in enumerate(recvs):
            assert_exact(f"out of place: rank {rank}", np.concatenate(sends), recv)


def test_repeated_calls_on_other_streams_each_wait_for_their_own_stream(init_local):
    comms = init_local(N, backend="host")
    rng = np.random.default_rng(4)
    streams = [[None, comm.device_handle.create_stream(), comm.device_handle.create_stream()]
               for comm in comms]
    for round_ in range(9):
        data = [random_array(rng, COUNT, "float32") for _ in range(N)]
        outputs = [poison(COUNT, "float32") for _ in range(N)]
        for rank, comm in enumerate(comms):
            comm.all_reduce(data[rank], outputs[rank], "max", stream=streams[rank][round_ % 3])
        for comm in comms:
            comm.synchronize()
        want = expected("all_reduce", data, op="max")
        for rank in range(N):
            assert_exact(f"round {round_}: rank {rank}", want[rank], outputs[rank])


def test_a_mismatch_between_repeated_calls_writes_nothing_and_the_shape_runs_again(init_local):
    comms = init_local(2, backend="host")
    rng = np.random.default_rng(5)
    data = [random_array(rng, COUNT, "float32") for _ in range(2)]
    outputs = [poison(COUNT, "float32") for _ in range(2)]
    for _ in range(3):
        for rank, comm in enumerate(comms):
            comm.all_reduce(data[rank], outputs[rank])
    for comm in comms:
        comm.synchronize()
    outputs = [poison(COUNT, "float32") for _ in range(2)]
    comms[0].all_reduce(data[0], outputs[0])
    with pytest.raises(hoccl.MismatchError, match="op='max'"):
        comms[1].all_reduce(data[1], outputs[1], "max")
    with pytest.raises(hoccl.MismatchError):
        comms[0].synchronize()
    assert all(is_poison(output).all() for output in outputs)
    data = [random_array(rng, COUNT, "float32") for _ in range(2)]
    for rank, comm in enumerate(comms):
        comm.all_reduce(data[rank], outputs[rank])
    for comm in comms:
        comm.synchronize()
    want = expected("all_reduce", data, op="sum")
    for rank in range(2):
        assert_exact(f"after the mismatch: rank {rank}", want[rank], outputs[rank])


def test_changed_options_plan_the_next_repeated_call_afresh(init_local):
    comms = init_local(N, backend="host", chunk_bytes=4096)
    rng = np.random.default_rng(6)
    full = _full_buffers("reduce_scatter")
    _in_place_round(comms, "reduce_scatter", full, rng)
    before = [_cached(comm, ShapePlan) for comm in comms]
    for comm in comms:
        comm.set_options(chunk_bytes=16)
    _in_place_round(comms, "reduce_scatter", full, rng)
    for comm, (old,) in zip(comms, before):
        (new,) = _cached(comm, ShapePlan)
        (prepared,) = _cached(comm, PreparedCall)
        assert new.plan is not old.plan and prepared.part is new
        assert dict(new.plan.options)["chunk_bytes"] == 16
        assert dict(old.plan.options)["chunk_bytes"] == 4096


def test_a_new_communicator_after_abort_and_close_runs_the_same_shape(init_local):
    rng = np.random.default_rng(7)
    full = _full_buffers("all_gather")
    comms = init_local(N, backend="host")
    _in_place_round(comms, "all_gather", full, rng)
    comms[0].abort("test")
    with pytest.raises(hoccl.AbortedError):
        comms[1].all_gather(full[1][COUNT:2 * COUNT], full[1])
    for comm in comms:
        comm.close()
    assert not any(len(comm._engine.preparer.cache) for comm in comms)
    comms = init_local(N, backend="host")
    for _ in range(3):
        _in_place_round(comms, "all_gather", full, rng)


def _cached(comm, kind):
    return [entry for entry in comm._engine.preparer.cache.values() if isinstance(entry, kind)]


def test_a_repeated_call_reuses_its_prepared_call_and_bound_program(init_local):
    comms = init_local(N, backend="host")
    rng = np.random.default_rng(8)
    full = _full_buffers("all_reduce")
    _in_place_round(comms, "all_reduce", full, rng)
    first = [_cached(comm, PreparedCall) for comm in comms]
    programs = [[prepared.program for prepared in cached] for cached in first]
    assert all(len(cached) == 1 and cached[0].program is not None for cached in first)
    for _ in range(3):
        _in_place_round(comms, "all_reduce", full, rng)
    for comm, cached, bound in zip(comms, first, programs):
        assert _cached(comm, PreparedCall) == cached  # the same objects, nothing added
        assert [prepared.program for prepared in cached] == bound
        assert all(prepared.program is program for prepared, program in zip(cached, bound))


def test_the_cache_keeps_at_most_its_size_least_recently_used_first(init_local):
    assert PREPARED_CALLS >= 64  # the documented bound the engines are built with
    comms = init_local(N, backend="host")
    for comm in comms:
        assert comm._engine.preparer.cache.size == PREPARED_CALLS
        comm._engine.preparer.cache.size = 5
    rng = np.random.default_rng(9)
    sizes = (8, 16, 24, 32, 40)
    for round_ in range(2):  # the second round finds every call made afresh and exact
        for count in sizes:
            data = [random_array(rng, count, "float32") for _ in range(N)]
            outputs = [poison(count, "float32") for _ in range(N)]
            for rank, comm in enumerate(comms):
                comm.all_reduce(data[rank], outputs[rank])
            for comm in comms:
                comm.synchronize()
            want = expected("all_reduce", data, op="sum")
            for rank in range(N):
                assert_exact(f"all_reduce of {count}: rank {rank}", want[rank], outputs[rank])
            for comm in comms:
                assert len(comm._engine.preparer.cache) <= 5
    for comm in comms:  # the latest shape and its call stay; the first ones went
        shapes = [entry.shape for entry in _cached(comm, ShapePlan)]
        assert shapes[-1].count == sizes[-1] and all(shape.count != sizes[0] for shape in shapes)
