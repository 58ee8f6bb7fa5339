"""Host µs of one small piece of GPU work issued from Python, by how it is issued: hoccl's
same-GPU copy kernel (``Device.local_copy``), the same launch with its arguments built
once, that launch captured once into a CUDA graph and the graph launched, a
``cuMemcpyAsync``, and torch's ``copy_``.  Run: python tools/launch_cost.py"""
import ctypes
import time

import torch
from cuda.bindings import driver

import hoccl
from hoccl.backends import _cuda_kernels as kernels_module
from hoccl.backends._cuda_driver import _call


def per_call(function, iters=2000, burst=50):
    function()
    torch.cuda.synchronize()
    best = []
    for _ in range(iters // burst):
        start = time.perf_counter()
        for _ in range(burst):
            function()
        best.append((time.perf_counter() - start) / burst * 1e6)
        torch.cuda.synchronize()
    best.sort()
    return best[len(best) // 2]


def main():
    comm = hoccl.init(backend="cuda")
    torch.cuda.set_device(comm.device)
    device = comm._engine.device
    nbytes = 1 << 20
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    raw = driver.CUstream(stream.cuda_stream)
    device.activate()
    rows = {}
    rows["hoccl local_copy (kernel)"] = per_call(
        lambda: device.local_copy(raw, dst.data_ptr(), src.data_ptr(), nbytes))
    kernels = device._kernels()
    width = 16
    threads = kernels_module._kernels.TUNING["copy_threads"]
    blocks = device._blocks(nbytes // width, threads, device.copy_sms)
    args = kernels_module._CopyArgs(dst.data_ptr(), src.data_ptr(), nbytes, 0)
    parameters = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    function = kernels.copy[width]
    pointer = ctypes.addressof(parameters)

    def launch():
        _call(driver.cuLaunchKernel, function, blocks, 1, 1, threads, 1, 1, 0, raw, pointer, 0)
    rows["cuLaunchKernel, arguments kept"] = per_call(launch)
    capture = driver.CUstream(_call(driver.cuStreamCreate, 0))
    _call(driver.cuStreamBeginCapture, capture,
          driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    _call(driver.cuLaunchKernel, function, blocks, 1, 1, threads, 1, 1, 0, capture, pointer, 0)
    graph = _call(driver.cuStreamEndCapture, capture)
    graph_exec = _call(driver.cuGraphInstantiate, graph, 0)
    rows["cuGraphLaunch (that kernel)"] = per_call(
        lambda: _call(driver.cuGraphLaunch, graph_exec, raw))
    rows["cuMemcpyAsync 1 MiB"] = per_call(
        lambda: _call(driver.cuMemcpyAsync, dst.data_ptr(), src.data_ptr(), nbytes, raw))
    rows["cuMemcpyDtoDAsync 1 MiB"] = per_call(
        lambda: _call(driver.cuMemcpyDtoDAsync, dst.data_ptr(), src.data_ptr(), nbytes, raw))
    rows["torch copy_"] = per_call(lambda: dst.copy_(src))
    assert bool((dst == 1).all())
    for name, value in rows.items():
        print(f"{name:34s} {value:6.2f} µs")
    comm.close()


if __name__ == "__main__":
    main()
