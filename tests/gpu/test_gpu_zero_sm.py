"""The SM-starved test: every SM of every GPU is held by a spinning kernel while a
collective runs on another stream.  A collective that needs no SM finishes long
before the spin ends; one that needs SMs waits for it (docs/architecture.md, "Zero-SM
synchronisation" and "A rank's own block")."""

import time

import numpy as np
import pytest

from hoccl.testing import ArrayModule, assert_exact, poison, random_array

pytestmark = pytest.mark.gpu

SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    extern __shared__ char hold[];
    long long start = clock64();
    while (clock64() - start < cycles) { }
    if (threadIdx.x == 0) hold[0] = 1;
}
"""
SPIN_MS = 400


def _hold_every_sm(comms):
    """Launch the spinning kernel on every GPU; returns (events after the spin, streams)."""
    import cupy
    done, streams = [], []
    for comm in comms:
        with cupy.cuda.Device(comm.device):
            kernel = cupy.RawKernel(SPIN_SOURCE, "spin")
            kernel.max_dynamic_shared_size_bytes = 100 * 1024
            attributes = cupy.cuda.runtime.getDeviceProperties(comm.device)
            sms, clock_khz = attributes["multiProcessorCount"], attributes["clockRate"]
            stream = cupy.cuda.Stream(non_blocking=True)
            kernel((2 * sms,), (1024,), (np.int64(SPIN_MS * clock_khz),), stream=stream,
                   shared_mem=100 * 1024)
            event = cupy.cuda.Event()
            event.record(stream)
            done.append(event)
            streams.append(stream)
    return done, streams


def _starved(comms, launch):
    """Run ``launch(streams)`` while every SM spins; True when it completed before the spin."""
    import cupy
    for comm in comms:
        cupy.cuda.Device(comm.device).synchronize()
    spin_done, _ = _hold_every_sm(comms)
    time.sleep(0.02)  # let the spin occupy every SM first
    streams, finished = [], []
    for comm in comms:
        with cupy.cuda.Device(comm.device):
            streams.append(cupy.cuda.Stream(non_blocking=True))
    launch(streams)
    for comm, stream in zip(comms, streams):
        with cupy.cuda.Device(comm.device):
            event = cupy.cuda.Event()
            event.record(stream)
            finished.append(event)
    deadline = time.monotonic() + SPIN_MS / 1000 * 0.5
    while time.monotonic() < deadline:
        if all(e.done for e in finished):
            break
        time.sleep(0.001)
    completed_first = all(e.done for e in finished) and not all(e.done for e in spin_done)
    for comm in comms:
        cupy.cuda.Device(comm.device).synchronize()
    return completed_first


def _buffers(comms, count, blocks_in_recv, in_place, seed):
    arrays = ArrayModule("cupy")
    n = comms[0].world_size
    rng = np.random.default_rng(seed)
    data = [random_array(rng, count, "uint8") for _ in range(n)]
    recvs, sends = [], []
    for comm in comms:
        full = poison(count * blocks_in_recv, "uint8")
        if in_place:
            full[comm.rank * count:(comm.rank + 1) * count] = data[comm.rank]
        recvs.append(arrays.asarray(full, comm.device))
        sends.append(recvs[-1][comm.rank * count:(comm.rank + 1) * count] if in_place
                     else arrays.asarray(data[comm.rank], comm.device))
    return data, sends, recvs


@pytest.mark.parametrize("in_place", [True, False])
def test_all_gather_needs_no_sm(gpu_comms, gpu_options, in_place):
    if len(gpu_comms) < 2:
        pytest.skip("needs two GPUs (a peer to send to, or to route the own block through)")
    gpu_options(self_route="peer")
    n, count = gpu_comms[0].world_size, 64 << 20
    data, sends, recvs = _buffers(gpu_comms, count, n, in_place, 41)

    def launch(streams):
        for comm, stream in zip(gpu_comms, streams):
            comm.all_gather(sends[comm.rank], recvs[comm.rank], stream=stream)
    assert _starved(gpu_comms, launch), "all_gather waited for SMs"
    for comm in gpu_comms:
        assert_exact(f"all_gather: rank {comm.rank}", np.concatenate(data),
                     recvs[comm.rank].get())


def test_all_to_all_broadcast_gather_scatter_send_recv_barrier_need_no_sm(gpu_comms,
                                                                         gpu_options):
    if len(gpu_comms) < 2:
        pytest.skip("needs two GPUs (a peer to send to, or to route the own block through)")
    gpu_options(self_route="peer")
    n, count = gpu_comms[0].world_size, 16 << 20
    arrays = ArrayModule("cupy")
    rng = np.random.default_rng(43)
    source = [random_array(rng, count * n, "uint8") for _ in range(n)]
    a2a_in = [arrays.asarray(source[c.rank], c.device) for c in gpu_comms]
    a2a_out = [arrays.asarray(poison(count * n, "uint8"), c.device) for c in gpu_comms]
    bcast = [arrays.asarray(source[0][:count] if c.rank == 0 else poison(count, "uint8"), c.device)
             for c in gpu_comms]
    gathered = arrays.asarray(poison(count * n, "uint8"), gpu_comms[0].device)
    scattered = [arrays.asarray(poison(count, "uint8"), c.device) for c in gpu_comms]

    def launch(streams):
        for comm, stream in zip(gpu_comms, streams):
            r = comm.rank
            comm.all_to_all(a2a_in[r], a2a_out[r], stream=stream)
            comm.broadcast(bcast[r], bcast[r], 0, stream=stream)
            comm.gather(a2a_in[r][:count], gathered if r == 0 else None, 0, stream=stream)
            comm.scatter(a2a_in[r] if r == 0 else None, scattered[r], 0, stream=stream)
            comm.barrier(stream=stream)
        if n > 1:
            for comm, stream in zip(gpu_comms, streams):
                if comm.rank == 0:
                    comm.send(a2a_in[0][:count], 1, stream=stream)
                if comm.rank == 1:
                    comm.recv(scattered[1], 0, stream=stream)
    assert _starved(gpu_comms, launch), "a copy collective waited for SMs"
    for comm in gpu_comms:
        r = comm.rank
        want = np.concatenate([source[p][r * count:(r + 1) * count] for p in range(n)])
        assert_exact(f"all_to_all: rank {r}", want, a2a_out[r].get())
        assert_exact(f"broadcast: rank {r}", source[0][:count], bcast[r].get())
    assert_exact("gather: rank 0", np.concatenate([s[:count] for s in source]), gathered.get())
    if n > 1:
        assert_exact("recv: rank 1", source[0][:count], scattered[1].get())


def test_local_route_and_reductions_do_use_sms(gpu_comms, gpu_options):
    """The control: a same-GPU copy (local route) and a reduction wait for the spin."""
    n, count = gpu_comms[0].world_size, 16 << 20
    gpu_options(self_route="local")
    data, sends, recvs = _buffers(gpu_comms, count, n, False, 47)

    def launch(streams):
        for comm, stream in zip(gpu_comms, streams):
            comm.all_gather(sends[comm.rank], recvs[comm.rank], stream=stream)
    assert not _starved(gpu_comms, launch), "the local route should need SMs"
    for comm in gpu_comms:
        assert_exact(f"all_gather: rank {comm.rank}", np.concatenate(data),
                     recvs[comm.rank].get())
    arrays = ArrayModule("cupy")
    sums = [arrays.asarray(poison(count, "uint8"), comm.device) for comm in gpu_comms]

    def reduce(streams):
        for comm, stream in zip(gpu_comms, streams):
            comm.all_reduce(sends[comm.rank], sums[comm.rank], stream=stream)
    assert not _starved(gpu_comms, reduce), "a reduction should need SMs"
    for comm in gpu_comms:
        assert_exact(f"all_reduce: rank {comm.rank}", sum(data).astype(np.uint8),
                     sums[comm.rank].get())
