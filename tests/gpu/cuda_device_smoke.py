"""Smoke test of ``hoccl.backends.cuda`` on a machine with two GPUs (a script, not pytest).

    PYTHONPATH=. python3 tests/gpu/cuda_device_smoke.py

Opens both GPUs in one process, checks every primitive of ``CudaDevice`` against numpy
on fresh random data with poisoned outputs, prints one PASS/FAIL line per check and a
summary, then measures the capped kernels' bandwidth.  Exits non-zero on any failure.
Reductions are compared bit for bit with ``hoccl.testing.reduced`` (the kernel's order
and precision, chained launches included), and the comparison is shown to fail on a
flipped bit and an unwritten block of a real output first.
"""

from __future__ import annotations

import faulthandler
import sys
import time
import traceback

import cupy as cp
import numpy as np

from hoccl._dtypes import numpy_dtype
from hoccl._errors import HocclTimeoutError, InvalidArgumentError
from hoccl.backends._base import DTYPES, OPS, MemOp
from hoccl.backends._kernels import MAX_INPUTS
from hoccl.backends.cuda import open_device
from hoccl.testing import (FAULTS, ArrayModule, PlantedFault, assert_exact, poison, random_array,
                           reduced)

MiB = 1 << 20
SEED = int(np.random.SeedSequence().entropy % (1 << 32))
rng = np.random.default_rng(SEED)
outcomes = []


def report(name, passed, detail=""):
    outcomes.append(passed)
    print(f"{'PASS' if passed else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def check(name):
    """Run the decorated function now; an exception or a returned message is a failure."""
    def run(function):
        try:
            problem = function()
        except Exception:
            problem = traceback.format_exc(limit=4).strip().replace("\n", "\n    ")
        report(name, not problem, problem or "")
        return function
    return run


# -- helpers -------------------------------------------------------------------------------
def on(ordinal, host):
    """A cupy copy of ``host`` on GPU ``ordinal``, finished before return."""
    with cp.cuda.Device(ordinal):
        array = cp.asarray(host)
        cp.cuda.Device(ordinal).synchronize()
    return array


def poisoned(ordinal, nbytes, byte=0xAB):
    return on(ordinal, np.full(nbytes, byte, np.uint8))


def host(array):
    with cp.cuda.Device(array.device.id):
        return cp.asnumpy(array)


def words(ordinal, address, slots):
    """A uint64 cupy view of device memory this script does not own (a pad)."""
    memory = cp.cuda.UnownedMemory(address, slots * 8, owner=None, device_id=ordinal)
    return cp.ndarray((slots,), cp.uint64, cp.cuda.MemoryPointer(memory, 0))


def release(ordinal, pad, slots):
    """Write a huge value into every slot from the host side, so a hung wait ends."""
    with cp.cuda.Device(ordinal):
        words(ordinal, pad, slots)[:] = cp.uint64(1 << 63)
        cp.cuda.Device(ordinal).synchronize()


def random_bytes(nbytes):
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def blocked(device, stream, seconds=0.05):
    """True if ``stream`` is still busy after ``seconds``."""
    try:
        device.synchronize_stream(stream, seconds)
    except HocclTimeoutError:
        return True
    return False


#: how each dtype is held in numpy and cupy (cupy has no bfloat16: its bits as uint16)
STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32,
           "float64": np.float64, "int8": np.int8, "uint8": np.uint8, "int32": np.int32,
           "int64": np.int64}


def random_elements(dtype, count):
    """Floats: ``hoccl.testing``'s normals (never zero or NaN); integers: the whole type,
    so that sums and products wrap (an integer result can then equal the poison: the
    float checks and the guard bytes show what the kernels leave unwritten)."""
    if dtype.startswith("float") or dtype == "bfloat16":
        return random_array(rng, count, dtype).view(STORAGE[dtype])
    info = np.iinfo(STORAGE[dtype])
    return rng.integers(info.min, info.max, count, dtype=STORAGE[dtype], endpoint=True)


def reference(dtype, op, inputs):
    """What the kernel computes: inputs folded in order, 16-bit floats in float32, launches
    of ``MAX_INPUTS`` chained (``hoccl.testing.reduced``)."""
    values = [x.view(numpy_dtype(dtype)) for x in inputs]
    return reduced(values, op, inputs_per_launch=MAX_INPUTS).view(STORAGE[dtype])


def compare(dtype, got, want):
    """None when ``got`` holds ``want``'s bits exactly, else what differs."""
    try:
        assert_exact(dtype, want.view(numpy_dtype(dtype)), got.view(numpy_dtype(dtype)))
    except AssertionError as error:
        return str(error)
    return None


def poisoned_output(ordinal, dtype, count, before, after):
    """``count`` poisoned elements (``hoccl.testing.poison``) between ``before`` and ``after``
    guard bytes of 0xAB, on GPU ``ordinal``."""
    return on(ordinal, np.concatenate([np.full(before, 0xAB, np.uint8),
                                       poison(count, dtype).view(np.uint8),
                                       np.full(after, 0xAB, np.uint8)]))


def local_copy_problems(dev0, s0):
    for nbytes in (1, 15, 16, 17, 4097, 65536 + 5, 3 * MiB + 11):
        for src_offset, dst_offset in ((0, 0), (1, 1), (5, 13), (8, 0), (2, 6), (1, 2), (3, 0)):
            data = random_bytes(nbytes)
            src = on(0, np.concatenate([np.zeros(src_offset, np.uint8), data]))
            dst = poisoned(0, nbytes + dst_offset + 32)
            dev0.local_copy(s0, dst.data.ptr + dst_offset, src.data.ptr + src_offset, nbytes)
            dev0.synchronize_stream(s0, 10)
            got = host(dst)
            if not (np.array_equal(got[dst_offset:dst_offset + nbytes], data)
                    and (got[:dst_offset] == 0xAB).all()
                    and (got[dst_offset + nbytes:] == 0xAB).all()):
                return (f"local_copy wrong at nbytes={nbytes} "
                        f"offsets src {src_offset} dst {dst_offset}")
    return None


def reduce_problems(dev0, s0, dtype):
    """Every op with 2, 3 and 8 inputs, odd counts, same-misaligned heads, and in place
    with one input on the peer GPU."""
    itemsize = np.dtype(STORAGE[dtype]).itemsize
    problems = []
    for op in OPS:
        for n, count, offset in ((2, 10007, 0), (3, 4099, 1), (8, 1001, 3), (2, 7, 0)):
            inputs = [random_elements(dtype, count) for _ in range(n)]
            pad = np.zeros(offset, STORAGE[dtype])
            arrays = [on(0, np.concatenate([pad, x])) for x in inputs]
            out = poisoned_output(0, dtype, count, offset * itemsize, 64)
            dev0.reduce(s0, out.data.ptr + offset * itemsize,
                        [a.data.ptr + offset * itemsize for a in arrays], count, dtype, op)
            dev0.synchronize_stream(s0, 10)
            raw = host(out)
            body = raw[offset * itemsize:(offset + count) * itemsize].view(STORAGE[dtype])
            problem = compare(dtype, body, reference(dtype, op, inputs))
            if problem is None and not ((raw[:offset * itemsize] == 0xAB).all()
                                        and (raw[(offset + count) * itemsize:] == 0xAB).all()):
                problem = "wrote outside the output"
            if problem:
                problems.append(f"{dtype} {op} n={n} count={count} offset={offset}: {problem}")
        inputs = [random_elements(dtype, 3001) for _ in range(2)]
        a, b = on(0, inputs[0]), on(1, inputs[1])
        dev0.reduce(s0, a.data.ptr, [a.data.ptr, b.data.ptr], 3001, dtype, op)
        dev0.synchronize_stream(s0, 10)
        problem = compare(dtype, host(a), reference(dtype, op, inputs))
        if problem:
            problems.append(f"{dtype} {op} in place with a peer input: {problem}")
    return "; ".join(problems[:4]) or None


def chain_problems(dev0, s0):
    """More inputs than one launch takes (16-bit partial sums rounded between launches), and
    mutually misaligned inputs."""
    problems = []
    for dtype, op in (("float32", "sum"), ("float32", "avg"), ("int32", "avg"),
                      ("float16", "sum"), ("bfloat16", "avg"), ("float16", "max")):
        inputs = [random_elements(dtype, 1001) for _ in range(70)]
        arrays = [on(0, x) for x in inputs]
        out = poisoned_output(0, dtype, 1001, 0, 0)
        dev0.reduce(s0, out.data.ptr, [a.data.ptr for a in arrays], 1001, dtype, op)
        dev0.synchronize_stream(s0, 10)
        problem = compare(dtype, host(out).view(STORAGE[dtype]), reference(dtype, op, inputs))
        if problem:
            problems.append(f"{dtype} {op} x70: {problem}")
    inputs = [random_elements("bfloat16", 5003) for _ in range(3)]
    arrays = [on(0, np.concatenate([np.zeros(k, np.uint16), x])) for k, x in enumerate(inputs)]
    out = poisoned_output(0, "bfloat16", 5003, 0, 0)
    dev0.reduce(s0, out.data.ptr, [a.data.ptr + 2 * k for k, a in enumerate(arrays)], 5003,
                "bfloat16", "avg")
    dev0.synchronize_stream(s0, 10)
    problem = compare("bfloat16", host(out).view(np.uint16), reference("bfloat16", "avg", inputs))
    if problem:
        problems.append(f"misaligned bf16 avg: {problem}")
    return "; ".join(problems) or None


# -- the checks ----------------------------------------------------------------------------
def main():
    faulthandler.dump_traceback_later(200, exit=True)  # a hung stream must not eat the lease
    print(f"seed {SEED}; cupy {cp.__version__}; GPUs {cp.cuda.runtime.getDeviceCount()}")
    started = time.perf_counter()
    dev0, dev1 = open_device(0, max_sms=8, copy_sms=8), open_device(1, max_sms=8, copy_sms=8)
    print(f"{dev0!r} {dev1!r}; sm_count {dev0.sm_count}")
    dev0.enable_peer_access(dev1)
    dev1.enable_peer_access(dev0)
    s0, s1 = dev0.create_stream(), dev1.create_stream()
    for device, stream in ((dev0, s0), (dev1, s1)):  # kernels compile here, outside timings
        device.local_copy(stream, device.alloc(16), device.alloc(16), 16)
        device.synchronize_stream(stream, 60)
    print(f"opened and compiled in {time.perf_counter() - started:.1f} s")

    @check("copy GPU0->GPU1 push and pull, odd size")
    def _():
        nbytes = 3 * MiB + 7
        data = random_bytes(nbytes)
        src = on(0, data)
        for device, stream in ((dev0, s0), (dev1, s1)):
            dst = poisoned(1, nbytes + 64)
            device.copy(stream, dst.data.ptr + 32, src.data.ptr, nbytes)
            device.synchronize_stream(stream, 10)
            got = host(dst)
            if not (np.array_equal(got[32:-32], data) and (got[:32] == 0xAB).all()
                    and (got[-32:] == 0xAB).all()):
                return f"wrong bytes with the stream on GPU{device.ordinal}"

    @check("copy_batch GPU0->GPU1, 5 copies of odd sizes, plus legacy-stream fallback")
    def _():
        sizes = [1, 4099, 65536, 1 * MiB + 3, 17]
        data = random_bytes(sum(sizes))
        src = on(0, data)
        for stream in (s0, 0):
            dst = poisoned(1, sum(sizes))
            offsets = np.cumsum([0] + sizes[:-1])
            dev0.copy_batch(stream, [(dst.data.ptr + int(o), src.data.ptr + int(o), n)
                                     for o, n in zip(offsets, sizes)])
            dev0.synchronize_stream(stream, 10)
            if not np.array_equal(host(dst), data):
                return f"wrong bytes (stream {stream!r})"

    @check("write_value into GPU1's pad from GPU0 releases wait_value on GPU1's stream")
    def _():
        pad = dev1.alloc_pad(4)
        if host(words(1, pad, 4)).any():
            return "alloc_pad not zeroed"
        data = random_bytes(MiB + 1)
        src, dst = on(1, data), poisoned(1, MiB + 1)
        value = int(rng.integers(1, 1 << 62))
        dev1.wait_value(s1, pad + 8, value)
        dev1.copy(s1, dst.data.ptr, src.data.ptr, MiB + 1)
        if not blocked(dev1, s1):
            return "the stream did not wait"
        dev0.write_value(s0, pad + 8, value - 1)
        dev0.synchronize_stream(s0, 5)
        if not blocked(dev1, s1):
            return "value - 1 released a >= wait"
        dev0.write_value(s0, pad + 8, value)
        try:
            dev1.synchronize_stream(s1, 5)
        except HocclTimeoutError:
            release(1, pad, 4)  # so that the script can go on
            dev1.synchronize_stream(s1, 5)
            return "the peer's write did not release the wait"
        if int(host(words(1, pad, 4))[1]) != value or not np.array_equal(host(dst), data):
            return "pad value or copied bytes wrong"

    @check("memops: 300 waits (several batches) wait for every slot")
    def _():
        slots = 300
        pad = dev1.alloc_pad(slots)
        values = [int(v) for v in rng.integers(1, 1 << 40, slots)]
        dev1.memops(s1, [(MemOp.WAIT, pad + 8 * i, v) for i, v in enumerate(values)])
        word = dev1.alloc_host_word()
        dev1.write_value(s1, word.address, 99)
        for i in range(slots - 1):
            dev0.write_value(s0, pad + 8 * i, values[i])
        dev0.synchronize_stream(s0, 5)
        if not blocked(dev1, s1) or word.value != 0:
            return "released before the last slot was written"
        dev0.write_value(s0, pad + 8 * (slots - 1), values[-1] + 5)
        try:
            dev1.synchronize_stream(s1, 5)
        except HocclTimeoutError:
            release(1, pad, slots)
            dev1.synchronize_stream(s1, 5)
            return "not released after every slot was written"
        if word.value != 99:
            return f"host word reads {word.value}, want 99"

    @check("host word: write_value from GPU0 and GPU1, read on the host")
    def _():
        word = dev0.alloc_host_word()
        if word.value != 0:
            return "not zeroed"
        value = int(rng.integers(1, 1 << 63))
        dev0.write_value(s0, word.address, value)
        dev0.synchronize_stream(s0, 5)
        if word.value != value:
            return f"GPU0 wrote {value}, host reads {word.value}"
        dev1.write_value(s1, word.address, value + 1)
        dev1.synchronize_stream(s1, 5)
        if word.value != value + 1:
            return f"GPU1 wrote {value + 1}, host reads {word.value}"

    check("local_copy: odd sizes, aligned / same-misaligned / mutually misaligned")(
        lambda: local_copy_problems(dev0, s0))
    for dtype in DTYPES:
        check(f"reduce {dtype}: every op x 2/3/8 inputs, odd counts, head offsets, in place")(
            lambda dtype=dtype: reduce_problems(dev0, s0, dtype))
    check("reduce: 70 inputs chain (float32 sum/avg, int32 avg, float16 sum/max, bfloat16 avg) "
          "and mutually misaligned inputs")(lambda: chain_problems(dev0, s0))

    @check("compare fails on a flipped bit, shifted data and an unwritten block of a real "
           "reduce output")
    def _():
        inputs = [random_elements("float16", 4099) for _ in range(3)]
        arrays = [on(0, x) for x in inputs]
        want = reference("float16", "sum", inputs)
        for fault in (None,) + FAULTS:
            out = poisoned_output(0, "float16", 4099, 0, 0).view(cp.float16)
            dev0.reduce(s0, out.data.ptr, [a.data.ptr for a in arrays], 4099, "float16", "sum")
            dev0.synchronize_stream(s0, 10)
            reader = (ArrayModule("cupy") if fault is None
                      else PlantedFault(ArrayModule("cupy"), fault, block=4099))
            problem = compare("float16", reader.to_numpy(out, "float16"), want)
            if fault is None and problem:
                return f"the output itself is wrong: {problem}"
            if fault is not None and not problem:
                return f"the planted {fault} passed the comparison"
            if fault == "unwritten" and "unwritten (still poison)" not in problem:
                return f"the unwritten block was not named: {problem}"

    @check("export: same buffer gives identical cached descriptors; refuses non-CUDA memory")
    def _():
        buffer = on(0, random_bytes(4 * MiB))
        first = dev0.export(buffer.data.ptr + 4096)
        again = dev0.export(buffer.data.ptr + 4096)
        other = dev0.export(buffer.data.ptr + 8192)
        own = dev0.alloc(MiB)
        mine = dev0.export(own + 100)
        if first != again or first.handle is not again.handle or other.handle is not first.handle:
            return f"not cached: {first} vs {again}"
        if other.offset - first.offset != 4096 or first[0] != "cuda-ipc" or len(first.handle) != 64:
            return f"bad descriptor {first}"
        if mine.base != own or mine.offset != 100 or mine.handle == first.handle:
            return f"bad descriptor for alloc: {mine}"
        try:
            dev0.export(dev0.alloc_host_word().address)
        except InvalidArgumentError:
            return None
        return "exported pinned host memory"

    @check("resolve_stream: cupy arrays and streams, torch tensors and streams, ints, legacy")
    def _():
        array = on(1, np.zeros(4, np.float32))
        with cp.cuda.Device(1):
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                if int(dev1.resolve_stream(None, [array])) != stream.ptr:
                    return "cupy current stream not found"
        if (int(dev1.resolve_stream(stream, [])) != stream.ptr
                or int(dev1.resolve_stream(stream.ptr, [])) != stream.ptr):
            return "explicit cupy stream"
        if int(dev1.resolve_stream(None, [np.zeros(1)])) != 1:
            return "numpy arrays should give the legacy stream"
        try:
            import torch
        except ImportError:
            print("     note: torch not importable; torch branch skipped")
            return None
        tensor = torch.zeros(4, device="cuda:1")
        torch_stream = torch.cuda.Stream(device=1)
        with torch.cuda.stream(torch_stream):
            if int(dev1.resolve_stream(None, [tensor])) != torch_stream.cuda_stream:
                return "torch current stream not found"
        if int(dev1.resolve_stream(torch_stream, [])) != torch_stream.cuda_stream:
            return "explicit torch stream"

    @check("close is idempotent and releases what it made")
    def _():
        device = open_device(0, max_sms=8, copy_sms=8)
        device.create_stream(), device.create_event(), device.alloc(MiB), device.alloc_pad(8)
        word = device.alloc_host_word()
        device.enable_peer_access(dev1)
        device.close()
        device.close()
        try:
            word.value
        except InvalidArgumentError:
            return None
        return "host word readable after close"

    passed = sum(outcomes)
    print(f"checks: {passed} passed, {len(outcomes) - passed} failed "
          f"({time.perf_counter() - started:.1f} s)", flush=True)
    benchmark(dev0, s0)
    dev0.close()
    dev1.close()
    return 0 if all(outcomes) else 1


def timed(device, stream, run, repeats=10):
    run()
    device.synchronize_stream(stream, 30)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    device.synchronize_stream(stream, 60)
    return (time.perf_counter() - start) / repeats


def benchmark(dev0, s0):
    nbytes = 256 * MiB
    count = nbytes // 2
    with cp.cuda.Device(0):
        a = cp.random.random(count, dtype=cp.float32).astype(cp.float16).view(cp.uint16)
        b = cp.random.random(count, dtype=cp.float32).astype(cp.float16).view(cp.uint16)
        out = cp.empty(count, cp.uint16)
        cp.cuda.Device(0).synchronize()
    print("bandwidth, GPU0, 256 MiB, bytes read + written (GB/s = 1e9 B/s; per SM in brackets):")
    print("  reduce = bf16 sum of 2 inputs (3 x 256 MiB moved); local_copy = 2 x 256 MiB moved")
    for cap in (4, 8, 16, 32, dev0.sm_count):
        dev0.max_sms = cap
        reduce_time = timed(dev0, s0, lambda: dev0.reduce(
            s0, out.data.ptr, [a.data.ptr, b.data.ptr], count, "bfloat16", "sum"))
        copy_time = timed(dev0, s0,
                          lambda: dev0.local_copy(s0, out.data.ptr, a.data.ptr, nbytes))
        reduce_rate = 3 * nbytes / reduce_time / 1e9
        copy_rate = 2 * nbytes / copy_time / 1e9
        print(f"    max_sms={cap:3d}  reduce {reduce_rate:6.0f} GB/s ({reduce_rate / cap:5.1f}) "
              f"{reduce_time * 1e3:6.2f} ms   local_copy {copy_rate:6.0f} GB/s "
              f"({copy_rate / cap:5.1f}) {copy_time * 1e3:6.2f} ms", flush=True)
    dev0.max_sms = 8
    memcpy_time = timed(dev0, s0, lambda: dev0.copy(s0, out.data.ptr, a.data.ptr, nbytes))
    print(f"  reference: cuMemcpyAsync same GPU (all SMs) "
          f"{2 * nbytes / memcpy_time / 1e9:.0f} GB/s")
    with cp.cuda.Device(1):
        remote = cp.empty(count, cp.uint16)
        cp.cuda.Device(1).synchronize()
    peer_time = timed(dev0, s0, lambda: dev0.copy(s0, remote.data.ptr, a.data.ptr, nbytes))
    print(f"  reference: peer copy GPU0->GPU1 {nbytes / peer_time / 1e9:.0f} GB/s "
          "(bytes moved once)")


if __name__ == "__main__":
    sys.exit(main())
