"""Arguments of every public entry point, as a hostile but fair user passes them: each
bad one raises ``InvalidArgumentError`` whose message starts with the public call's name
and says what was expected and what was given (never numpy's bare ValueError, an
OSError, or the name of an internal helper); integers from numpy and 0-dim integer torch
tensors are integers, and then the call computes what numpy computes."""

import numpy as np
import pytest

import hoccl
from hoccl import InvalidArgumentError
from hoccl.testing import assert_exact, check_collective, expected, poison, random_array

ROOTED = ("broadcast", "reduce", "gather", "scatter")


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _integers(value):
    """``value`` as every kind of integer a user may hold."""
    kinds = [value, np.int64(value), np.int32(value)] + ([np.uint8(value)] if value < 256 else [])
    torch = _torch()
    if torch is not None:
        kinds += [torch.tensor(value), torch.tensor(value, dtype=torch.int32)]
    return kinds


def _not_integers(value):
    """Things that look like ``value`` but are not integers."""
    kinds = [float(value), np.float64(value), str(value), [value], bool(value), np.bool_(value)]
    torch = _torch()
    if torch is not None:
        kinds += [torch.tensor(bool(value)), torch.tensor([value]), torch.tensor(float(value))]
    return kinds


def _raises(call, fragments, function, *args, **kwargs):
    with pytest.raises(InvalidArgumentError) as raised:
        function(*args, **kwargs)
    message = str(raised.value)
    assert message.startswith(f"{call}: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# -- hoccl.empty and hoccl.host_empty ---------------------------------------------------
@pytest.mark.parametrize("shape", [-1, (4, -1), 2.0, "8", None, (2, None), [1 << 70]])
def test_empty_and_host_empty_refuse_shapes_that_are_not_sizes(init_local, shape):
    (comm,) = init_local(1)
    for call, make in (("empty", lambda: hoccl.empty(shape, "float32", comm)),
                       ("host_empty", lambda: hoccl.host_empty(shape, "float32"))):
        _raises(call, ["shape must be an int >= 0", repr(shape)], make)
    assert comm.windows == []


def test_empty_and_host_empty_refuse_sizes_past_any_memory(init_local):
    (comm,) = init_local(1)
    _raises("empty", ["shape 4611686018427387904", "more than any memory (2**63)"],
            hoccl.empty, 1 << 62, "float32", comm)
    _raises("host_empty", ["more than any memory"], hoccl.host_empty, (1 << 31, 1 << 31), "int64")
    assert comm.windows == []


def test_allocations_that_fail_name_the_call_and_the_size(init_local):
    """128 PiB: more than any machine's address space maps, below 2**63."""
    (comm,) = init_local(1)
    _raises("empty", ["cannot allocate 144115188075855872 bytes", "host memory", "MemoryError"],
            hoccl.empty, 1 << 55, "float32", comm)
    _raises("host_empty", ["cannot allocate 144115188075855872 bytes", "shared host memory"],
            hoccl.host_empty, 1 << 55, "float32")
    assert comm.windows == []


def test_empty_refuses_what_is_not_a_communicator():
    _raises("empty", ["comm must be a hoccl communicator; got int"], hoccl.empty, 4, "float32", 5)


def test_empty_and_host_empty_take_integer_scalars_as_sizes(init_local):
    (comm,) = init_local(1)
    for size in _integers(3):
        assert hoccl.host_empty(size, "int32").shape == (3,)
        assert hoccl.host_empty((size, 2), "int32").shape == (3, 2)
        array = hoccl.empty((2, size), "float64", comm)
        assert array.shape == (2, 3) and array.dtype == np.float64
        comm.deregister(array)


# -- roots and peers ----------------------------------------------------------------------
@pytest.mark.parametrize("collective", ROOTED)
def test_integer_scalars_are_roots(init_local, collective):
    comms = init_local(3)
    n, count, dtype = 3, 5, "int32"
    rng = np.random.default_rng()
    for root in _integers(int(rng.integers(n))):
        r0 = int(root)
        size = count * n if collective == "scatter" else count
        inputs = [random_array(rng, size, dtype) for _ in range(n)]
        if collective in ("broadcast", "scatter"):
            inputs = [x if r == r0 else None for r, x in enumerate(inputs)]
        want = expected(collective, inputs, root=r0)
        outputs = [poison(w.size, dtype) if w is not None else None for w in want]
        with hoccl.group():
            for comm in comms:
                getattr(comm, collective)(inputs[comm.rank], outputs[comm.rank], root)
        for comm in comms:
            comm.synchronize()
        for r in range(n):
            if want[r] is not None:
                assert_exact(f"{collective} root={root!r} rank {r}", want[r], outputs[r])


def test_integer_scalars_are_peers(init_local):
    comms = init_local(3)
    rng = np.random.default_rng()
    for kind in range(len(_integers(0))):
        data = [random_array(rng, 7, "int64") for _ in range(3)]
        out = [poison(7, "int64") for _ in range(3)]
        with hoccl.group():
            for comm in comms:
                r = comm.rank
                comm.send(data[r], _integers((r + 1) % 3)[kind])
                comm.recv(out[r], _integers((r - 1) % 3)[kind])
        for comm in comms:
            comm.synchronize()
        for r in range(3):
            assert_exact(f"ring rank {r}", data[(r - 1) % 3], out[r])


def test_roots_and_peers_that_are_not_integers_are_refused(init_local):
    comms = init_local(2)
    x = np.zeros(4, np.float32)
    for bad in _not_integers(1):
        _raises("broadcast", ["root must be a rank in [0, 2)", f"got {bad!r}"],
                comms[0].broadcast, x, x, bad)
        _raises("send", ["peer must be a rank in [0, 2) other than 0"], comms[0].send, x, bad)
        _raises("explain", ["root must be a rank"], comms[0].explain, "reduce", 16, root=bad)


# -- stream, scale, explain, marks ------------------------------------------------------
@pytest.mark.parametrize("stream", ["foo", 3.5, object()])
def test_a_bad_stream_names_the_public_call(init_local, stream):
    comms = init_local(2)
    x = np.zeros(4, np.float32)
    # every rank makes each refused call, as a program does (a refused call keeps its
    # place in every rank's sequence of calls)
    calls = [("all_reduce", lambda c: c.all_reduce(x, x, stream=stream)),
             ("barrier", lambda c: c.barrier(stream=stream)),
             ("send", lambda c: c.send(x, 1 - c.rank, stream=stream)),
             ("broadcast", lambda c: c.broadcast(x if c.rank == 0 else None, x, 0,
                                                 stream=stream))]
    for call, make in calls:
        for comm in comms:
            message = _raises(call, ["stream"], lambda: make(comm))
            assert "resolve_stream" not in message, message
    comms[0].all_reduce(x, x)
    comms[1].all_reduce(x, x)
    mark = comms[0].calls
    message = _raises("order_after", ["stream"], comms[0].order_after, mark, stream=stream)
    assert "resolve_stream" not in message
    for comm in comms:
        comm.synchronize()


@pytest.mark.parametrize("scale", ["2", b"2", True, np.bool_(True), [2.0], None, float("nan"),
                                   float("inf"), 1e309])
def test_scales_that_are_not_finite_real_numbers_are_refused(init_local, scale):
    if scale is None:
        torch = pytest.importorskip("torch")
        scale = torch.tensor(True)
    comms = init_local(2)
    x = np.ones(4, np.float32)
    for call, make in (("all_reduce", lambda: comms[0].all_reduce(x, x, scale=scale)),
                       ("reduce_scatter", lambda: comms[0].reduce_scatter(
                           np.ones(8, np.float32), x, scale=scale)),
                       ("reduce", lambda: comms[0].reduce(x, x, 0, scale=scale))):
        _raises(call, ["scale must be a finite real number", f"got {scale!r}"], make)
    for comm in comms:
        comm.synchronize()


def test_real_number_scalars_are_scales(init_local):
    comms = init_local(2)
    rng = np.random.default_rng()
    torch = _torch()
    scales = [2, 0.5, np.float32(0.25), np.int64(4)] + ([torch.tensor(0.5)] if torch else [])
    for scale in scales:
        inputs = [random_array(rng, 6, "float32") for _ in range(2)]
        want = expected("all_reduce", inputs, scale=float(scale))
        outputs = [poison(6, "float32") for _ in range(2)]
        for comm in comms:
            comm.all_reduce(inputs[comm.rank], outputs[comm.rank], scale=scale)
        for comm in comms:
            comm.synchronize()
            assert_exact(f"scale={scale!r} rank {comm.rank}", want[comm.rank], outputs[comm.rank])


def test_explain_refuses_sizes_past_any_memory_and_takes_integer_scalars(init_local):
    (comm,) = init_local(1)
    _raises("explain", ["nbytes must be an int >= 0", "below 2**63", f"got {1 << 70}"],
            comm.explain, "all_reduce", 1 << 70)
    _raises("explain", ["nbytes must be"], comm.explain, "all_reduce", 1024.0)
    _raises("explain", ["in_place must be True or False", "got 'yes'"], comm.explain,
            "all_reduce", 1024, in_place="yes")
    _raises("explain", ["dtype must be one of", "got None"], comm.explain, "all_reduce", 1024,
            dtype=None)
    for nbytes in _integers(64):
        assert comm.explain("all_reduce", nbytes) == comm.explain("all_reduce", 64)
    torch = _torch()
    if torch is not None:
        assert comm.explain("all_gather", 64, torch.float16) == \
            comm.explain("all_gather", 64, "float16")
        _raises("explain", ["dtype must be one of"], comm.explain, "all_reduce", 1024,
                dtype=torch.tensor(1))


def test_marks_must_be_integers(init_local):
    (comm,) = init_local(1)
    for bad in ("1", None, 1.0, [1]):
        _raises("finished", ["mark must be an int", repr(bad)], comm.finished, bad)
        _raises("order_after", ["mark must be an int", repr(bad)], comm.order_after, bad)
    for mark in _integers(0):
        assert comm.finished(mark) is True
        comm.order_after(mark)


# -- synchronize inside a group ----------------------------------------------------------
def test_synchronize_inside_a_group_says_to_synchronize_after_it(init_local):
    comms = init_local(3)
    x = [np.ones(4, np.float32) for _ in comms]
    with pytest.raises(InvalidArgumentError) as raised:
        with hoccl.group():
            for comm in comms:
                comm.all_reduce(x[comm.rank], x[comm.rank])
            comms[0].synchronize()
    message = str(raised.value)
    assert message.startswith("synchronize: rank 0 has 1 call(s) held in the enclosing "
                              "hoccl.group() (all_reduce)"), message
    assert "synchronize after the group" in message and "init_local" not in message
    # the group's calls were abandoned on every rank alike: none ran, the ranks still agree
    for comm in comms:
        comm.synchronize()
        assert (x[comm.rank] == 1).all(), f"rank {comm.rank} ran an abandoned all_reduce"
    rng = np.random.default_rng()
    inputs = [random_array(rng, 9, "int64") for _ in comms]
    outputs = [poison(9, "int64") for _ in comms]
    with hoccl.group():
        for comm in comms:
            comm.all_reduce(inputs[comm.rank], outputs[comm.rank])
    for comm in comms:
        comm.synchronize()
        assert_exact(f"rank {comm.rank}", expected("all_reduce", inputs)[comm.rank],
                     outputs[comm.rank])


def test_close_inside_a_group_holding_its_calls_raises_and_closes_nothing(init_local):
    """``close`` cannot hand over calls the group still holds: it raises naming them, the
    group is abandoned on every rank alike (none runs), and the communicators go on."""
    comms = init_local(2)
    x = [np.ones(4, np.float32) for _ in comms]
    with pytest.raises(InvalidArgumentError) as raised:
        with hoccl.group():
            for comm in comms:
                comm.all_reduce(x[comm.rank], x[comm.rank])
            comms[0].close()
    message = str(raised.value)
    assert message.startswith("close: rank 0 has 1 call(s) held in the enclosing "
                              "hoccl.group() (all_reduce)") and "close after the group" in message
    for comm in comms:
        comm.synchronize()
        assert not comm.closed and (x[comm.rank] == 1).all(), f"rank {comm.rank}"
    check_collective(comms, "all_reduce", count=7, dtype="int32", seed=5)


# -- init_local and split_local -----------------------------------------------------------
def test_init_local_and_split_local_take_integer_scalars(init_local):
    torch = _torch()
    for n in _integers(2):
        comms = init_local(n)
        assert [comm.world_size for comm in comms] == [2, 2]
    comms = init_local([np.int64(0), np.int32(1), 2])
    assert [comm.rank for comm in comms] == [0, 1, 2]
    colors = [np.int64(5), np.int64(5), np.int64(7)]
    if torch is not None:  # two tensors of one value are one color, not two objects
        colors = [torch.tensor(5), torch.tensor(5), torch.tensor(7)]
    children = hoccl.split_local(comms, colors, [np.int32(1), np.int32(0), None])
    try:
        assert [child.world_size for child in children] == [2, 2, 1]
        assert [child.rank for child in children] == [1, 0, 0]
    finally:
        for child in children:
            child.close()
    _raises("split_local", ["color must be an int in [0, 2**31)", "2.0"], hoccl.split_local,
            comms, [2.0, 2.0, 2.0])
    _raises("init_local", ["expected a rank count", "2.0"], hoccl.init_local, 2.0)


# -- settings ------------------------------------------------------------------------------
def test_settings_take_integer_and_real_scalars(init_local):
    (comm,) = init_local(1, max_sms=np.int64(4), timeout=np.float32(30))
    assert (comm.max_sms, comm.timeout) == (4, 30.0)
    assert type(comm.config.max_sms) is int and type(comm.config.timeout) is float
    for size in _integers(4096):
        comm.set_options(chunk_bytes=size, kernel_sms=_integers(2)[0])
        assert comm.config.chunk_bytes == 4096 and type(comm.config.chunk_bytes) is int
    config = hoccl.Config(copy_lanes=np.int32(2), stage_bytes=np.uint64(1 << 20))
    assert (config.copy_lanes, config.stage_bytes) == (2, 1 << 20)
    for bad in _not_integers(4):
        _raises("set_options", ["max_sms must be a positive int", repr(bad)], comm.set_options,
                max_sms=bad)
    for bad in ("30", True, float("nan"), -1):
        _raises("set_options", ["timeout must be a positive number of seconds"],
                comm.set_options, timeout=bad)


class _OneRank:
    """A bootstrap of one rank (``hoccl.Bootstrap``): init without MPI."""
    rank, world_size = 0, 1

    def allgather(self, value):
        return [value]

    def barrier(self):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("device", ["x", -1, 1.5, True, [0]])
def test_init_refuses_devices_that_are_not_ordinals(device):
    _raises("init", ["device must be a CUDA ordinal", repr(device)], hoccl.init, backend="host",
            bootstrap=_OneRank(), device=device)


def test_init_takes_integer_scalars_as_local_size_and_device():
    for value in _integers(0)[1:]:
        comm = hoccl.init(backend="host", bootstrap=_OneRank(), device=value,
                          local_size=_integers(1)[1])
        try:
            rng = np.random.default_rng()
            data, out = random_array(rng, 5, "float32"), poison(5, "float32")
            comm.all_reduce(data, out)
            comm.synchronize()
            assert_exact("one rank", data, out)
        finally:
            comm.close()


def test_numpy_bools_are_flags(init_local):
    (comm,) = init_local(1)
    assert comm.explain("all_reduce", 64, in_place=np.bool_(True)) == \
        comm.explain("all_reduce", 64, in_place=True)
    _raises("explain", ["in_place must be True or False", "got 1"], comm.explain, "all_reduce",
            64, in_place=1)


def test_empty_on_a_closed_communicator_names_empty(init_local):
    (comm,) = init_local(1)
    comm.close()
    _raises("empty", ["the communicator is closed"], hoccl.empty, 4, "float32", comm)
