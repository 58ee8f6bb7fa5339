"""Where a small call's time goes.  Run: mpirun -np 2 python3 tools/profile_call.py

Prints, per rank, the host µs of one in-place all_gather (or ``--collective``; no sync)
and of the pieces it is made of (array resolution, export, the entry fence, batched
memops, one peer copy, a mailbox round trip), then a cProfile of the call loop on rank 0;
with ``--local`` it measures one process driving every GPU instead (no MPI exchange).
"""
import argparse
import cProfile
import ctypes
import io
import pstats
import time

import torch

import hoccl
from hoccl._buffers import as_buffer
from hoccl.backends._base import MemOp
from hoccl.bench._harness import parse_size


def per_call(function, iters):
    function()
    start = time.perf_counter()
    for _ in range(iters):
        function()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="1M")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--local", action="store_true")
    parser.add_argument("--collective", default="all_gather",
                        choices=("all_gather", "all_reduce", "reduce_scatter"),
                        help="all_gather and all_reduce in place, reduce_scatter out of place")
    parser.add_argument("--kernel-bytes", default="0",
                        help="Options.kernel_bytes (calls up to it run as direct kernels)")
    parser.add_argument("--burst", type=int, default=0,
                        help="time the calls in bursts of this many, synchronizing between "
                             "bursts (the synchronization not timed): the host's own cost "
                             "when the device cannot keep up, as with two ranks on one GPU")
    parser.add_argument("--registered", action="store_true",
                        help="the buffer registered with hoccl.empty (no descriptor exchange)")
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    if args.local:
        comms = hoccl.init_local(list(range(torch.cuda.device_count())), backend="cuda",
                                 kernel_bytes=parse_size(args.kernel_bytes))
    else:
        comms = [hoccl.init(backend="cuda", kernel_bytes=parse_size(args.kernel_bytes))]
        torch.cuda.set_device(comms[0].device)
    n = comms[0].world_size
    calls = []
    for comm in comms:
        if args.registered:
            recv = hoccl.empty(nbytes // 2, "bfloat16", comm, framework="torch")
            recv.zero_()
        else:
            recv = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=f"cuda:{comm.device}")
        block = recv.numel() // n
        send = recv[comm.rank * block:(comm.rank + 1) * block]
        with torch.cuda.device(comm.device):
            stream = torch.cuda.Stream()
        calls.append((comm, send, recv, stream))

    def run():
        for comm, send, recv, stream in calls:
            if args.collective == "all_gather":
                comm.all_gather(send, recv, stream=stream)
            elif args.collective == "all_reduce":
                comm.all_reduce(recv, recv, stream=stream)
            else:
                comm.reduce_scatter(recv, send, stream=stream)
    for _ in range(100):
        run()
    for comm in comms:
        comm.synchronize()
    barrier = (lambda: None) if args.local else __import__("mpi4py.MPI").MPI.COMM_WORLD.Barrier
    barrier()
    if args.burst:
        spent = 0.0
        for _ in range(-(-args.iters // args.burst)):
            start = time.perf_counter()
            for _ in range(args.burst):
                run()
            spent += time.perf_counter() - start
            for comm in comms:
                comm.synchronize()
            barrier()
        host = spent / (-(-args.iters // args.burst) * args.burst) * 1e6 / len(comms)
    else:
        host = per_call(run, args.iters) / len(comms)
    for comm in comms:
        comm.synchronize()
    where = "one process" if args.local else f"rank {comms[0].rank}"
    kind = "out of place" if args.collective == "reduce_scatter" else "in place"
    kind += ", registered" if args.registered else ""
    print(f"{where}: {args.collective} {args.size} {kind}: {host:.1f} µs of host time per "
          f"rank-call", flush=True)

    comm, send, recv, stream = calls[0]
    engine = comm._engine
    device, streams = engine.device, engine.streams
    device.activate()
    streams.ensure_lanes(1)  # a call of one lane ran on the caller's stream: none made yet
    lane = streams.lanes[0]
    parts = {"as_buffer (torch tensor)": lambda: as_buffer("x", "y", recv),
             "export (cached allocation)": lambda: device.export(recv.data_ptr())}
    caller = device.resolve_stream(stream, [recv])

    def fence():
        streams.release(streams.fence_in(caller, 0))
    parts["entry fence (record + wait_value)"] = fence
    slot = engine.pad.local(engine.pad.slots - 1)  # a slot no peer writes to on a 2-rank test
    counter = [0]

    def memops():
        counter[0] += 1
        device.memops(lane, [(MemOp.WRITE, slot, counter[0]), (MemOp.WAIT, slot, counter[0]),
                             (MemOp.WRITE, slot, counter[0])])
    parts["memops: write, wait, write"] = memops

    def two_writes():  # a call's completion writes, as single calls
        counter[0] += 1
        device.write_value(lane, slot, counter[0])
        device.write_value(lane, slot, counter[0])
    parts["memops: two writes, single calls"] = two_writes

    def two_writes_memops():  # the same through ``memops``, as a call makes them
        counter[0] += 1
        device.memops(lane, [(MemOp.WRITE, slot, counter[0]), (MemOp.WRITE, slot, counter[0])])
    parts["memops: two writes, memops()"] = two_writes_memops
    from cuda.bindings import driver as cuda_driver

    from hoccl.backends import cuda as cuda_backend
    batch = [cuda_backend._memop(MemOp.WRITE, slot) for _ in range(2)]

    def two_writes_batched():  # the same, one cuStreamBatchMemOp of kept structs
        counter[0] += 1
        for _, part in batch:
            part.value64 = counter[0]
        cuda_driver.cuStreamBatchMemOp(lane, 2, [entry[0] for entry in batch], 0)
    parts["memops: two writes, one batch (kept)"] = two_writes_batched
    parts["cuStreamIsCapturing"] = lambda: device.capturing(caller)
    scratch = device.alloc(nbytes)
    parts["cuMemcpyAsync 512 KiB, same GPU"] = lambda: device.copy(lane, scratch, recv.data_ptr(),
                                                                  nbytes // 2)
    parts["cuEventRecord + cuStreamWaitEvent"] = lambda: device.wait_event(
        lane, _record(device, streams, caller))
    parts["cuCtxSetCurrent"] = device.activate
    parts["local_copy 512 KiB (kept launch)"] = lambda: device.local_copy(
        lane, scratch, recv.data_ptr(), nbytes // 2)
    parts["cuMemcpyDtoDAsync 512 KiB"] = lambda: cuda_driver.cuMemcpyDtoDAsync(
        int(scratch), recv.data_ptr(), nbytes // 2, lane)
    from hoccl.backends._cuda_driver import _WAIT_GEQ, _WRITE_DEFAULT
    launch = device._copy_launch_of(int(scratch), recv.data_ptr(), nbytes // 2, device.copy_sms)
    launch_args = (launch[0], launch[1], 1, 1, launch[2], 1, 1, 0, lane,
                   ctypes.addressof(launch[3]), 0)
    parts["cuLaunchKernel copy (raw, kept args)"] = lambda: cuda_driver.cuLaunchKernel(
        *launch_args)
    parts["cuStreamWriteValue64 device word (raw)"] = lambda: cuda_driver.cuStreamWriteValue64(
        lane, slot, 1, _WRITE_DEFAULT)
    host_word = engine.host_word.address
    parts["cuStreamWriteValue64 host word (raw)"] = lambda: cuda_driver.cuStreamWriteValue64(
        lane, host_word, 1, _WRITE_DEFAULT)
    parts["cuStreamWaitValue64 host word (raw)"] = lambda: cuda_driver.cuStreamWaitValue64(
        lane, host_word, 0, _WAIT_GEQ)
    graph_stream = torch.cuda.Stream(device=comm.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=graph_stream, capture_error_mode="thread_local"):
        scratch_tensor = torch.empty_like(recv)
        scratch_tensor.copy_(recv)
    parts["CUDA graph of one copy_, replay()"] = graph.replay
    from hoccl._buffers import repeat_key
    from hoccl._repeats import Repeats
    parts["repeat_key (torch tensor)"] = lambda: repeat_key(recv)
    parts["Repeats.key (the call's arguments)"] = lambda: Repeats.key(
        args.collective, (send, recv), {})
    if not args.local:
        mailboxes = comm._group.mailboxes
        peer = 1 - comm.rank if n == 2 else None
        if peer is not None:
            import pickle
            description = pickle.dumps((("probe",), {"recv": device.export(recv.data_ptr())}))

            def round_trip():  # a message of a call's form: (key, pickled description)
                mailboxes.send(peer, (("probe",), description, None), time.monotonic() + 30,
                               "probe")
                while not mailboxes.ready(peer):
                    pass
                mailboxes.receive(peer)
            parts["mailbox exchange with the peer"] = round_trip
    for name, function in parts.items():
        if name == "mailbox exchange with the peer":
            barrier()
        print(f"{where}:   {name:40s} {per_call(function, args.iters):7.2f} µs", flush=True)
    device.synchronize_stream(lane, 30)
    device.free(scratch)

    barrier()
    profile = cProfile.Profile()
    burst = args.burst or args.iters
    for _ in range(-(-args.iters // burst)):
        profile.enable()
        for _ in range(burst):
            run()
        profile.disable()
        for comm in comms:
            comm.synchronize()
        barrier()
    if comms[0].rank == 0:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())
    for comm in comms:
        comm.close()


_EVENT = []


def _record(device, streams, stream):
    if not _EVENT:
        _EVENT.append(streams.event())
    device.record(stream, _EVENT[0])
    return _EVENT[0]


if __name__ == "__main__":
    main()
