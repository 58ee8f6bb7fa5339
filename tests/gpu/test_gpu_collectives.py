"""Every collective on real GPUs in one process (init_local over all visible GPUs),
against numpy bit for bit, fresh random data, poisoned outputs; and the same checker
failing on faults planted in real GPU outputs.  The mpirun mode runs
tests/mpi/run_checks.py --backend cuda on the device machine (tools/gpu_run.sh)."""

import numpy as np
import pytest

from hoccl.testing import (FAULTS, IN_PLACE_FORMS, ArrayModule, PlantedFault, array_module_for,
                           assert_exact, check_collective, poison, random_array)

pytestmark = pytest.mark.gpu

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce",
               "gather", "scatter", "send_recv")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("reduce_scatter", "all_reduce", "reduce")
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("route", ["peer", "local"])
def test_every_collective_every_dtype_small_and_odd_sizes(gpu_comms, gpu_options, collective,
                                                          route):
    gpu_options(self_route=route, chunk_bytes=4096)
    n, seed = gpu_comms[0].world_size, 0
    for dtype in DTYPES:
        for count in (0, 1, 1001, 65537):
            for in_place in ([False, True] if collective in IN_PLACE_FORMS else [False]):
                for root in (sorted({0, n - 1}) if collective in ROOTED else [0]):
                    for op in (("sum", "prod", "max", "min", "avg") if collective in REDUCING
                               else ("sum",)):
                        seed += 1
                        check_collective(gpu_comms, collective, count=count, dtype=dtype, op=op,
                                         root=root, in_place=in_place, seed=seed)


DIRECT = ("all_gather", "all_to_all", "broadcast", "reduce_scatter", "all_reduce")


@pytest.mark.parametrize("collective", DIRECT)
def test_direct_kernel_every_dtype_op_and_form(gpu_comms, gpu_options, collective):
    """``kernel_bytes``: one direct kernel per rank (peers' memory over NVLink from SMs,
    signals in the pads' kernel slots), odd sizes (elements after the last 16-byte vector,
    one block's share misaligned) up to several blocks, every dtype, op and form, a
    scaled sum; then 200 calls in a row (the epoch advancing by one each), all exact."""
    if len(gpu_comms) < 2:
        pytest.skip("needs two GPUs (one rank has no peer: its calls are plain copies)")
    gpu_options(kernel_bytes=1 << 20, kernel_sms=8)
    n, seed = gpu_comms[0].world_size, 7000
    for dtype in DTYPES:
        for count in (0, 1, 17, 1001, 65537 // n):
            for in_place in ([False, True] if collective in IN_PLACE_FORMS else [False]):
                for root in (sorted({0, n - 1}) if collective == "broadcast" else [0]):
                    for op in (("sum", "prod", "max", "min", "avg") if collective in REDUCING
                               else ("sum",)):
                        seed += 1
                        check_collective(gpu_comms, collective, count=count, dtype=dtype, op=op,
                                         root=root, in_place=in_place, seed=seed)
    if collective in REDUCING:
        check_collective(gpu_comms, collective, count=4099, dtype="bfloat16", scale=0.125,
                         in_place=True, seed=seed + 1)
    epochs = [comm._engine.device.peek(comm._engine.pad.kernel_counter, 1)[0]
              for comm in gpu_comms]
    assert len(set(epochs)) == 1 and epochs[0] >= 10, epochs
    for repeat in range(200):
        check_collective(gpu_comms, collective, count=4096, dtype="float32", seed=seed + 2 + repeat)
    after = [comm._engine.device.peek(comm._engine.pad.kernel_counter, 1)[0] for comm in gpu_comms]
    assert after == [epochs[0] + 200] * n, (epochs, after)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"])
def test_megabyte_sums_and_own_blocks_every_dtype_and_op(gpu_comms, collective):
    """Sums and own-block copies of ~10 MiB with the default 32 MiB chunks: the kernels'
    full grid of blocks, elements before the first 16-byte boundary and after the last
    vector, every dtype and op, in and out of place."""
    n = gpu_comms[0].world_size
    seed = 1000
    for dtype in DTYPES:
        itemsize = np.dtype("float16" if dtype == "bfloat16" else dtype).itemsize
        count = (40 * (256 << 10) + 4099) // itemsize
        if collective in ("reduce_scatter", "all_to_all"):
            count //= n
        for op in (("sum", "prod", "max", "min", "avg") if collective in REDUCING else ("sum",)):
            for in_place in ([False, True] if collective in IN_PLACE_FORMS else [False]):
                seed += 1
                check_collective(gpu_comms, collective, count=count, dtype=dtype, op=op,
                                 in_place=in_place, seed=seed)


@pytest.mark.parametrize("collective", REDUCING)
def test_scaled_sums_every_float_dtype(gpu_comms, gpu_options, collective):
    """A sum's ``scale`` (torch's PREMUL_SUM) multiplied by the reduction kernel before it
    rounds, bit for bit against the reference: small and odd sizes through several chunks
    (``chunk_bytes=4096``), then ~10 MiB with the default chunks."""
    n, seed = gpu_comms[0].world_size, 5000
    for chunk_bytes, counts in ((4096, (1, 1001, 65537)), (32 << 20, ((5 << 20) // n,))):
        gpu_options(chunk_bytes=chunk_bytes)
        for dtype in ("float16", "bfloat16", "float32", "float64"):
            for count in counts:
                for in_place, scale in ((False, 0.125), (True, 1 / 3)):
                    seed += 1
                    check_collective(gpu_comms, collective, count=count, dtype=dtype,
                                     root=n - 1, in_place=in_place, scale=scale, seed=seed)


@pytest.mark.parametrize("collective,dtype,total_bytes", [
    ("all_gather", "uint8", 1 << 30), ("all_to_all", "uint8", 256 << 20),
    ("all_reduce", "int32", 256 << 20), ("reduce_scatter", "bfloat16", 64 << 20),
    ("broadcast", "int32", 64 << 20), ("gather", "int64", 64 << 20),
    ("scatter", "uint8", 64 << 20), ("reduce", "float16", 16 << 20)])
@pytest.mark.parametrize("in_place", [False, True])
def test_large_messages_up_to_one_gibibyte(gpu_comms, collective, dtype, total_bytes, in_place):
    if in_place and collective not in IN_PLACE_FORMS:
        pytest.skip("no in-place form")
    n = gpu_comms[0].world_size
    itemsize = np.dtype("float16" if dtype == "bfloat16" else dtype).itemsize
    per_rank = total_bytes // itemsize // n
    count = per_rank if collective in ("all_gather", "gather", "reduce_scatter", "all_to_all",
                                       "scatter") else per_rank * n
    if collective == "all_to_all":
        count //= n
    check_collective(gpu_comms, collective, count=count + 3 if collective != "all_to_all" else count,
                     dtype=dtype, in_place=in_place, seed=7, root=n - 1)


def test_user_streams_cupy_and_torch(gpu_comms):
    import cupy
    import torch
    cupy_streams = []
    for comm in gpu_comms:
        with cupy.cuda.Device(comm.device):
            cupy_streams.append(cupy.cuda.Stream(non_blocking=True))
    check_collective(gpu_comms, "all_gather", count=4099, dtype="float32", seed=3,
                     streams=cupy_streams)
    torch_streams = [torch.cuda.Stream(device=comm.device) for comm in gpu_comms]
    check_collective(gpu_comms, "all_reduce", count=4099, dtype="bfloat16", seed=4,
                     streams=torch_streams)
    handles = [s.ptr for s in cupy_streams]
    check_collective(gpu_comms, "all_to_all", count=333, dtype="int32", seed=5, streams=handles)


def test_kernels_before_and_after_on_the_same_stream_need_no_host_sync(gpu_comms):
    """A kernel writes the input just before the collective and another reads the output just
    after, on the caller's current stream; the host never synchronizes in between."""
    import cupy
    n, count = gpu_comms[0].world_size, 1 << 22
    rng = np.random.default_rng(17)
    values = [random_array(rng, count, "float32") for _ in range(n)]
    sources, sends, recvs, doubled = [], [], [], []
    for comm in gpu_comms:
        with cupy.cuda.Device(comm.device):
            sources.append(cupy.asarray(values[comm.rank]))
            sends.append(cupy.empty(count, cupy.float32))
            recvs.append(cupy.asarray(poison(count * n, "float32")))
    for comm in gpu_comms:
        with cupy.cuda.Device(comm.device):
            # compile (module load) before: loading a module may synchronize the device,
            # which must not happen between two ranks' calls of one collective
            cupy.multiply(sources[comm.rank], 2, out=sends[comm.rank])
            recvs[comm.rank] + 1
            cupy.cuda.Device(comm.device).synchronize()
    for comm in gpu_comms:
        with cupy.cuda.Device(comm.device):
            cupy.multiply(sources[comm.rank], 2, out=sends[comm.rank])   # kernel before
            comm.all_gather(sends[comm.rank], recvs[comm.rank])          # stream=None: current
            doubled.append(recvs[comm.rank] + 1)                          # kernel after
    want = np.concatenate(values) * np.float32(2) + np.float32(1)  # the same float32 operations
    for comm in gpu_comms:
        with cupy.cuda.Device(comm.device):
            assert_exact(f"all_gather between kernels: rank {comm.rank}", want,
                         doubled[comm.rank].get())


def test_back_to_back_on_different_streams_and_a_thousand_in_a_loop(gpu_comms):
    import cupy
    n = gpu_comms[0].world_size
    streams = []
    for comm in gpu_comms:
        with cupy.cuda.Device(comm.device):
            streams.append([cupy.cuda.Stream(non_blocking=True) for _ in range(2)])
    check_collective(gpu_comms, "all_reduce", count=1 << 20, dtype="int32", seed=21,
                     streams=[s[0] for s in streams], synchronize=False)
    check_collective(gpu_comms, "all_gather", count=1 << 18, dtype="float32", seed=22,
                     streams=[s[1] for s in streams])
    arrays = ArrayModule("cupy")
    rng = np.random.default_rng(23)
    loops = 1000
    data = [[random_array(rng, 64, "int32") for _ in range(n)] for _ in range(loops)]
    sends = [[arrays.asarray(d[c.rank], c.device) for c in gpu_comms] for d in data]
    recvs = [[arrays.asarray(poison(64 * n, "int32"), c.device) for c in gpu_comms]
             for _ in range(loops)]
    for i in range(loops):
        for comm in gpu_comms:
            comm.all_gather(sends[i][comm.rank], recvs[i][comm.rank])
    for comm in gpu_comms:
        comm.synchronize()
    for i in range(0, loops, 37):
        for comm in gpu_comms:
            assert_exact(f"all_gather {i}: rank {comm.rank}", np.concatenate(data[i]),
                         arrays.to_numpy(recvs[i][comm.rank], "int32"))


def test_send_recv_and_barrier(gpu_comms):
    if len(gpu_comms) < 2:
        pytest.skip("needs two GPUs (a peer to send to, or to route the own block through)")
    n = gpu_comms[0].world_size
    arrays = ArrayModule("cupy")
    rng = np.random.default_rng(31)
    data = [random_array(rng, 12345, "float64") for _ in range(n)]
    sends = [arrays.asarray(data[c.rank], c.device) for c in gpu_comms]
    recvs = [arrays.asarray(poison(12345, "float64"), c.device) for c in gpu_comms]
    for comm in gpu_comms:
        r = comm.rank
        if r % 2 == 0:
            comm.send(sends[r], (r + 1) % n)
            comm.recv(recvs[r], (r - 1) % n)
        else:
            comm.recv(recvs[r], (r - 1) % n)
            comm.send(sends[r], (r + 1) % n)
    for comm in gpu_comms:
        comm.barrier()
    for comm in gpu_comms:
        comm.synchronize()
    for comm in gpu_comms:
        assert_exact(f"recv: rank {comm.rank}", data[(comm.rank - 1) % n],
                     arrays.to_numpy(recvs[comm.rank], "float64"))


@pytest.mark.parametrize("fault", FAULTS)
def test_the_checker_fails_on_faults_planted_in_real_gpu_outputs(gpu_comms, fault):
    """Every output corrupted in GPU memory after the collective and before the checker reads
    it (a flipped low bit, shifted blocks, a block set back to poison): every collective,
    dtype and form must fail the check that the same calls pass above."""
    n, count, caught = gpu_comms[0].world_size, 1001, 0
    for seed, (collective, dtype) in enumerate((c, d) for c in COLLECTIVES for d in DTYPES):
        if collective == "send_recv" and n == 1:
            continue
        for in_place in ([False, True] if collective in IN_PLACE_FORMS else [False]):
            arrays = PlantedFault(array_module_for("cuda", dtype), fault, block=count)
            with pytest.raises(AssertionError) as info:
                check_collective(gpu_comms, collective, count=count, dtype=dtype, root=n - 1,
                                 in_place=in_place, seed=seed, arrays=arrays)
            assert str(info.value).startswith(f"{collective}: rank "), str(info.value)
            assert ("unwritten (still poison)" in str(info.value)) == (fault == "unwritten")
            caught += 1
    assert caught >= 8 * len(DTYPES), caught
