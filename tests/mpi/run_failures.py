"""Failure scenarios under mpirun (2 ranks): ``python run_failures.py SCENARIO [--backend B]``.

mismatch   ranks call all_reduce with different counts: both raise
           MismatchError naming the call, the other rank and both values; the next
           collective still works.
dead       rank 1 dies with its part of an all_reduce still queued behind a long kernel
           (during a call); rank 0's synchronize raises PeerDeadError within 5 s, with the
           default 300 s timeout.
           Launch with the MPI's keep-going flag (MPICH: -disable-auto-cleanup).
absent     rank 1 never makes rank 0's call: rank 0's call raises HocclTimeoutError
           naming rank 1 after the timeout, and its stream is not left blocked.
killed     after a call both made, rank 1 is killed (SIGKILL) before a call rank 0 makes:
           rank 0's call raises naming rank 1's exited process within 5 s, with the
           default 300 s timeout.  Launch with the MPI's keep-going flag.
early      rank 1 is killed before any call: the same.
closed     after a call both made, rank 1 closes its communicator and stays alive; rank 0's
           next call (and then its synchronize) raises PeerClosedError naming the call
           and rank 1's close within 5 s, with the default 300 s timeout; the communicator
           is aborted, and its next call raises PeerClosedError too.  With
           ``--kernel-bytes`` the call goes without a message (a direct kernel whose peer's
           ring is known), so it is the wait on the device that learns of the close.
abort      after a first call both finished, rank 0's stream is held (a long kernel) so
           rank 1's all_reduce waits for it; rank 0 aborts; rank 1's wait is released and
           it learns of the abort
           (AbortedError naming rank 0) within its timeout, without hanging.  With
           ``--chunk-bytes``, a reduce_scatter of many chunks instead, whose sums on rank
           1 are one launch waiting on the device for rank 0's copies (``fuse_sums``): the
           abort's value in rank 1's pad ends it, and every lane of rank 1 drains.
Each surviving rank prints ``rank R: OK <what happened>`` or ``rank R: FAILED ...``.
"""

import argparse
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import array_module_for, poison


def _held_stream(comm, seconds):
    """A stream of ``comm``'s device held busy for ``seconds``: work enqueued on it after
    this waits (the twin of a long kernel before a collective)."""
    if comm.backend == "host":
        device = comm.device_handle
        stream = device.create_stream()
        stream.enqueue(lambda: time.sleep(seconds))
        return stream
    import cupy
    with cupy.cuda.Device(comm.device):
        # timed by the global nanosecond timer: an SM's cycle counter is not one clock
        # across a preemption (two processes' contexts taking turns on one GPU may move
        # the block to another SM, whose counter is far ahead)
        spin = cupy.RawKernel(r"""
            static __device__ unsigned long long now() {
                unsigned long long t;
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
                return t;
            }
            extern "C" __global__ void spin(unsigned long long nanoseconds) {
                const unsigned long long start = now();
                while (now() - start < nanoseconds) { }
            }""", "spin")
        stream = cupy.cuda.Stream(non_blocking=True)
        spin((1,), (1,), (np.uint64(seconds * 1e9),), stream=stream)
        return stream


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=["mismatch", "dead", "absent", "killed", "early",
                                             "closed", "abort"])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--kernel-bytes", type=int, default=0,
                        help="Options.kernel_bytes: the calls run as direct kernels")
    parser.add_argument("--chunk-bytes", type=int, default=0,
                        help="abort: a reduce_scatter in chunks of this many bytes")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    # "killed" keeps the default timeout: a dead peer must be seen long before it
    dies = args.scenario in ("dead", "killed", "early", "closed")
    comm = hoccl.init(backend=args.backend, timeout=300 if dies else 5,
                      kernel_bytes=args.kernel_bytes)
    arrays = array_module_for(comm.backend, "float32")
    r = comm.rank

    def buffer(count, fill=1.0):
        return arrays.asarray(np.full(count, fill, np.float32), comm.device)

    ok = False
    started = time.monotonic()
    try:
        if args.scenario == "mismatch":
            count = 10 + r
            out = arrays.asarray(poison(count, "float32"), comm.device)
            before = arrays.to_numpy(out, "float32").tobytes()
            try:
                comm.all_reduce(buffer(count), out)
                comm.synchronize()
                print(f"rank {r}: FAILED no error", flush=True)
            except hoccl.MismatchError as error:
                text = str(error)
                untouched = arrays.to_numpy(out, "float32").tobytes() == before
                ok = (text.startswith("all_reduce:") and f"rank {1 - r}" in text
                      and "count=10" in text and "count=11" in text and untouched)
                # the communicator is still usable
                total = buffer(4, r + 1)
                comm.all_reduce(total, total)
                comm.synchronize()
                got = arrays.to_numpy(total, "float32")
                ok = ok and np.array_equal(got.view(np.uint32),  # 1 + 2, exactly
                                           np.full(4, 3.0, np.float32).view(np.uint32))
                print(f"rank {r}: {'OK' if ok else 'FAILED'} {text}", flush=True)
        elif args.scenario == "dead":
            out = buffer(1 << 16, 0.0)
            # rank 1's stream is held, so it dies with its part of the call still queued
            stream = _held_stream(comm, seconds=3) if r == 1 else None
            comm.all_reduce(buffer(1 << 16), out, stream=stream)
            if r == 1:
                os._exit(3)
            time.sleep(0.2)
            try:
                comm.synchronize()
                print(f"rank {r}: FAILED synchronize returned", flush=True)
            except hoccl.PeerDeadError as error:
                waited = time.monotonic() - started
                ok = waited < 5 and "rank 1, whose process (pid" in str(error) and comm.aborted
                print(f"rank {r}: {'OK' if ok else 'FAILED'} {type(error).__name__} after "
                      f"{waited:.1f} s: {error}", flush=True)
        elif args.scenario == "absent":
            if r == 0:
                out = buffer(1 << 10, 0.0)
                try:
                    comm.all_gather(buffer(1 << 9), out)
                    print(f"rank {r}: FAILED the call returned", flush=True)
                except hoccl.HocclTimeoutError as error:
                    waited = time.monotonic() - started
                    arrays.synchronize(comm.device)  # the caller's stream was released
                    ok = 4 < waited < 20 and "ranks [1]" in str(error) and comm.aborted
                    print(f"rank {r}: {'OK' if ok else 'FAILED'} {type(error).__name__} after "
                          f"{waited:.1f} s: {error}", flush=True)
            world.Barrier()
            ok = ok or r == 1
        elif args.scenario in ("killed", "early"):
            if args.scenario == "killed":
                total = buffer(4, r + 1)
                comm.all_reduce(total, total)  # the pair works before rank 1 dies
                comm.synchronize()
            world.Barrier()
            if r == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            started = time.monotonic()
            try:
                comm.all_reduce(buffer(1 << 10), buffer(1 << 10, 0.0))
                print(f"rank {r}: FAILED the call returned", flush=True)
            except hoccl.PeerDeadError as error:
                waited = time.monotonic() - started
                text = str(error)
                ok = (waited < 5 and text.startswith("all_reduce:")
                      and "rank 1, whose process (pid" in text and text.endswith("has exited")
                      and comm.timeout == 300 and comm.aborted)
                print(f"rank {r}: {'OK' if ok else 'FAILED'} {type(error).__name__} after "
                      f"{waited:.2f} s: {error}", flush=True)
        elif args.scenario == "closed":
            total = buffer(4, r + 1)
            comm.all_reduce(total, total)  # the pair works (and learns its rings) first
            comm.synchronize()
            if r == 1:
                comm.close()
                world.Barrier()
                world.Barrier()  # alive until rank 0 has looked
                ok = True
            else:
                world.Barrier()  # rank 1 has closed
                started = time.monotonic()
                try:
                    comm.all_reduce(total, total)
                    comm.synchronize()
                    print(f"rank {r}: FAILED the call returned", flush=True)
                except hoccl.PeerClosedError as error:
                    waited = time.monotonic() - started
                    text = str(error)
                    try:
                        comm.barrier()
                        later = "no error"
                    except hoccl.HocclError as again:
                        later = type(again).__name__
                    ok = (waited < 5 and text.split(":")[0] in ("all_reduce", "synchronize")
                          and "rank 1, which closed the communicator" in text
                          and isinstance(error, hoccl.PeerDeadError) and comm.aborted
                          and later == "PeerClosedError")
                    print(f"rank {r}: {'OK' if ok else 'FAILED'} {type(error).__name__} after "
                          f"{waited:.2f} s (the next call: {later}): {text}", flush=True)
                world.Barrier()
        else:  # abort
            out = buffer(1 << 16, 0.0)
            if args.chunk_bytes:  # the sums wait for dozens of chunks (fuse_sums)
                comm.set_options(chunk_bytes=args.chunk_bytes)
                send = buffer(2 << 16)

                def call(stream=None):
                    comm.reduce_scatter(send, out, stream=stream)
            else:
                send = buffer(1 << 16)

                def call(stream=None):
                    comm.all_reduce(send, out, stream=stream)
            # a first call, finished: the held call below then needs no exchange (which
            # waits for the peer's arrival, eating into the hold) and returns at once
            call()
            comm.synchronize()
            world.Barrier()
            stream = _held_stream(comm, seconds=3) if r == 0 else None
            call(stream)
            world.Barrier()
            if r == 0:
                comm.abort("rank 0 gives up")
                ok = comm.aborted
                print(f"rank {r}: OK aborted", flush=True)
                world.Barrier()  # stay alive until rank 1 has looked
            else:
                try:
                    comm.synchronize()
                    pad = comm._engine.pad
                    print(f"rank {r}: FAILED synchronize returned; pad {pad.words()} kernel "
                          f"{comm._engine.device.peek(pad.kernel_counter, 2)} "
                          f"{comm._engine.device.peek(pad.kernel_local(0), 10 * 32)}",
                          flush=True)
                except hoccl.HocclError as error:
                    waited = time.monotonic() - started
                    ok = waited < 20 and "rank 0 aborted" in str(error)
                    drained = ""
                    if args.chunk_bytes:  # the waiting launch ended: every lane drains
                        engine = comm._engine
                        try:
                            for lane in engine.streams.lanes:
                                engine.device.synchronize_stream(lane, 10)
                            drained = f"; its {len(engine.streams.lanes)} lanes drained"
                        except hoccl.HocclError as stuck:
                            ok, drained = False, f"; a lane did not drain: {stuck}"
                    print(f"rank {r}: {'OK' if ok else 'FAILED'} {type(error).__name__} after "
                          f"{waited:.1f} s: {error}{drained}", flush=True)
                world.Barrier()
    except BaseException as error:  # report, then fail
        print(f"rank {r}: FAILED unexpected {type(error).__name__}: {error}", flush=True)
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # skip MPI_Finalize: a peer may be gone


if __name__ == "__main__":
    main()
