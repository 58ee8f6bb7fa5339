"""The cuda backend's kept driver arguments, checked without a GPU: ``CudaDevice.memops``
(batches of kept ``CUstreamBatchMemOpParams``) and ``local_copy`` (a kept launch per
argument list).  The driver functions are replaced by recorders, and what reached them
is decoded and compared with the operations asked for, on fresh random lists, repeated
with new values (the kept path) and beyond the number of lists kept."""

import ctypes
import random

import pytest

pytest.importorskip("cuda.bindings")

from cuda.bindings import driver  # noqa: E402

from hoccl.backends import _cuda_kernels, _kernels  # noqa: E402
from hoccl.backends import cuda as cuda_backend  # noqa: E402
from hoccl.backends._base import MemOp  # noqa: E402
from hoccl.backends._cuda_structs import _CopyArgs  # noqa: E402

_SUCCESS = (driver.CUresult.CUDA_SUCCESS,)


class _Recorder:
    """Stands in for the driver module: every memop and launch, decoded as it is made."""

    CUstreamWriteValue_flags = driver.CUstreamWriteValue_flags
    CUstreamWaitValue_flags = driver.CUstreamWaitValue_flags
    CUstreamBatchMemOpType = driver.CUstreamBatchMemOpType
    CUstreamBatchMemOpParams = driver.CUstreamBatchMemOpParams

    def __init__(self):
        self.memops = []    # (stream, kind, address, value) in the order the device got them
        self.batches = []   # the length of each cuStreamBatchMemOp
        self.launches = []  # (function, blocks, threads, stream, CopyArgs fields)

    def cuStreamWriteValue64(self, stream, address, value, flags):
        self.memops.append((stream, MemOp.WRITE, int(address), value))
        return _SUCCESS

    def cuStreamWaitValue64(self, stream, address, value, flags):
        self.memops.append((stream, MemOp.WAIT, int(address), value))
        return _SUCCESS

    def cuStreamBatchMemOp(self, stream, count, params, flags):
        assert count == len(params) <= 255
        self.batches.append(count)
        write = driver.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64
        for param in params:
            if param.operation == write:
                self.memops.append((stream, MemOp.WRITE, int(param.writeValue.address),
                                    int(param.writeValue.value64)))
            else:
                self.memops.append((stream, MemOp.WAIT, int(param.waitValue.address),
                                    int(param.waitValue.value64)))
        return _SUCCESS

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        pointer = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
        args = _CopyArgs.from_address(pointer)
        self.launches.append((function, gx, bx, stream,
                              (args.dst, args.src, args.nbytes, args.head)))
        return _SUCCESS


class _Device:
    """The parts of ``CudaDevice`` its memops and local copies read."""

    memops = cuda_backend.CudaDevice.memops
    _memop_batch = cuda_backend.CudaDevice._memop_batch
    local_copy = cuda_backend.CudaDevice.local_copy
    _copy_launch_of = cuda_backend.CudaDevice._copy_launch_of
    _blocks = cuda_backend.CudaDevice._blocks

    def __init__(self):
        self._memop_params = {}
        self._copy_launches = {}
        self.copy_sms = 4
        self.sm_count = 132
        self.kernels = type("Kernels", (), {"copy": {width: f"copy{width}"
                                                     for width in _kernels.COPY_WIDTHS}})()

    def _make_current(self):
        pass

    def _kernels(self):
        return self.kernels


@pytest.fixture
def recorder(monkeypatch):
    recording = _Recorder()
    monkeypatch.setattr(cuda_backend, "driver", recording)
    monkeypatch.setattr(_cuda_kernels, "driver", recording)
    return recording


def _operations(rng, length, addresses):
    return [(rng.choice((MemOp.WRITE, MemOp.WAIT)), rng.choice(addresses),
             rng.randrange(1, 1 << 62)) for _ in range(length)]


@pytest.mark.parametrize("single", [1, 8])
def test_memops_reach_the_driver_in_order_with_each_calls_values(recorder, monkeypatch, single):
    monkeypatch.setattr(cuda_backend, "_SINGLE", single)
    rng = random.Random()
    device = _Device()
    addresses = [rng.randrange(1, 1 << 40) * 8 for _ in range(6)]  # repeats in a list
    lists = [_operations(rng, length, addresses) for length in (1, 2, 3, 9, 255, 256, 600)]
    for _ in range(3):  # again with new values: the kept batches
        for operations in lists:
            operations = [(kind, address, rng.randrange(1, 1 << 62))
                          for kind, address, _ in operations]
            recorder.memops.clear()
            recorder.batches.clear()
            stream = rng.randrange(1, 1 << 30)
            device.memops(stream, operations)
            assert recorder.memops == [(stream, *operation) for operation in operations]
            if len(operations) > single:
                assert recorder.batches == [min(255, len(operations) - start)
                                            for start in range(0, len(operations), 255)]
            else:
                assert recorder.batches == []
    assert len(device._memop_params) == sum(len(operations) > single for operations in lists)


def test_memop_batches_kept_are_bounded_oldest_first(recorder, monkeypatch):
    monkeypatch.setattr(cuda_backend, "_SINGLE", 1)
    monkeypatch.setattr(cuda_backend, "_MEMOP_BATCHES", 4)
    rng = random.Random()
    device = _Device()
    lists = [[(MemOp.WRITE, 8 * (index + 1), 1), (MemOp.WAIT, 8 * (index + 100), 1)]
             for index in range(6)]
    for operations in lists:
        device.memops(1, operations)
    kept = list(device._memop_params)
    assert kept == [tuple((kind, address) for kind, address, _ in operations)
                    for operations in lists[2:]]
    first = [(kind, address, rng.randrange(1, 1 << 62)) for kind, address, _ in lists[0]]
    recorder.memops.clear()
    device.memops(2, first)  # built again after it went
    assert recorder.memops == [(2, *operation) for operation in first]


def _expected_copy(dst, src, nbytes, sms):
    width = next(width for width in _kernels.COPY_WIDTHS if dst % width == src % width)
    head = min(nbytes, -dst % width)
    threads = _kernels.TUNING["copy_threads"]
    blocks = max(1, min(sms, 132, -(-((nbytes - head) // width) // threads)))
    return f"copy{width}", blocks, threads, (dst, src, nbytes, head)


def test_local_copy_launches_are_kept_per_argument_list(recorder):
    rng = random.Random()
    device = _Device()
    cases = [(rng.randrange(1 << 20, 1 << 40), rng.randrange(1 << 20, 1 << 40),
              rng.choice((1, 7, 4096, rng.randrange(1, 1 << 24))), rng.choice((None, 1, 16)))
             for _ in range(40)]
    dst, src = rng.randrange(1 << 20, 1 << 40) * 16, rng.randrange(1 << 20, 1 << 40) * 16
    cases += [(dst, src, 1 << 24, sms) for sms in (None, 1, 16)]  # the cap alone differs
    for _ in range(2):  # the second time from the kept launches
        for dst, src, nbytes, sms in cases:
            recorder.launches.clear()
            stream = rng.randrange(1, 1 << 30)
            device.local_copy(stream, dst, src, nbytes, sms)
            function, blocks, threads, fields = _expected_copy(
                dst, src, nbytes, device.copy_sms if sms is None else sms)
            assert recorder.launches == [(function, blocks, threads, stream, fields)]
    assert len(device._copy_launches) == len({(dst, src, nbytes, device.copy_sms
                                               if sms is None else sms)
                                              for dst, src, nbytes, sms in cases})
    recorder.launches.clear()
    device.local_copy(1, 4096, 8192, 0)  # nothing to copy: no launch
    assert recorder.launches == []
