"""The public API on the host backend, every rank in this process (init_local)."""

import gc
import time

import numpy as np
import pytest

import hoccl
from hoccl.testing import (IN_PLACE_FORMS, assert_exact, check_collective, is_poison, poison,
                           random_array)

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce",
               "gather", "scatter", "send_recv")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("reduce_scatter", "all_reduce", "reduce")
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")


@pytest.fixture(scope="module", params=[1, 2, 3, 4, 5])
def comms(request):
    comms = hoccl.init_local(request.param, backend="host", chunk_bytes=96)
    yield comms
    for comm in comms:
        comm.close()


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_every_collective_matches_numpy(comms, collective):
    n = comms[0].world_size
    seed = 0
    for dtype in DTYPES:
        for count in (0, 1, 7, 61):
            for in_place in ([False, True] if collective in IN_PLACE_FORMS else [False]):
                for root in (sorted({0, n - 1}) if collective in ROOTED else [0]):
                    for op in (("sum", "prod", "max", "min", "avg") if collective in REDUCING
                               else ("sum",)):
                        seed += 1
                        check_collective(comms, collective, count=count, dtype=dtype, op=op,
                                         root=root, in_place=in_place, seed=seed)


@pytest.mark.parametrize("route", ["peer", "local"])
def test_both_self_block_routes_give_the_same_result(init_local, route):
    comms = init_local(3, backend="host", self_route=route)
    for seed, collective in enumerate(("all_gather", "all_to_all", "gather", "scatter", "broadcast")):
        check_collective(comms, collective, count=29, dtype="float32", root=1, seed=seed)
    assert all(comm.options.self_route == route for comm in comms)


def test_ranks_may_call_in_any_order_and_calls_queue_without_synchronizing(init_local):
    comms = init_local(4, backend="host", chunk_bytes=64)
    rng = np.random.default_rng(5)
    rounds = 200
    data = [[random_array(rng, 16, "int64") for _ in range(4)] for _ in range(rounds)]
    outputs = [[poison(16, "int64") for _ in range(4)] for _ in range(rounds)]
    for i in range(rounds):
        order = rng.permutation(4)
        for rank in order:
            comms[rank].all_reduce(data[i][rank], outputs[i][rank])
    for comm in comms:
        comm.synchronize()
    for i in range(rounds):
        for rank in range(4):
            assert_exact(f"round {i}: rank {rank}", sum(data[i]), outputs[i][rank])


def test_a_thousand_collectives_back_to_back_reuse_pads_correctly(init_local):
    comms = init_local(2, backend="host")
    rng = np.random.default_rng(11)
    sends = [random_array(rng, 8, "int32") for _ in range(2)]
    recvs = [[poison(16, "int32") for _ in range(2)] for _ in range(1000)]
    for i in range(1000):
        for rank in range(2):
            comms[rank].all_gather(sends[rank], recvs[i][rank])
    for comm in comms:
        comm.synchronize()
    want = np.concatenate(sends)
    for i in range(1000):
        for rank in range(2):
            assert_exact(f"all_gather {i}: rank {rank}", want, recvs[i][rank])


def test_send_recv_ring_then_barrier(init_local):
    """Sends complete only once the receiver's stream reaches the matching recv (as NCCL's
    without a group), so the ring alternates: even ranks send first, odd ranks receive first.
    A barrier issued behind the ring completes, and the ring's data is intact."""
    n = 4
    comms = init_local(n, backend="host", timeout=60)
    rng = np.random.default_rng(3)
    data = [random_array(rng, 33, "float64") for _ in range(n)]
    out = [poison(33, "float64") for _ in range(n)]
    for rank in range(n):
        if rank % 2 == 0:
            comms[rank].send(data[rank], (rank + 1) % n)
            comms[rank].recv(out[rank], (rank - 1) % n)
        else:
            comms[rank].recv(out[rank], (rank - 1) % n)
            comms[rank].send(data[rank], (rank + 1) % n)
    for comm in comms:
        comm.barrier()
    for comm in comms:
        comm.synchronize()
    for rank in range(n):
        assert_exact(f"recv: rank {rank}", data[(rank - 1) % n], out[rank])


def test_buffers_stay_alive_after_the_caller_drops_them(init_local):
    comms = init_local(2, backend="host")
    rng = np.random.default_rng(8)
    expected = [random_array(rng, 1 << 16, "float32") for _ in range(2)]
    outputs = [poison(1 << 17, "float32") for _ in range(2)]
    for rank in range(2):
        comms[rank].all_gather(expected[rank].copy(), outputs[rank])  # temporary send buffer
    gc.collect()
    for comm in comms:
        comm.synchronize()
    for rank in range(2):
        assert_exact(f"all_gather: rank {rank}", np.concatenate(expected), outputs[rank])


def test_order_after_holds_a_stream_until_the_calls_up_to_a_mark_finish(init_local):
    comms = init_local(2, backend="host", chunk_bytes=64)
    rng = np.random.default_rng(12)
    data = [random_array(rng, 4096, "float32") for _ in range(2)]
    outputs = [poison(8192, "float32") for _ in range(2)]
    streams = [comm._engine.device.create_stream() for comm in comms]
    seen = [None, None]
    for rank in range(2):
        comm = comms[rank]
        comm.all_gather(data[rank], outputs[rank])
        comm.order_after(comm.calls, stream=streams[rank])
        streams[rank].enqueue(lambda rank=rank: seen.__setitem__(rank, outputs[rank].copy()))
        if rank == 0:  # its call waits for rank 1's: so must the stream
            time.sleep(0.1)
            assert seen[0] is None, "the stream ran before the call it was ordered after"
    for rank in range(2):
        comms[rank].synchronize()
        streams[rank].synchronize(10)
        assert_exact(f"order_after: rank {rank}", np.concatenate(data), seen[rank])
    with pytest.raises(hoccl.InvalidArgumentError, match=r"order_after: mark 2 is past .* 1 "):
        comms[0].order_after(2, stream=streams[0])


def _untouched(call, *outputs):
    before = [o.copy() for o in outputs]
    with pytest.raises(hoccl.InvalidArgumentError) as info:
        call()
    for o, b in zip(outputs, before):
        assert np.array_equal(o.view(np.uint8), b.view(np.uint8)), "output changed by a rejected call"
    return str(info.value)


def test_bad_input_is_rejected_by_name_before_anything_is_enqueued(init_local):
    """Every rank makes the same bad call (a program's calls are the same on every rank):
    each raises InvalidArgumentError naming it, nothing is enqueued, and each refused call
    takes its place in every rank's sequence, so the calls after it match as before."""
    comms = init_local(2, backend="host")
    send = np.ones(4, np.float32)
    recv = poison(8, "float32")
    ops_before = [comm._engine.calls for comm in comms]

    def everywhere(call):
        messages = [_untouched(lambda: call(comm), recv) for comm in comms]
        assert all(m.split(":")[0] == messages[0].split(":")[0] for m in messages), messages
        return messages[0]
    message = everywhere(lambda comm: comm.all_gather(send, poison(7, "float32")))
    assert message.startswith("all_gather:") and "8" in message and "7" in message
    assert everywhere(lambda comm: comm.all_gather(send, poison(8, "float64"))) \
        .startswith("all_gather: sendbuf and recvbuf must have one dtype")
    assert "root" in everywhere(lambda comm: comm.broadcast(send, send, 2))
    assert "op must be one of" in everywhere(lambda comm: comm.all_reduce(send, send, "xor"))
    assert "C-contiguous" in everywhere(lambda comm: comm.all_reduce(np.ones((4, 4))[:, 0],
                                                                     np.ones(4)))
    assert "complex128" in everywhere(lambda comm: comm.all_reduce(np.ones(2, complex),
                                                                   np.ones(2, complex)))
    assert "peer" in everywhere(lambda comm: comm.send(send, comm.rank))
    assert "overlap" in everywhere(lambda comm: comm.all_gather(recv[1:5], recv))
    shifted = everywhere(lambda comm: comm.all_reduce(recv[:7], recv[1:8]))
    assert shifted.startswith("all_reduce: sendbuf and recvbuf overlap but are not the same "
                              "buffer (starting +4 bytes apart)"), shifted
    assert "must be a numpy" in everywhere(lambda comm: comm.all_gather([1, 2], recv))
    assert [comm._engine.calls for comm in comms] == ops_before
    # the communicator still works afterwards
    check_collective(comms, "all_gather", count=4, dtype="float32", seed=1)


def test_a_call_refused_on_one_rank_is_refused_on_its_peers(init_local):
    """One rank's bad call takes its place: its peer's matching call (made before or
    after it) raises MismatchError naming the refusal, and the next calls match."""
    comms = init_local(2, backend="host")
    out = poison(4, "float32")
    comms[0].all_reduce(np.ones(4, np.float32), out)  # made first: refused at synchronize
    with pytest.raises(hoccl.InvalidArgumentError):
        comms[1].all_reduce(np.ones(4, np.float32), np.ones(4, np.float32), "xor")
    with pytest.raises(hoccl.MismatchError, match="rank 1 refused this call .*op must be"):
        comms[0].synchronize()
    assert is_poison(out).all()
    with pytest.raises(hoccl.InvalidArgumentError):  # refused first: the peer's comes later
        comms[0].broadcast(np.ones(3, np.float32), np.ones(3, np.float32), 5)
    with pytest.raises(hoccl.MismatchError, match="rank 0 refused this call .*root"):
        comms[1].broadcast(np.ones(3, np.float32), np.ones(3, np.float32), 0)
    check_collective(comms, "all_reduce", count=5, dtype="float32", seed=2)


def test_mismatched_calls_raise_on_every_rank_and_the_communicator_stays_usable(init_local):
    comms = init_local(2, backend="host")
    a = np.zeros(4, np.float32)
    out = poison(4, "float32")
    comms[0].all_reduce(a, out)
    with pytest.raises(hoccl.MismatchError) as info:
        comms[1].all_reduce(np.zeros(5, np.float32), np.zeros(5, np.float32))
    assert "rank 1" in str(info.value) and "rank 0" in str(info.value) and "count=5" in str(info.value)
    with pytest.raises(hoccl.MismatchError):  # rank 0 had returned: its synchronize reports it
        comms[0].synchronize()
    assert is_poison(out).all()  # unwritten
    check_collective(comms, "all_reduce", count=5, dtype="float32", seed=3)


def test_ranks_planning_with_different_options_raise_instead_of_running(init_local):
    """A rank with other planning options would run another plan (here: one reading the
    peers' inputs where the other pushes into scratch): the options that differ from the
    defaults are part of the call's signature, so the calls mismatch."""
    comms = init_local(2, backend="host")
    comms[1].set_options(pull_bytes=1 << 20)
    out = [poison(8, "float32") for _ in comms]
    comms[0].all_reduce(np.ones(8, np.float32), out[0])
    with pytest.raises(hoccl.MismatchError) as info:
        comms[1].all_reduce(np.ones(8, np.float32), out[1])
    assert "pull_bytes" in str(info.value), info.value
    with pytest.raises(hoccl.MismatchError):
        comms[0].synchronize()
    assert is_poison(out[0]).all() and is_poison(out[1]).all()
    comms[0].set_options(pull_bytes=1 << 20)  # agreed: it runs
    check_collective(comms, "all_reduce", count=8, dtype="float32", seed=4)


@pytest.mark.parametrize("in_place", [False, True])
def test_pulled_reductions_match_numpy_below_and_above_their_threshold(init_local, in_place):
    """``pull_bytes``: reductions whose input is at most that many bytes read the peers'
    inputs where they lie; larger ones push into scratch; both exact, odd counts."""
    comms = init_local(3, backend="host")
    for comm in comms:
        comm.set_options(pull_bytes=1200)
    for seed, count in enumerate((1, 17, 100, 101, 1000)):  # 1200 bytes = 300 float32
        for collective in ("reduce_scatter", "all_reduce", "reduce"):
            for op in ("sum", "max", "avg"):
                check_collective(comms, collective, count=count, dtype="float32", op=op,
                                 in_place=in_place, seed=seed, root=2)


def test_synchronize_names_the_ranks_that_have_not_called(init_local):
    comms = init_local(3, backend="host", timeout=1)
    a = np.zeros(4, np.float32)
    comms[0].all_reduce(a, a)
    with pytest.raises(hoccl.HocclTimeoutError) as info:
        comms[0].synchronize()
    assert "all_reduce" in str(info.value) and "[1, 2]" in str(info.value)


def test_close_is_idempotent_and_the_context_manager_closes(init_local):
    comms = init_local(2, backend="host")
    with comms[0] as comm:
        assert comm.rank == 0 and comm.world_size == 2 and comm.backend == "host"
    comms[0].close()
    with pytest.raises(hoccl.InvalidArgumentError, match="closed"):
        comms[0].all_reduce(np.zeros(2), np.zeros(2))
    comms[1].close()


def test_init_local_rejects_bad_arguments():
    with pytest.raises(hoccl.InvalidArgumentError, match="init_local: backend"):
        hoccl.init_local(2, backend="nccl")
    with pytest.raises(hoccl.InvalidArgumentError, match="init_local: need at least one"):
        hoccl.init_local([], backend="host")
    with pytest.raises(hoccl.InvalidArgumentError, match="self_route"):
        hoccl.init_local(2, backend="host", self_route="sideways")
    with pytest.raises(hoccl.InvalidArgumentError, match="unknown settings"):
        hoccl.init_local(2, backend="host", chunk=3)
    with pytest.raises(hoccl.InvalidArgumentError, match="init_local: copy_sms must be a "
                                                         "positive int or None; got 0"):
        hoccl.init_local(2, backend="host", copy_sms=0)
    with pytest.raises(hoccl.InvalidArgumentError, match="init_local: max_sms must be a "
                                                         "positive int; got True"):
        hoccl.init_local(2, backend="host", max_sms=True)


def test_sm_caps_default_per_world_size_and_change_with_set_options(init_local):
    comms = init_local(2, backend="host")
    assert [c.copy_sms for c in comms] == [16, 16]  # the own-block copy
    assert [c.max_sms for c in comms] == [8, 8]     # the sums
    assert init_local(3, backend="host", copy_sms=5)[0].copy_sms == 5
    assert [hoccl.default_copy_sms(n) for n in (1, 2, 3, 4, 8)] == [16, 16, 8, 6, 3]
    comms[0].set_options(copy_sms=4, max_sms=2)
    assert (comms[0].copy_sms, comms[0].max_sms) == (4, 2)
    assert comms[1].max_sms == 8  # caps are the communicator's own
    with pytest.raises(hoccl.InvalidArgumentError, match="set_options: copy_sms must be a "
                                                         "positive int or None; got -1"):
        comms[0].set_options(copy_sms=-1, max_sms=3)
    assert comms[0].max_sms == 2  # a rejected call changes nothing


def test_each_call_waits_for_its_own_stream_even_when_a_later_call_uses_an_idle_one(
        init_local):
    """Call 1 on a busy stream, call 2 on an idle one: call 1 must still read its input only
    after the busy stream produced it."""
    import time
    comms = init_local(2, backend="host")
    rng = np.random.default_rng(9)
    want = [random_array(rng, 6, "int32") for _ in range(2)]
    sends = [np.zeros(6, np.int32) for _ in range(2)]
    firsts = [poison(12, "int32") for _ in range(2)]
    seconds = [poison(12, "int32") for _ in range(2)]
    for comm in comms:
        busy, idle = comm.device_handle.create_stream(), comm.device_handle.create_stream()
        r = comm.rank

        def produce(r=r):
            time.sleep(0.3)
            sends[r][...] = want[r]
        busy.enqueue(produce)
        comm.all_gather(sends[r], firsts[r], stream=busy)
        comm.all_gather(want[r], seconds[r], stream=idle)
    for comm in comms:
        comm.synchronize()
    for r in range(2):
        assert_exact(f"first all_gather: rank {r}", np.concatenate(want), firsts[r])
        assert_exact(f"second all_gather: rank {r}", np.concatenate(want), seconds[r])


@pytest.mark.parametrize("in_place", [False, True])
def test_one_shot_all_reduce_matches_numpy_below_and_above_its_threshold(init_local, in_place):
    """``one_shot_bytes``: all_reduce in one phase up to the threshold (every rank sums
    every input), two phases above it; both exact, every op, odd counts."""
    comms = init_local(3, backend="host")
    for comm in comms:
        comm.set_options(one_shot_bytes=400)
    for seed, count in enumerate((1, 17, 100, 101, 1000)):  # 400 bytes = 100 float32
        for op in ("sum", "max", "avg"):
            check_collective(comms, "all_reduce", count=count, dtype="float32", op=op,
                             in_place=in_place, seed=seed)
