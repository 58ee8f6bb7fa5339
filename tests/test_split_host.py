"""Communicator.split and hoccl.split_local on the host backend: the children's
collectives, calls on parent and child in flight together, key order, NOCOLOR ranks,
shared devices with caps and pads of their own, closing and aborting in any order."""

import pytest

import hoccl
from hoccl.testing import check_collective, check_interleaved


def children_in_rank_order(children):
    """The non-None children grouped by communicator, each group in child rank order."""
    groups = {}
    for child in children:
        if child is not None:
            groups.setdefault(id(child._group), []).append(child)
    return [sorted(group, key=lambda comm: comm.rank) for group in groups.values()]


@pytest.fixture
def split_local():
    """``hoccl.split_local`` whose children are closed when the test ends."""
    made = []

    def split(*args, **kwargs):
        children = hoccl.split_local(*args, **kwargs)
        made.extend(child for child in children if child is not None)
        return children
    yield split
    for child in made:
        child.close()


@pytest.mark.parametrize("world_size", [3, 4])
def test_even_and_odd_children_run_collectives_exactly(init_local, split_local, world_size):
    parents = init_local(world_size, backend="host")
    children = split_local(parents, [rank % 2 for rank in range(world_size)])
    groups = children_in_rank_order(children)
    assert sorted(len(group) for group in groups) == sorted([(world_size + 1) // 2,
                                                            world_size // 2])
    for rank, child in enumerate(children):
        assert (child.rank, child.world_size) == (rank // 2, len(range(rank % 2, world_size, 2)))
    seed = 0
    for group in groups:
        for collective, op in [("all_gather", "sum"), ("reduce_scatter", "sum"),
                               ("all_reduce", "sum"), ("all_reduce", "avg"),
                               ("send_recv", "sum")]:
            for dtype in ("float32", "int32"):
                seed += 1
                check_collective(group, collective, count=37, dtype=dtype, op=op, seed=seed)


def test_nocolor_ranks_get_none_and_the_rest_one_communicator(init_local, split_local):
    parents = init_local(4, backend="host")
    children = split_local(parents, [None, 7, 7, 7])
    assert children[0] is None
    group = children[1:]
    assert [(child.rank, child.world_size) for child in group] == [(0, 3), (1, 3), (2, 3)]
    for seed, (collective, op) in enumerate([("all_gather", "sum"), ("reduce_scatter", "sum"),
                                             ("all_reduce", "avg"), ("send_recv", "sum")]):
        check_collective(group, collective, count=23, dtype="float32", op=op, seed=seed)
    assert split_local(parents, [None] * 4) == [None] * 4


def test_calls_on_parent_and_children_in_flight_together_do_not_interfere(init_local,
                                                                          split_local):
    parents = init_local(4, backend="host")
    even_odd = children_in_rank_order(split_local(parents, [rank % 2 for rank in range(4)]))
    steps = [(parents, "all_reduce", "sum"), (even_odd[0], "all_gather", "sum"),
             (parents, "reduce_scatter", "sum"), (even_odd[1], "all_reduce", "avg"),
             (even_odd[0], "reduce_scatter", "sum"), (parents, "all_gather", "sum"),
             (even_odd[1], "send_recv", "sum"), (parents, "all_reduce", "avg")]
    for dtype in ("float32", "int64"):
        check_interleaved(steps, count=41, dtype=dtype, seed=5)
    for child, parent in zip(even_odd[0], parents[::2]):
        assert child._engine.pad.address != parent._engine.pad.address
        assert not set(map(id, child._engine.streams.lanes)) & set(
            map(id, parent._engine.streams.lanes))


def test_interleaved_check_fails_on_a_call_that_writes_nothing(init_local):
    class Astray:
        """A rank whose all_gather writes elsewhere: the checked output stays poison."""
        def __init__(self, comm):
            self.comm = comm

        def __getattr__(self, name):
            return getattr(self.comm, name)

        def all_gather(self, send, recv, *, stream=None):
            self.comm.all_gather(send, recv.copy(), stream=stream)

    parents = init_local(2, backend="host")
    with pytest.raises(AssertionError, match="step 1 all_gather sum: rank 1 of 2: .* unwritten"):
        check_interleaved([(parents, "all_reduce", "sum"),
                           ([parents[0], Astray(parents[1])], "all_gather", "sum")],
                          count=8, dtype="float32")


def test_keys_order_the_child_ranks(init_local, split_local):
    parents = init_local(4, backend="host")
    children = split_local(parents, [0, 0, 0, 0], [30, 20, 20, 10])
    # key ties broken by parent rank: parent 3, then 1 and 2, then 0
    assert [child.rank for child in children] == [3, 1, 2, 0]
    in_order = children_in_rank_order(children)[0]
    check_collective(in_order, "all_gather", count=5, dtype="int32", seed=3)
    import numpy as np
    send = [np.full(2, parent, dtype=np.int32) for parent in range(4)]
    recv = [np.zeros(8, dtype=np.int32) for _ in range(4)]
    for parent, child in enumerate(children):
        child.all_gather(send[parent], recv[parent])
    for child in children:
        child.synchronize()
    assert recv[0].tolist() == [3, 3, 1, 1, 2, 2, 0, 0]


def test_child_shares_the_device_but_not_caps_options_or_timeout(init_local, split_local):
    parents = init_local(2, backend="host", max_sms=6, chunk_bytes=4096)
    plain = split_local(parents, [0, 0])
    assert [child.device_handle for child in plain] == [p.device_handle for p in parents]
    assert (plain[0].max_sms, plain[0].copy_sms, plain[0].timeout) == \
        (6, parents[0].copy_sms, parents[0].timeout)
    assert plain[0].options == parents[0].options and plain[0].backend == "host"
    tuned = split_local(parents, [0, 0], max_sms=3, copy_sms=2, timeout=30,
                        chunk_bytes=1 << 20)
    assert (tuned[0].max_sms, tuned[0].copy_sms, tuned[0].timeout) == (3, 2, 30)
    assert tuned[0].options.chunk_bytes == 1 << 20 and parents[0].options.chunk_bytes == 4096
    tuned[0].set_options(max_sms=1)
    assert (tuned[0].max_sms, parents[0].max_sms, plain[0].max_sms) == (1, 6, 6)


def test_each_communicator_passes_its_own_sm_cap_to_the_shared_device(init_local, split_local,
                                                                     monkeypatch):
    parents = init_local(2, backend="host", max_sms=6)
    children = split_local(parents, [0, 0], max_sms=3)
    seen = []
    device = parents[0].device_handle
    reduce = device.reduce

    def recording(stream, output, inputs, count, dtype, op, divisor=None, sms=None,
                  scale=None):
        seen.append(sms)
        reduce(stream, output, inputs, count, dtype, op, divisor, sms=sms, scale=scale)
    monkeypatch.setattr(device, "reduce", recording)
    check_collective(parents, "all_reduce", count=16, dtype="float32", seed=1)
    parent_caps, seen[:] = set(seen), []
    check_collective(children, "all_reduce", count=16, dtype="float32", seed=2)
    assert (parent_caps, set(seen)) == ({6}, {3})


def test_closing_children_then_parent_and_parent_first_both_work(init_local, split_local):
    parents = init_local(3, backend="host")
    first = split_local(parents, [0, 0, 1])
    for child in first:
        child.close()
        assert child.closed
    assert not parents[0].device_handle._closed
    check_collective(parents, "all_reduce", count=9, dtype="float32", seed=1)
    second = split_local(parents, [0, 0, 0])
    for parent in parents:
        parent.close()
    assert not parents[0].device_handle._closed  # the children still use it
    check_collective(second, "all_gather", count=9, dtype="float32", seed=2)
    for child in second:
        child.close()
    assert all(parent.device_handle._closed for parent in parents)


def test_aborting_a_child_leaves_the_parent_usable(init_local, split_local):
    parents = init_local(2, backend="host")
    children = split_local(parents, [0, 0])
    children[0].abort("test")
    assert all(child.aborted for child in children)
    with pytest.raises(hoccl.AbortedError, match="all_reduce: the communicator was aborted"):
        check_collective(children, "all_reduce", count=4, dtype="float32")
    assert not any(parent.aborted for parent in parents)
    check_collective(parents, "all_reduce", count=17, dtype="float32", seed=4)


def test_aborting_the_parent_aborts_its_children(init_local, split_local):
    parents = init_local(2, backend="host")
    children = split_local(parents, [0, 0])
    grandchildren = split_local(children, [0, None])
    parents[1].abort("test")
    assert all(comm.aborted for comm in children + grandchildren[:1])
    with pytest.raises(hoccl.AbortedError):
        children[0].split(0)


def test_split_arguments_are_checked(init_local, split_local):
    parents = init_local(2, backend="host")
    with pytest.raises(hoccl.InvalidArgumentError, match=r"split_local: color must be an int "
                                                         r"in \[0, 2\*\*31\) or None"):
        split_local(parents, [0, "a"])
    with pytest.raises(hoccl.InvalidArgumentError, match="split_local: color"):
        split_local(parents, [0, -1])
    with pytest.raises(hoccl.InvalidArgumentError, match="split_local: key must be an int"):
        split_local(parents, [0, 0], [1.5, 0])
    with pytest.raises(hoccl.InvalidArgumentError, match="split_local: expected one color"):
        split_local(parents, [0])
    with pytest.raises(hoccl.InvalidArgumentError, match="split_local: comms must be every"):
        split_local(parents[::-1], [0, 0])
    with pytest.raises(hoccl.InvalidArgumentError, match="split_local: max_sms must be"):
        split_local(parents, [0, 0], max_sms=0)
    with pytest.raises(hoccl.InvalidArgumentError, match="split_local: unknown settings"):
        split_local(parents, [0, 0], chunk=3)
    with pytest.raises(hoccl.InvalidArgumentError, match="split: the ranks of init_local .* "
                                                         "hoccl.split_local"):
        parents[0].split(0)
    with pytest.raises(hoccl.InvalidArgumentError, match="split: not inside hoccl.group"):
        with hoccl.group():
            parents[0].split(0)
    parents[0].close()
    with pytest.raises(hoccl.InvalidArgumentError, match="split: the communicator is closed"):
        parents[0].split(0)
    with pytest.raises(hoccl.InvalidArgumentError, match="split_local: the communicator is "
                                                         "closed"):
        split_local(parents, [0, 0])
