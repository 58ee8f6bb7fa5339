"""The public API under mpirun, one rank per process: run with
``mpiexec -n N python run_checks.py [--backend B] [--plant-fault FAULT]``.

Every rank draws the same inputs from the same seeds, runs each collective through
``hoccl.init()`` and checks its own output against numpy bit for bit
(``hoccl.testing.check_collective``).  A case fails when it failed on any rank.  Rank 0
prints ``N passed, M failed`` at the end; every rank prints each of its failures; the
exit status is non-zero when a case failed.

``--plant-fault flip|shift|unwritten`` corrupts every output just before it is read
(``hoccl.testing.PlantedFault``), to show the checks fail on it: every case must then
fail with an AssertionError.  Rank 0 prints ``N passed, M failed`` per collective and in
total, and the exit status is non-zero when a case passed or raised anything else.
Counts below 2 are left out there (an empty output has nothing to corrupt, and one
element cannot shift).
"""

import argparse
import sys
import traceback

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import (FAULTS, IN_PLACE_FORMS, ArrayModule, PlantedFault, RegisteredArrays,
                           array_module_for, assert_exact, check_collective, poison, random_array)

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce",
               "gather", "scatter", "send_recv")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("reduce_scatter", "all_reduce", "reduce")
PASSED, FAILED, ERROR = 0, 1, 2  # a case's outcome; the worst over the ranks counts
SHARED = [False]  # --shared-memory


def arrays_for(backend, dtype):
    """The arrays of a case: ``--shared-memory``'s, or the backend's own."""
    return ArrayModule("shared") if SHARED[0] else array_module_for(backend, dtype)


def cases(world_size, dtypes, counts):
    seed = 0
    for collective in COLLECTIVES:
        if collective == "send_recv" and world_size == 1:
            continue
        for dtype in dtypes:
            for count in counts:
                for in_place in ([False, True] if collective in IN_PLACE_FORMS else [False]):
                    roots = sorted({0, world_size - 1}) if collective in ROOTED else [0]
                    ops = ["sum", "max", "avg"] if collective in REDUCING else ["sum"]
                    for root in roots:
                        for op in ops:
                            seed += 1
                            yield dict(collective=collective, dtype=dtype, count=count,
                                       in_place=in_place, root=root, op=op, seed=seed)
                    if collective in REDUCING and "float" in dtype:
                        seed += 1  # a scaled sum (torch's PREMUL_SUM)
                        yield dict(collective=collective, dtype=dtype, count=count,
                                   in_place=in_place, root=roots[-1], op="sum", seed=seed,
                                   scale=0.375)


def check_reallocated_buffers(comm, seed):
    """Free a received-into buffer and allocate a new one (often at the same address, as a
    new allocation): the peers must write into the new one, never through a stale mapping
    of the old one."""
    arrays = arrays_for(comm.backend, "int32")
    n = comm.world_size
    for round_ in range(3):
        rng = np.random.default_rng(seed + round_)
        data = [random_array(rng, 1 << 16, "int32") for _ in range(n)]
        send = arrays.asarray(data[comm.rank], comm.device)
        recv = arrays.asarray(poison(n << 16, "int32"), comm.device)
        comm.all_gather(send, recv)
        comm.synchronize()
        assert_exact(f"round {round_} (a stale mapping?): rank {comm.rank}",
                     np.concatenate(data), arrays.to_numpy(recv, "int32"))
        del send, recv
        if comm.backend == "cuda":
            import cupy
            cupy.get_default_memory_pool().free_all_blocks()  # the next round allocates anew


def check_repeated_calls(comm, seed):
    """Repeated calls of one shape reuse their bound program: each must still move its
    own fresh data; a peer that alone switches buffers must be written in its new one;
    and a peer buffer registered too small for the plan is refused even after the shape
    has run (MismatchError on every rank, nothing written), after which the shape runs
    again."""
    arrays = arrays_for(comm.backend, "float32")
    n, rank, count = comm.world_size, comm.rank, 40
    rng = np.random.default_rng(seed)
    fulls = [arrays.asarray(poison(n * count, "float32"), comm.device) for _ in range(2)]
    for round_ in range(8):
        data = [random_array(rng, count, "float32") for _ in range(n)]
        # rank 0 keeps one buffer; the others alternate between two
        full = fulls[0 if rank == 0 else round_ % 2]
        full[:] = arrays.asarray(poison(n * count, "float32"), comm.device)
        full[rank * count:(rank + 1) * count] = arrays.asarray(data[rank], comm.device)
        comm.all_gather(full[rank * count:(rank + 1) * count], full)
        comm.synchronize()
        assert_exact(f"repeated all_gather round {round_}: rank {rank}", np.concatenate(data),
                     arrays.to_numpy(full, "float32"))
    if n == 1 or comm.options.kernel_bytes >= n * count * 4:
        return  # a direct kernel's peers touch only hoccl's ring, never this buffer
    engine = comm._engine
    prepare = engine.prepare

    def too_small(*args, **kwargs):
        call = prepare(*args, **kwargs)
        call.shared = {name: buffer._replace(nbytes=buffer.nbytes - 4)
                       for name, buffer in call.shared.items()}
        return call
    full = fulls[0]
    full[:] = arrays.asarray(poison(n * count, "float32"), comm.device)
    engine.prepare = too_small
    try:
        comm.all_gather(full[rank * count:(rank + 1) * count], full)
        raise AssertionError(f"rank {rank}: a peer buffer too small for the plan was accepted")
    except hoccl.MismatchError as error:
        assert "bytes into it" in str(error), str(error)
    finally:
        del engine.prepare
    comm.synchronize()
    assert_exact(f"refused all_gather: rank {rank} (written?)", poison(n * count, "float32"),
                 arrays.to_numpy(full, "float32"))
    data = [random_array(rng, count, "float32") for _ in range(n)]
    full[rank * count:(rank + 1) * count] = arrays.asarray(data[rank], comm.device)
    comm.all_gather(full[rank * count:(rank + 1) * count], full)
    comm.synchronize()
    assert_exact(f"all_gather after the refusal: rank {rank}", np.concatenate(data),
                 arrays.to_numpy(full, "float32"))


def run(world, comm, name, action, fault):
    """Run one case on this rank; its outcome over all ranks."""
    try:
        action()
        outcome = PASSED
    except AssertionError as error:
        outcome = FAILED
        if fault is None:
            print(f"rank {comm.rank} FAILED {name}\n{traceback.format_exc()}", flush=True)
        else:
            print(f"rank {comm.rank} caught fault={fault} in {name}: {error}"[:400], flush=True)
    except Exception:
        outcome = ERROR
        print(f"rank {comm.rank} ERROR {name}\n{traceback.format_exc()}", flush=True)
    return world.allreduce(outcome, op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16,int32,uint8")
    parser.add_argument("--counts", default="0,1,17,1000")
    parser.add_argument("--plant-fault", choices=FAULTS, default=None)
    parser.add_argument("--registered", action="store_true",
                        help="every buffer in a registered array (hoccl.empty), at the same "
                             "offsets on every rank: calls issued without a descriptor exchange")
    parser.add_argument("--shared-memory", action="store_true",
                        help="host backend: every array in host memory the peers map "
                             "(hoccl.host_empty), reached with loads and stores, not "
                             "cross-memory attach")
    parser.add_argument("--pull-bytes", type=int, default=0,
                        help="Options.pull_bytes: reductions up to this many bytes read the "
                             "peers' inputs where they lie")
    parser.add_argument("--kernel-bytes", type=int, default=0,
                        help="Options.kernel_bytes: collectives up to this many bytes run as "
                             "one direct kernel per rank")
    parser.add_argument("--chunk-bytes", type=int, default=0,
                        help="Options.chunk_bytes: small chunks give reductions many of them "
                             "(each lane's chunk sums then run as one launch, fuse_sums)")
    parser.add_argument("--fuse-sums", choices=("auto", "on", "off"), default="auto",
                        help="on: a reduction's chunk sums as one launch; off: a stream wait "
                             "and a launch per chunk; auto: the default (on, unless ranks "
                             "share a GPU)")
    args = parser.parse_args()
    SHARED[0] = args.shared_memory
    world = MPI.COMM_WORLD
    comm = hoccl.init(backend=args.backend, timeout=120)
    if args.chunk_bytes:
        comm.set_options(chunk_bytes=args.chunk_bytes)
    if args.fuse_sums != "auto":
        comm.set_options(fuse_sums=args.fuse_sums == "on")
    fused = [0]  # chunk sums issued as one launch (Device.reduce_chunks)
    device, reduce_chunks = comm._engine.device, comm._engine.device.reduce_chunks

    def counted(*a, **k):
        fused[0] += 1
        return reduce_chunks(*a, **k)
    device.reduce_chunks = counted
    if args.pull_bytes:
        comm.set_options(pull_bytes=args.pull_bytes)
    if args.kernel_bytes:
        comm.set_options(kernel_bytes=args.kernel_bytes)
    fault = args.plant_fault
    dtypes = args.dtypes.split(",")
    counts = [int(c) for c in args.counts.split(",") if fault is None or int(c) >= 2]
    outcomes = {collective: [] for collective in COLLECTIVES}
    registered = {}  # kind -> RegisteredArrays (one registered array per kind)
    largest = max(counts) * comm.world_size * 8
    for case in cases(comm.world_size, dtypes, counts):
        arrays = arrays_for(comm.backend, case["dtype"])
        if args.registered:
            arrays = registered.setdefault(arrays.kind, RegisteredArrays(
                arrays, slot_bytes=max(1 << 20, -(-largest // 4096) * 4096)))
        if fault is not None:
            arrays = PlantedFault(arrays, fault, block=case["count"])
        outcomes[case["collective"]].append(
            run(world, comm, str(case), lambda: check_collective([comm], arrays=arrays, **case),
                fault))
    if fault is None:
        outcomes["barrier"] = [run(world, comm, "barrier",
                                   lambda: (comm.barrier(), comm.synchronize()), None)]
        outcomes["reallocated buffers"] = [run(world, comm, "reallocated buffers",
                                               lambda: check_reallocated_buffers(comm, 11), None)]
        outcomes["repeated calls"] = [run(world, comm, "repeated calls",
                                          lambda: check_repeated_calls(comm, 12), None)]
    for arrays in registered.values():
        arrays.release()
    fast = world.allreduce(comm._engine.issued_fast, op=MPI.MIN)
    fused_launches = world.allreduce(fused[0], op=MPI.MIN)
    fuse_sums = comm.fuse_sums
    mapped = world.allreduce(getattr(device, "mapped_segments", 0), op=MPI.MIN)
    comm.close()
    every = [outcome for results in outcomes.values() for outcome in results]
    passed, failed, errors = (every.count(outcome) for outcome in (PASSED, FAILED, ERROR))
    if world.rank == 0:
        label = f"mpi ranks={world.size} backend={comm.backend}"
        if args.registered:
            label += f" registered ({fast} calls or more on each rank without an exchange)"
        if args.shared_memory:
            label += f" shared memory ({mapped} peer segments or more mapped on each rank)"
        if args.pull_bytes:
            label += f" pull_bytes={args.pull_bytes}"
        if args.kernel_bytes:
            label += f" kernel_bytes={args.kernel_bytes}"
            if not args.registered:  # a direct kernel's peers touch only the rings
                label += f" ({fast} calls or more on each rank without an exchange)"
        if args.chunk_bytes:
            label += (f" chunk_bytes={args.chunk_bytes} (fuse_sums={fuse_sums}: "
                      f"{fused_launches} or more one-launch chunk sums on each rank)")
        if fault is not None:
            label += f" fault={fault}"
            for collective, results in outcomes.items():
                print(f"{label} {collective}: {results.count(PASSED)} passed, "
                      f"{results.count(FAILED)} failed", flush=True)
        print(f"{label}: {passed} passed, {failed + errors} failed"
              f"{f' ({errors} by an error other than a wrong output)' if errors else ''}",
              flush=True)
    sys.exit(1 if errors or (passed if fault is not None else failed) else 0)


if __name__ == "__main__":
    main()
