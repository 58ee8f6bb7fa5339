"""The direct kernel's time per call on one GPU: two ranks in one process on one device.

Both ranks' kernels run on the same GPU, each on a stream of its own, and signal each
other through that GPU's memory (a loopback: no NVLink, no second process). This is
the kernel's own cost per call, eagerly and replayed from a CUDA graph, with nothing of
hoccl's host path around it (the program is bound once, as a communicator binds it); it is
not a figure to set beside NCCL, which refuses two ranks on one GPU. Every output is
checked against numpy first.

  python tools/direct_latency.py --sizes 8K,64K,256K,1M
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cuda.bindings import driver  # noqa: E402

from hoccl._engine import SignalPad, digest  # noqa: E402
from hoccl.streams import StreamManager  # noqa: E402
from hoccl.backends import cuda as backend  # noqa: E402
from hoccl.backends._base import SmCaps  # noqa: E402
from hoccl.bench._harness import human, parse_size  # noqa: E402
from hoccl.p2p import Executor  # noqa: E402
from hoccl.sched import Options, Shape, build_plan  # noqa: E402
from hoccl.sched.plan import RING  # noqa: E402

N = 2
COLLECTIVES = ("all_gather", "all_to_all", "broadcast", "reduce_scatter", "all_reduce")


def _check(result, name: str) -> None:
    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{name}: {result[0]}")


def _elapsed_us(device, streams, run, iters: int) -> float:
    start, stop = driver.cuEventCreate(0)[1], driver.cuEventCreate(0)[1]
    fork = driver.cuEventCreate(0)[1]
    device.activate()
    _check(driver.cuEventRecord(start, streams[0]), "record")
    _check(driver.cuEventRecord(fork, streams[0]), "record")
    _check(driver.cuStreamWaitEvent(streams[1], fork, 0), "wait")
    run(iters)
    _check(driver.cuEventRecord(fork, streams[1]), "record")
    _check(driver.cuStreamWaitEvent(streams[0], fork, 0), "wait")
    _check(driver.cuEventRecord(stop, streams[0]), "record")
    _check(driver.cuEventSynchronize(stop), "sync")
    ms = driver.cuEventElapsedTime(start, stop)[1]
    return ms * 1000.0 / iters


def measure(device, pads, executors, streams, collective: str, nbytes: int, blocks: int,
            iters: int, seed: int) -> dict:
    import torch
    itemsize = 2  # bfloat16
    # the sizes the benchmarks report: the largest buffer of the call
    count = nbytes // itemsize // (N if collective in ("all_gather", "all_to_all",
                                                        "reduce_scatter") else 1)
    # reductions out of place: repeated calls must find their inputs unchanged
    in_place = collective in ("all_gather", "broadcast")
    shape = Shape(collective, N, count, "bfloat16", itemsize, "sum", 0, -1, in_place)
    plan = build_plan(shape, Options(kernel_bytes=nbytes, kernel_sms=blocks))
    assert plan.kernel_blocks, plan
    tensors, addresses = {}, {}
    for rank in range(N):
        for spec in plan.buffers[rank]:
            size = max(spec.nbytes, 2) * (2 if spec.name == RING else 1)
            tensor = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
            tensors[(rank, spec.name)] = tensor
            addresses[(rank, spec.name)] = ((tensor.data_ptr(), spec.nbytes)
                                            if spec.name == RING else tensor.data_ptr())
    # with a signature, as a communicator binds them: the kernels compare it on the device
    signature = digest((("shape", repr(shape)),))
    programs = [executors[rank].bind(plan, addresses, signature=signature)[0][2]
                for rank in range(N)]
    # fresh small integers (exact in bfloat16 sums), then one call each, checked
    rng = np.random.default_rng(seed)
    inputs = {}
    for rank in range(N):
        for spec in plan.buffers[rank]:
            for start, stop in spec.inputs:
                values = rng.integers(-8, 8, (stop - start) // itemsize).astype(np.float32)
                view = tensors[(rank, spec.name)][start:stop].view(torch.bfloat16)
                view.copy_(torch.from_numpy(values))
                inputs[(rank, spec.name, start)] = values
    device.activate()
    for rank in range(N):
        device.direct(streams[rank], programs[rank])
    for stream in streams:
        _check(driver.cuStreamSynchronize(stream), "sync")
    wrong = _wrong(collective, plan, tensors, inputs, count)

    def eager(k: int) -> None:
        for _ in range(k):
            for rank in range(N):
                device.direct(streams[rank], programs[rank])

    eager(20)
    eager_us = _elapsed_us(device, streams, eager, iters)
    # the same calls captured into one graph (both ranks' chains as branches)
    per_graph = 20
    device.activate()
    _check(driver.cuStreamBeginCapture(streams[0],
                                       driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
           "capture")
    fork, join = driver.cuEventCreate(0)[1], driver.cuEventCreate(0)[1]
    _check(driver.cuEventRecord(fork, streams[0]), "record")
    _check(driver.cuStreamWaitEvent(streams[1], fork, 0), "wait")
    eager(per_graph)
    _check(driver.cuEventRecord(join, streams[1]), "record")
    _check(driver.cuStreamWaitEvent(streams[0], join, 0), "wait")
    result = driver.cuStreamEndCapture(streams[0])
    _check(result, "end capture")
    result = driver.cuGraphInstantiate(result[1], 0)
    _check(result, "instantiate")
    graph = result[1]

    def replay(k: int) -> None:
        for _ in range(max(1, k // per_graph)):
            _check(driver.cuGraphLaunch(graph, streams[0]), "launch")

    replay(per_graph * 5)
    graph_us = _elapsed_us(device, streams, replay, per_graph * max(1, iters // per_graph))
    wrong += _wrong(collective, plan, tensors, inputs, count)
    return dict(collective=collective, form="in" if in_place else "out", bytes=nbytes,
                blocks=plan.kernel_blocks, eager_us=eager_us, graph_us=graph_us, wrong=wrong)


def _wrong(collective, plan, tensors, inputs, count) -> int:
    """Wrong output elements on both ranks, against numpy."""
    import torch

    def output(rank, name, start, elements):
        tensor = tensors[(rank, name)][start:start + 2 * elements]
        return tensor.view(torch.bfloat16).float().cpu().numpy()
    wrong = 0
    nb = count * 2
    if collective == "all_gather":
        full = np.concatenate([inputs[(r, "recv", r * nb)] for r in range(N)])
        for r in range(N):
            wrong += int(np.sum(output(r, "recv", 0, N * count) != full))
    elif collective == "all_to_all":
        for r in range(N):
            want = np.concatenate([inputs[(p, "send", 0)][r * count:(r + 1) * count]
                                   for p in range(N)])
            wrong += int(np.sum(output(r, "recv", 0, N * count) != want))
    elif collective == "broadcast":
        for r in range(1, N):
            wrong += int(np.sum(output(r, "recv", 0, count) != inputs[(0, "recv", 0)]))
    elif collective == "reduce_scatter":
        total = sum(inputs[(r, "send", 0)] for r in range(N))
        for r in range(N):
            wrong += int(np.sum(output(r, "recv", 0, count) != total[r * count:(r + 1) * count]))
    else:
        total = sum(inputs[(r, "send", 0)] for r in range(N))
        for r in range(N):
            wrong += int(np.sum(output(r, "recv", 0, count) != total))
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8K,64K,256K,1M")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--kernel-sms", type=int, default=16)
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--out", default=None, help="a JSON file for the records")
    args = parser.parse_args()
    import torch
    torch.cuda.init()
    device = backend.open_device(0, max_sms=8, copy_sms=8)
    pads = [SignalPad(device, rank, N) for rank in range(N)]
    for pad in pads:
        pad.connect([other.address for other in pads])
    # each rank's completion and error words as a communicator has them (the launches
    # here carry no completion value: only a mismatch would write the error word)
    executors = [Executor(rank, device,
                          StreamManager(device, pads[rank].completion,
                                        device.alloc_host_word().address,
                                        device.alloc_host_word().address),
                          pads[rank], SmCaps(8, 8)) for rank in range(N)]
    streams = [device.create_stream() for _ in range(N)]
    records = []
    print(f"direct kernels, 2 ranks on one GPU ({torch.cuda.get_device_name(0)}), bfloat16, "
          f"one process: loopback, not NVLink")
    print("| collective | form | size | blocks | eager us/call | graph us/call | wrong |")
    print("|---|---|---|---|---|---|---|")
    for collective in args.collectives.split(","):
        for index, size in enumerate(args.sizes.split(",")):
            record = measure(device, pads, executors, streams, collective, parse_size(size),
                             args.kernel_sms, args.iters, seed=index)
            records.append(record)
            print(f"| {collective} | {record['form']} | {human(record['bytes'])} | "
                  f"{record['blocks']} | {record['eager_us']:.1f} | {record['graph_us']:.1f} | "
                  f"{record['wrong']} |", flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"command": " ".join(sys.argv), "records": records}, handle, indent=1)


if __name__ == "__main__":
    main()
