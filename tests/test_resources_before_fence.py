"""Streams and events are created before a caller's stream is fenced, never while it waits.

Creating a CUDA stream or event may synchronize the context.  From the moment a call
fences its caller's stream (the caller waits for the call's completion value) until the
call is issued, such a driver call would wait for the call itself: FSDP2's first backward
reduce-scatter, the first call to need a second lane, hung in ``cuStreamCreate`` so.
These tests record the host device's calls and check the order on every rank.
"""

import numpy as np
import pytest

import hoccl
from hoccl.testing import assert_exact, poison, random_array

CREATES = ("create_stream", "create_event")


def _record(comm, log):
    """Log ``(rank, what)``: the creating calls, waits on caller streams (the fences:
    lanes are the only other streams that wait) and the end of each issue."""
    engine = comm._engine
    device = engine.device
    lanes = engine.streams.lanes
    original_issue = engine.executor.issue

    def issue(*args, **kwargs):
        original_issue(*args, **kwargs)
        log.append((comm.rank, "issued"))
    engine.executor.issue = issue
    for name in CREATES:
        original = getattr(device, name)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            log.append((comm.rank, _name))
            return _original(*args, **kwargs)
        setattr(device, name, wrapper)
    original_wait = device.wait_value

    def wait_value(stream, address, value, _original=original_wait):
        if not any(stream is lane for lane in lanes):
            log.append((comm.rank, "fence"))
        return _original(stream, address, value)
    device.wait_value = wait_value


def _created_while_fenced(log, rank):
    """Whether ``rank`` created a stream or event between a fence and the next issue."""
    fenced = False
    for who, what in log:
        if who != rank:
            continue
        if what == "fence":
            fenced = True
        elif what == "issued":
            fenced = False
        elif fenced:
            return True
    return False


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce", "all_to_all"])
def test_first_calls_create_their_lanes_before_the_fence(init_local, collective):
    comms = init_local(3, backend="host")
    log = []
    for comm in comms:
        _record(comm, log)
    n, count = len(comms), 1000
    rng = np.random.default_rng()
    sends = [random_array(rng, count * n, "int32") for _ in comms]
    total = np.sum(sends, axis=0, dtype=np.int32)
    for _ in range(2):  # the first calls create; the second find everything made
        outputs = [poison(count * (1 if collective == "reduce_scatter" else n), "int32")
                   for _ in comms]
        for comm in comms:
            if collective == "all_to_all":
                comm.all_to_all(sends[comm.rank], outputs[comm.rank])
            elif collective == "all_reduce":
                comm.all_reduce(sends[comm.rank], outputs[comm.rank], "sum")
            else:
                comm.reduce_scatter(sends[comm.rank], outputs[comm.rank], "sum")
        for comm in comms:
            comm.synchronize()
        for comm in comms:
            r = comm.rank
            want = {"reduce_scatter": total[r * count:(r + 1) * count], "all_reduce": total,
                    "all_to_all": np.concatenate([s[r * count:(r + 1) * count] for s in sends])}
            assert_exact(f"{collective} rank {r}", want[collective], outputs[r])
    assert any(what == "create_stream" for _, what in log), "no lane was created at all"
    assert any(what == "fence" for _, what in log), "no caller stream was fenced"
    for comm in comms:
        assert not _created_while_fenced(log, comm.rank), (comm.rank, log)


def test_a_group_creates_every_lane_before_fencing_its_callers(init_local):
    comms = init_local(3, backend="host")
    log = []
    for comm in comms:
        _record(comm, log)
    n = len(comms)
    rng = np.random.default_rng()
    sends = [random_array(rng, 64, "int32") for _ in comms]
    received = [poison(64, "int32") for _ in comms]
    gathered = [poison(64 * n, "int32") for _ in comms]
    with hoccl.group():
        for comm in comms:  # a ring of send/recv beside an all_gather: three families
            comm.send(sends[comm.rank], (comm.rank + 1) % n)
            comm.recv(received[comm.rank], (comm.rank - 1) % n)
            comm.all_gather(sends[comm.rank], gathered[comm.rank])
    for comm in comms:
        comm.synchronize()
    for comm in comms:
        assert not _created_while_fenced(log, comm.rank), (comm.rank, log)
        assert_exact("recv", sends[(comm.rank - 1) % n], received[comm.rank])
        assert_exact("all_gather", np.concatenate(sends), gathered[comm.rank])


@pytest.mark.parametrize("world,options", [(1, {}), (3, {"kernel_bytes": 1 << 20})])
def test_a_direct_kernel_is_loaded_before_the_fence(init_local, world, options):
    """One process driving its ranks issues a direct kernel from the lanes, its callers
    fenced first: loading the kernel may synchronize the context, so it is loaded before
    the fence (a world of one takes the kernel by itself; three ranks with
    ``kernel_bytes``), never while a caller waits."""
    comms = init_local(world, backend="host", **options)
    log = []
    for comm in comms:
        _record(comm, log)
        device = comm._engine.device
        original = device.prepare_direct

        def prepare_direct(*args, _original=original, _rank=comm.rank):
            log.append((_rank, "prepare_direct"))
            return _original(*args)
        device.prepare_direct = prepare_direct
    n, count = len(comms), 1000
    rng = np.random.default_rng()
    for _ in range(2):
        sends = [random_array(rng, count, "float32") for _ in comms]
        outputs = [poison(count * n, "float32") for _ in comms]
        for comm in comms:
            comm.all_gather(sends[comm.rank], outputs[comm.rank])
        for comm in comms:
            comm.synchronize()
            assert_exact(f"all_gather rank {comm.rank}", np.concatenate(sends),
                         outputs[comm.rank])
    for comm in comms:
        mine = [what for who, what in log if who == comm.rank]
        assert "prepare_direct" in mine and "fence" in mine, mine
        assert mine.index("prepare_direct") < mine.index("fence"), mine
        fenced = False  # and no load between a fence and the next issue
        for what in mine:
            fenced = what == "fence" or (fenced and what != "issued")
            assert not (fenced and what == "prepare_direct"), mine
        assert comm._engine.direct_calls == 0  # issued from the lanes, not on the caller
