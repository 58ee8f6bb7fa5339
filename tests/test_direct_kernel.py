"""Direct kernels (``Options.kernel_bytes``) on the host backend, which runs their protocol
as the GPU kernel does: one signal slot per block, waits on every block's slot, each
block's share of every data step, and an epoch kept in the rank's pad.

The plans themselves are verified and simulated in test_sched_plans.py; the MPI tier
(test_mpi.py) runs them across processes, captured, and through failures."""

import threading
import time

import numpy as np
import pytest

import hoccl
from hoccl._errors import HocclTimeoutError, InvalidArgumentError
from hoccl.backends._kernels import block_range
from hoccl.sched import Options, Shape, build_plan
from hoccl.sched.algorithms import KERNEL_COLLECTIVES, KERNEL_MAX_BLOCKS, WORLD_ONE_KERNEL_BYTES
from hoccl.testing import check_collective

IN_PLACE = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
REDUCING = ("reduce_scatter", "all_reduce")


def _epochs(comms):
    return [comm._engine.device.peek(comm._engine.pad.kernel_counter, 2) for comm in comms]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("collective", KERNEL_COLLECTIVES)
def test_every_form_dtype_and_op_exact(world_size, collective):
    """A world of one takes the kernel with ``kernel_bytes`` left at 0 (its default) where
    it has a step (out of place)."""
    options = dict(kernel_bytes=1 << 20, kernel_sms=4) if world_size > 1 else {}
    comms = hoccl.init_local(world_size, backend="host", **options)
    try:
        seed, calls = 0, 0
        for dtype in ("float32", "bfloat16", "int32", "uint8", "float64"):
            for count in (0, 1, 17, 1000):
                for in_place in ((False, True) if collective in IN_PLACE else (False,)):
                    for root in ((0, world_size - 1) if collective == "broadcast" else (0,)):
                        for op in (("sum", "max", "avg", "prod", "min") if collective in REDUCING
                                   else ("sum",)):
                            seed += 1
                            # a world of one in place has no step, so no kernel (an
                            # empty buffer is never in place)
                            calls += world_size > 1 or not in_place or not count
                            check_collective(comms, collective, count=count, dtype=dtype,
                                             op=op, root=root, in_place=in_place, seed=seed)
        if collective in REDUCING:
            check_collective(comms, collective, count=333, dtype="bfloat16", scale=0.25,
                             seed=seed + 1)
            calls += 1
        # every call was one direct kernel on every rank: the epochs agree, no block is
        # left counted
        assert _epochs(comms) == [[calls, 0]] * world_size
    finally:
        for comm in comms:
            comm.close()


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_ranks_may_differ_in_form(collective):
    """Rank 0 in place, rank 1 out of place: a rank names a peer's buffer only by a name
    both forms share (outputs, ``send`` of a reduce_scatter, scratch), so they agree."""
    comms = hoccl.init_local(2, backend="host", kernel_bytes=1 << 20)
    rng = np.random.default_rng(3)
    count = 37
    try:
        if collective == "all_gather":
            blocks = [rng.standard_normal(count).astype(np.float32) for _ in range(2)]
            full = np.concatenate(blocks)
            recv0 = np.full(2 * count, -7, np.float32)
            recv0[:count] = blocks[0]
            recv1 = np.full(2 * count, -7, np.float32)
            comms[0].all_gather(recv0[:count], recv0)
            comms[1].all_gather(blocks[1].copy(), recv1)
            expected = [full, full]
        elif collective == "reduce_scatter":
            inputs = [rng.integers(-9, 9, 2 * count).astype(np.float32) for _ in range(2)]
            total = inputs[0] + inputs[1]
            recv0 = inputs[0].copy()
            recv1 = np.full(count, -7, np.float32)
            comms[0].reduce_scatter(recv0, recv0[:count])
            comms[1].reduce_scatter(inputs[1].copy(), recv1)
            expected = [total[:count], total[count:]]
            recv0 = recv0[:count]
        else:
            inputs = [rng.integers(-9, 9, count).astype(np.float32) for _ in range(2)]
            recv0 = inputs[0].copy()
            recv1 = np.full(count, -7, np.float32)
            comms[0].all_reduce(recv0, recv0)
            comms[1].all_reduce(inputs[1].copy(), recv1)
            expected = [inputs[0] + inputs[1]] * 2
        for comm in comms:
            comm.synchronize()
        np.testing.assert_array_equal(recv0, expected[0])
        np.testing.assert_array_equal(recv1, expected[1])
    finally:
        for comm in comms:
            comm.close()


def test_threshold_blocks_and_options():
    """``kernel_bytes`` bounds the largest buffer; blocks grow with it up to
    ``kernel_sms``; other collectives never take the kernel; a world of one takes it up to
    ``WORLD_ONE_KERNEL_BYTES`` whatever ``kernel_bytes`` says (0 included), where it has a
    step."""
    options = Options(kernel_bytes=64 << 10, kernel_sms=4)
    small = build_plan(Shape("all_gather", 2, 8 << 10, "float32", 4), options)
    assert small.kernel_blocks == 2 and small.lanes == 1 and small.uses_sms(0)
    large = build_plan(Shape("all_gather", 2, (8 << 10) + 1, "float32", 4), options)
    assert large.kernel_blocks == 0
    assert build_plan(Shape("all_reduce", 2, 16 << 10, "float32", 4), options).kernel_blocks == 2
    capped = Options(kernel_bytes=1 << 20, kernel_sms=4)
    assert build_plan(Shape("all_reduce", 2, 1 << 18, "float32", 4), capped).kernel_blocks == 4
    assert build_plan(Shape("reduce", 2, 16, "float32", 4), options).kernel_blocks == 0
    assert build_plan(Shape("all_gather", 1, 16, "float32", 4), options).kernel_blocks == 1
    one = WORLD_ONE_KERNEL_BYTES // 4
    for given in (Options(), options):
        assert build_plan(Shape("all_gather", 1, one, "float32", 4), given).kernel_blocks > 0
        assert build_plan(Shape("all_gather", 1, one + 1, "float32", 4), given).kernel_blocks == 0
        assert build_plan(Shape("reduce", 1, 16, "float32", 4), given).kernel_blocks == 0
        scaled = Shape("all_reduce", 1, 16, "float32", 4, in_place=True, scale=0.5)
        assert build_plan(scaled, given).kernel_blocks == 1
    # in place a world of one has nothing to do but the completion: no launch, unless
    # ``kernel_bytes`` asks for one
    for collective in ("all_gather", "broadcast", "all_reduce", "reduce_scatter"):
        quiet = Shape(collective, 1, 16, "float32", 4, in_place=True)
        assert build_plan(quiet, Options()).kernel_blocks == 0
        assert build_plan(quiet, options).kernel_blocks == 1
    assert build_plan(Shape("all_gather", 8, 16, "float32", 4), options).kernel_blocks == 1
    assert build_plan(Shape("all_gather", 9, 16, "float32", 4), options).kernel_blocks == 0
    assert build_plan(Shape("all_gather", 2, 16, "float32", 4), Options()).kernel_blocks == 0
    for bad in (0, KERNEL_MAX_BLOCKS + 1, True):
        with pytest.raises(InvalidArgumentError, match="kernel_sms"):
            Options(kernel_sms=bad)
    with pytest.raises(InvalidArgumentError, match="kernel_bytes"):
        Options(kernel_bytes=-1)


def test_block_shares_cover_every_byte_once_in_whole_16_byte_units():
    for nbytes in (0, 1, 15, 16, 17, 1000, 4096, 65537):
        for blocks in (1, 2, 3, 7, 32):
            shares = [block_range(nbytes, blocks, block) for block in range(blocks)]
            assert shares[0][0] == 0 and shares[-1][1] == nbytes
            for (_, stop), (start, _) in zip(shares, shares[1:]):
                assert stop == start and start % 16 == 0


def test_a_kernel_waiting_for_a_peer_times_out_naming_the_missing_signal():
    """Rank 1's stream never reaches the call within the timeout: rank 0's kernel waits
    for rank 1's DONE (rank 1 never stored into rank 0's ring) in its kernel slots; the
    timeout names them, and every rank is released (no hang)."""
    comms = hoccl.init_local(2, backend="host", timeout=2, kernel_bytes=1 << 20)
    for comm in comms:  # synchronize's own timeout: the watchdogs (same clock, started
        comm._health._stop.set()  # at issue) would abort first and raise AbortedError
    held = comms[1].device_handle.create_stream()
    held.enqueue(lambda: time.sleep(5))
    send = [np.full(8, r + 1, np.float32) for r in range(2)]
    recv = [np.zeros(16, np.float32) for _ in range(2)]
    comms[0].all_gather(send[0], recv[0])
    comms[1].all_gather(send[1], recv[1], stream=held)
    started = time.monotonic()
    with pytest.raises(HocclTimeoutError, match=r"rank 1 DONE \(direct kernel: have 0, need 1\)"):
        comms[0].synchronize()
    assert time.monotonic() - started < 30
    for comm in comms:
        comm.close()


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "broadcast"])
def test_back_to_back_calls_with_one_rank_running_ahead(monkeypatch, collective):
    """Calls without a synchronize between them; rank 1 reads its ring slowly (its lane's
    reads out of the ring sleep first), so rank 0 runs a call ahead and stores into rank
    1's ring while rank 1 still reads the other half (the epoch's parity: with one half
    only, the all_reduce and all_gather cases fail; a broadcast's root waits for its
    receivers anyway); every output exact."""
    import hoccl.backends.host as host
    comms = hoccl.init_local(2, backend="host", kernel_bytes=1 << 20, kernel_sms=2)
    comms[1].device_handle.default_stream  # noqa: B018 - made before its lane is found
    slow = set()

    def slowed(function):
        def wrapper(*args, **kwargs):
            if threading.current_thread() in slow:
                time.sleep(0.003)
            return function(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(host, "reduce_arrays", slowed(host.reduce_arrays))
    monkeypatch.setattr(host, "block_range", slowed(host.block_range))
    rng = np.random.default_rng(11)
    count, calls = 300, 12
    try:
        sends = [[rng.integers(-50, 50, count).astype(np.float32) for _ in range(2)]
                 for _ in range(calls)]
        recvs = [[np.full(2 * count if collective == "all_gather" else count, -7, np.float32)
                  for _ in range(2)] for _ in range(calls)]
        for call in range(calls):
            for rank, comm in enumerate(comms):
                send, recv = sends[call][rank], recvs[call][rank]
                if collective == "all_reduce":
                    comm.all_reduce(send, recv)
                elif collective == "all_gather":
                    comm.all_gather(send, recv)
                else:
                    comm.broadcast(send, recv, 0)
            if call == 0:  # rank 1's lane exists now
                slow.add(comms[1]._engine.streams.lanes[0]._worker._thread)
        for comm in comms:
            comm.synchronize()
        for call in range(calls):
            a, b = sends[call]
            expected = {"all_reduce": a + b, "all_gather": np.concatenate([a, b]),
                        "broadcast": a}[collective]
            for rank in range(2):
                np.testing.assert_array_equal(recvs[call][rank], expected, f"call {call}")
        assert _epochs(comms) == [[calls, 0]] * 2
    finally:
        for comm in comms:
            comm.close()


def test_verify_rejects_a_ring_writer_that_never_hears_from_the_rings_owner():
    """A broadcast's root stores into the receivers' rings and would otherwise hear from
    nobody: without its waits for their second signal it could run two calls ahead and
    overwrite a half still being read; verify says so."""
    from dataclasses import replace

    from hoccl._errors import PlanError
    from hoccl.sched import verify
    from hoccl.sched.plan import GATHERED, CHANNELS, Wait
    plan = build_plan(Shape("broadcast", 3, 5, "float32", 4, root=0),
                      Options(kernel_bytes=1 << 20))
    verify(plan)
    root = [step for step in plan.programs[0]
            if not (isinstance(step, Wait) and step.slot % CHANNELS == GATHERED)]
    assert len(root) == len(plan.programs[0]) - 2
    receivers = [tuple(step for step in program if step.__class__.__name__ != "Signal"
                       or step.slot % CHANNELS != GATHERED) for program in plan.programs[1:]]
    mutant = replace(plan, programs=(tuple(root), *receivers))
    with pytest.raises(PlanError, match="finishes the call hearing from rank 1 nowhere in it"):
        verify(mutant)


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_verify_rejects_a_broadcast_whose_receivers_finish_without_hearing_each_other(
        world_size):
    """A root that sends its DONE before it waits for the receivers' start signals lets a
    receiver finish the broadcast while another is still in the call before, run the next
    call too, and overwrite the ring half and signature words the slow receiver still
    reads (false DivergedErrors in sequences of small calls).  The plan waits first;
    moving the root's waits after its DONE signals is rejected."""
    from dataclasses import replace

    from hoccl._errors import PlanError
    from hoccl.sched import verify
    from hoccl.sched.plan import GATHERED, CHANNELS, Wait
    plan = build_plan(Shape("broadcast", world_size, 5, "float32", 4, root=1),
                      Options(kernel_bytes=1 << 20))
    verify(plan)
    root = plan.programs[1]
    waits = [step for step in root if isinstance(step, Wait) and step.slot % CHANNELS == GATHERED]
    assert len(waits) == world_size - 1
    late = tuple(step for step in root if step not in waits) + tuple(waits)
    mutant = replace(plan, programs=tuple(late if rank == 1 else program
                                          for rank, program in enumerate(plan.programs)))
    with pytest.raises(PlanError, match=r"rank [02] exit fence: finishes the call hearing "
                                        r"from rank [023] nowhere in it"):
        verify(mutant)


@pytest.mark.parametrize("collective", sorted(KERNEL_COLLECTIVES))
@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_every_direct_plan_finishes_each_rank_after_every_rank_started(collective, world_size):
    """The rule ``plan.RING`` rests on, for every direct plan (verify checks it): every
    rank's exit follows, through signals, every other rank's entry; zero counts too."""
    from hoccl.sched import verify
    for count in (0, 1, 7):
        for root in range(world_size) if collective == "broadcast" else (0,):
            for in_place in (False, True):
                shape = Shape(collective, world_size, count, "float32", 4, root=root,
                              in_place=in_place)
                plan = build_plan(shape, Options(kernel_bytes=1 << 20))
                assert plan.kernel_blocks, shape
                verify(plan)


@pytest.mark.parametrize("collective", sorted(KERNEL_COLLECTIVES))
def test_zero_size_calls_take_no_direct_kernel_when_the_path_is_off(collective):
    """kernel_bytes=0 (the default) is off for every size, an empty buffer's included."""
    plan = build_plan(Shape(collective, 3, 0, "float32", 4), Options())
    assert not plan.kernel_blocks
    assert build_plan(Shape(collective, 3, 0, "float32", 4), Options(kernel_bytes=64)).kernel_blocks
