"""A pushed reduction's chunk sums as one launch (``fuse_sums``, ``Device.reduce_chunks``),
without a GPU: the executor's rewriting of a program is the program it replaces, step
for step; the host backend's launch waits for every chunk's signal and stops at an
abort's value; reductions come out the same with and without it."""

import time

import numpy as np
import pytest

import hoccl
from hoccl import InvalidArgumentError
from hoccl._dtypes import ITEMSIZE
from hoccl._engine import ABORT_VALUE
from hoccl.backends.host import HostDevice
from hoccl.p2p import _CHUNKS, _REDUCE, _WAIT, Executor, compile_program
from hoccl.sched import Options, Shape, build_plan
from hoccl.sched.plan import CHANNELS, DONE
from hoccl.testing import poison


def _expanded(program):
    """``program`` with every ``_CHUNKS`` op written out as the waits and sums it does."""
    ops = []
    for kind, lane, arg in program:
        if kind != _CHUNKS:
            ops.append((kind, lane, arg))
            continue
        slots, value, inputs, output, count, last_count, chunks, stride, dtype, op, scale, sms = arg
        shift = stride * ITEMSIZE[dtype]
        for k in range(chunks):
            ops.extend((_WAIT, lane, (slot, value + k)) for slot in slots)
            ops.append((_REDUCE, lane, (
                tuple((ref[0], ref[1], ref[2] + k * shift) for ref in inputs),
                (output[0], output[1], output[2] + k * shift),
                last_count if k == chunks - 1 else count, dtype, op, scale, sms)))
    return ops


def _by_lane(ops):
    lanes = {}
    for op in ops:
        lanes.setdefault(op[1], []).append(op)
    return lanes


SHAPES = [(collective, world, count, dtype, in_place, chunk)
          for collective in ("reduce_scatter", "reduce", "all_reduce")
          for world in (2, 3, 5)
          for count, dtype in ((1003, "float32"), (4096, "bfloat16"), (77, "int8"),
                               (300, "float64"))
          for in_place in (False, True)
          for chunk in (16, 48, 64, 1000, 1 << 20)]


@pytest.mark.parametrize("collective,world,count,dtype,in_place,chunk", SHAPES)
def test_a_fused_program_is_the_program_it_replaces(collective, world, count, dtype, in_place,
                                                    chunk):
    """Lane by lane, the fused program written out is the unfused one: the same waits (slot
    and value) and the same sums (addresses, counts, dtype, op, scale), in the same order."""
    shape = Shape(collective, world, count, dtype, ITEMSIZE[dtype], op="sum",
                  in_place=in_place, root=world - 1,
                  scale=0.5 if dtype in ("float32", "bfloat16") else None)
    plan = build_plan(shape, Options(chunk_bytes=chunk))
    for rank in range(world):
        plain = compile_program(plan, rank)
        fused = compile_program(plan, rank, fuse=True)
        assert _by_lane(_expanded(fused)) == _by_lane(plain), (shape, chunk, rank)
        for kind, _, arg in fused:
            if kind == _CHUNKS:
                slots, value, inputs, output, count_, last, chunks, stride = arg[:8]
                assert chunks >= 2 and 0 < last <= count_
                assert (stride * ITEMSIZE[dtype]) % 16 == 0
                assert stride >= count_  # the chunks never overlap
                assert all(ref[0] == rank for ref in inputs + (output,))


def test_pushed_reductions_of_many_chunks_are_fused_and_others_are_not():
    def fused_ops(collective, world, count, chunk, rank=0):
        plan = build_plan(Shape(collective, world, count, "float32", 4, root=0),
                          Options(chunk_bytes=chunk))
        return [arg for kind, _, arg in compile_program(plan, rank, fuse=True) if kind == _CHUNKS]

    (only,) = fused_ops("reduce_scatter", 2, 1000, 64)  # 63 chunks of 16 elements
    assert only[6] == 63 and only[4] == 16 and only[5] == 1000 - 62 * 16
    (only,) = fused_ops("reduce_scatter", 4, 1000, 64)
    assert len(only[0]) == 3  # a wait for each of the three peers' copies per chunk
    assert fused_ops("reduce", 3, 1000, 64, rank=0)  # the root sums
    assert not fused_ops("reduce", 3, 1000, 64, rank=1)  # the others only send
    assert not fused_ops("reduce_scatter", 2, 1000, 1 << 20)  # one chunk: nothing to fuse
    assert not fused_ops("reduce_scatter", 2, 1000, 24)  # 24-byte chunks: not whole vectors
    # all_reduce's sums each mark the chunk for its gather lane: a launch per chunk
    assert not fused_ops("all_reduce", 2, 1000, 64)


class _Pad:
    """A pad's tables (``SignalPad.waits``, ``signals``) naming each slot."""
    graph_offset = 100
    waits = [1000 + slot for slot in range(200)]
    signals = [[("remote", peer, slot) for slot in range(200)] for peer in range(2)]


@pytest.mark.parametrize("fuse", [True, False])
def test_binding_fuses_eager_calls_only(fuse):
    """A call captured into a graph keeps its stream waits (a graph's slots are reset after
    their last wait, which a launch holding the waits would move); eager calls fuse unless
    ``fuse_sums`` is off."""
    from hoccl.backends._base import SmCaps
    plan = build_plan(Shape("reduce_scatter", 2, 1000, "float32", 4), Options(chunk_bytes=64))
    executor = Executor(0, device=None, streams=None, pad=_Pad(), sms=SmCaps(8, 8, fuse))
    addresses = {(rank, name): (rank + 1) << 24 for rank in range(2)
                 for name in ("send", "recv", "scratch")}
    eager = executor.bind(plan, addresses)
    captured = executor.bind(plan, addresses, captured=True)
    assert any(kind == _CHUNKS for kind, _, _ in eager) == fuse
    assert not any(kind == _CHUNKS for kind, _, _ in captured)
    if fuse:
        ((flags, value, inputs, output, *_),) = [arg for kind, _, arg in eager if kind == _CHUNKS]
        assert flags == (1000 + 1 * CHANNELS + DONE,)  # rank 1's DONE slot in this rank's pad
        assert value == 1
        assert output == addresses[(0, "recv")]


def _words(n, fill=0):
    array = np.full(n, fill, dtype=np.uint64)
    return array, array.ctypes.data


def _floats(values):
    array = np.asarray(values, dtype=np.float32).copy()
    return array, array.ctypes.data


def _until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_the_host_launch_sums_each_chunk_only_after_its_signals_and_stops_at_an_abort():
    device = HostDevice(max_sms=8, copy_sms=8)
    stream = device.create_stream()
    try:
        flags, _ = _words(2)
        count, chunks = 8, 3
        a, a_address = _floats(np.arange(count * chunks))
        b, b_address = _floats(np.arange(count * chunks) * 10)
        out, out_address = _floats(poison(count * chunks, "float32"))
        before = out.copy()
        flag_addresses = [flags.ctypes.data, flags.ctypes.data + 8]
        device.reduce_chunks(stream, flag_addresses, 5, out_address, [a_address, b_address],
                             count, count, chunks, count, "float32", "sum")
        time.sleep(0.05)
        assert np.array_equal(out.view(np.uint32), before.view(np.uint32))  # nothing yet
        flags[0] = 5  # one of the two peers' first chunk landed: still nothing
        time.sleep(0.05)
        assert np.array_equal(out.view(np.uint32), before.view(np.uint32))
        flags[1] = 5  # chunk 0 complete
        _until(lambda: np.array_equal(out[:count], (a + b)[:count]))
        time.sleep(0.05)
        assert np.array_equal(out[count:].view(np.uint32), before[count:].view(np.uint32))
        flags[:] = ABORT_VALUE  # an abort: chunks 1 and 2 are never written
        device.synchronize_stream(stream, 10)
        assert np.array_equal(out[count:].view(np.uint32), before[count:].view(np.uint32))
    finally:
        device.destroy_stream(stream)
        device.close()


def test_the_default_device_method_is_the_waits_and_sums_it_replaces():
    """``Device.reduce_chunks``'s own body (what a backend without the launch runs): for
    each chunk, its waits then its sum, with the last chunk's count."""
    calls = []

    class Recorder(HostDevice):
        def wait_value(self, stream, address, value):
            calls.append(("wait", address, value))

        def reduce(self, stream, output, inputs, count, dtype, op, divisor=None, sms=None,
                   scale=None):
            calls.append(("reduce", output, tuple(inputs), count, dtype, op, scale))
    device = Recorder(max_sms=8, copy_sms=8)
    try:
        hoccl.backends._base.Device.reduce_chunks(device, None, [7, 9], 3, 1000, [2000, 3000],
                                                  8, 5, 3, 8, "bfloat16", "sum", scale=0.5)
    finally:
        device.close()
    expected = []
    for k, count in enumerate((8, 8, 5)):
        expected += [("wait", 7, 3 + k), ("wait", 9, 3 + k)]
        expected.append(("reduce", 1000 + 16 * k, (2000 + 16 * k, 3000 + 16 * k), count,
                         "bfloat16", "sum", 0.5))
    assert calls == expected


def _count_launches(comms):
    """A one-item list counting ``reduce_chunks`` calls on every rank's device from now."""
    launches = [0]
    for comm in comms:
        original = comm._engine.device.reduce_chunks

        def counted(*args, _original=original, **kwargs):
            launches[0] += 1
            return _original(*args, **kwargs)
        comm._engine.device.reduce_chunks = counted
    return launches


REDUCTIONS = [("reduce_scatter", "sum", "float32"), ("reduce_scatter", "avg", "bfloat16"),
              ("reduce_scatter", "max", "int32"), ("reduce_scatter", "premul", "float32"),
              ("reduce", "sum", "float64"), ("reduce", "prod", "uint8")]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("collective,op,dtype", REDUCTIONS)
@pytest.mark.parametrize("in_place", [False, True])
def test_reductions_of_many_chunks_are_exact_with_and_without_fused_sums(world, collective, op,
                                                                       dtype, in_place):
    """The same reductions, fused and not, on fresh data with outputs poisoned: both exact
    against numpy, and the fused one ran as one launch per rank that sums."""
    from hoccl._dtypes import numpy_dtype, reduce_arrays
    count = 203  # per rank's block: many 64-byte chunks and a short last one
    rng = np.random.default_rng([world, len(collective), len(op), in_place])
    np_dtype = numpy_dtype(dtype)
    total = count * world
    inputs = [rng.integers(1, 4, total).astype(np_dtype) for _ in range(world)]
    kind = "sum" if op == "premul" else op
    scale = 0.25 if op == "premul" else None
    reference = reduce_arrays([x.copy() for x in inputs], kind, np_dtype, None, scale)
    results = []
    for fuse in (True, False):
        comms = hoccl.init_local(world, backend="host", chunk_bytes=64, fuse_sums=fuse)
        launches = _count_launches(comms)
        outputs = []
        for rank, comm in enumerate(comms):
            if collective == "reduce_scatter":
                send = inputs[rank].copy()
                recv = (send[rank * count:(rank + 1) * count] if in_place
                        else poison(count, dtype))
                comm.reduce_scatter(send, recv, kind, scale=scale)
                outputs.append((recv, reference[rank * count:(rank + 1) * count]))
            else:
                send = inputs[rank].copy()
                recv = send if in_place else poison(total, dtype)
                comm.reduce(send, recv, world - 1, kind)
                if rank == world - 1:
                    outputs.append((recv, reference))
        for comm in comms:
            comm.synchronize()
        for got, want in outputs:
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (fuse, got[:8],
                                                                               want[:8])
        results.append([got.copy() for got, _ in outputs])
        summing = world if collective == "reduce_scatter" else 1
        assert (launches[0] >= summing) if fuse else launches[0] == 0
        for comm in comms:
            comm.close()
    assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8))
               for x, y in zip(*results))


def test_fuse_sums_is_a_switch_of_init_set_options_and_split():
    with pytest.raises(InvalidArgumentError, match="init_local: fuse_sums must be True or False"):
        hoccl.init_local(2, backend="host", fuse_sums="yes")
    comms = hoccl.init_local(2, backend="host", fuse_sums=False)
    try:
        assert not comms[0].fuse_sums
        with pytest.raises(InvalidArgumentError, match="set_options: fuse_sums"):
            comms[0].set_options(fuse_sums=2)
        assert not comms[0].fuse_sums  # a refused change changes nothing
        halves = hoccl.split_local(comms, [0, 0])
        assert not halves[0].fuse_sums  # inherited
        for comm in halves:
            comm.close()
        epoch = comms[0]._engine.layout_epoch
        comms[0].set_options(fuse_sums=1)
        assert comms[0].fuse_sums and comms[0]._engine.layout_epoch == epoch + 1
    finally:
        for comm in comms:
            comm.close()


def test_a_repeated_call_follows_a_changed_fuse_sums():
    """Repeats keep their prepared calls' bound programs: toggling ``fuse_sums`` must end
    them, or a repeat would go on in the old form."""
    comms = hoccl.init_local(2, backend="host", chunk_bytes=64)
    launches = _count_launches(comms)
    try:
        sends = [hoccl.empty(400, "float32", comm) for comm in comms]
        recvs = [hoccl.empty(200, "float32", comm) for comm in comms]
        seen = []
        for fuse in (True, True, False, False, True):
            for comm in comms:
                comm.set_options(fuse_sums=fuse)
            before = launches[0]
            for rank, comm in enumerate(comms):
                sends[rank][...] = np.arange(400, dtype=np.float32) * (rank + 1)
                recvs[rank][...] = np.nan
                comm.reduce_scatter(sends[rank], recvs[rank], "sum")
            for comm in comms:
                comm.synchronize()
            for rank in range(2):
                want = np.arange(400, dtype=np.float32)[rank * 200:(rank + 1) * 200] * 3
                assert np.array_equal(recvs[rank], want)
            seen.append(launches[0] - before)
        assert seen == [2, 2, 0, 0, 2]
        for rank, comm in enumerate(comms):
            comm.deregister(sends[rank])
            comm.deregister(recvs[rank])
    finally:
        for comm in comms:
            comm.close()


def test_the_kernels_compile_with_the_chunked_launch():
    """NVRTC compiles hoccl's kernel source, ``reduce_chunks`` included, without a GPU
    (skipped where no NVRTC library is installed)."""
    import importlib.util
    if importlib.util.find_spec("cuda") is None:
        pytest.skip("cuda-bindings not installed")
    from hoccl.backends import _kernels
    from hoccl.testing import nvrtc_ptx
    try:
        ptx = nvrtc_ptx(_kernels.source(), _kernels.compile_options())
    except (ImportError, OSError) as error:  # no libnvrtc on this machine
        pytest.skip(str(error))
    for dtype in ("bfloat16", "float32"):
        assert _kernels.reduce_chunks_kernel_name(dtype, "sum").encode() in ptx


def test_ranks_that_share_a_gpu_are_found_by_its_physical_id():
    """``fuse_sums`` left unset is turned off for a rank whose GPU another rank also drives
    (a launch that waits spins through its context's time slices while the peer's context
    waits for its turn); ranks on GPUs of their own, or whose devices have no id (host),
    keep it."""
    from hoccl._build import shares_device

    def ids(*physical):
        return [("host", 100 + rank, 0, None, bus) for rank, bus in enumerate(physical)]
    assert shares_device(ids("0000:19:00.0", "0000:19:00.0"), 0)
    assert not shares_device(ids("0000:19:00.0", "0000:3b:00.0"), 0)
    assert shares_device(ids("a", "b", "a"), 2) and not shares_device(ids("a", "b", "a"), 1)
    assert not shares_device(ids(None, None), 0)
    comms = hoccl.init_local(2, backend="host")
    try:
        assert all(comm.fuse_sums for comm in comms)
    finally:
        for comm in comms:
            comm.close()
