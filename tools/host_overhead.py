"""Host time per call of small collectives on the host backend, under mpiexec.

Run: ``mpiexec -n 2 python tools/host_overhead.py [--size 4K] [--iters 1000] [--profile]
[--no-stream-work] [--registered] [--count-calls] [--cpu-time]``

Each rank makes ``--iters`` calls of one collective (in place, float32, ``--size`` bytes
in the large buffer) with no synchronisation between them, then synchronises; the time
per call is that span over ``--iters``.  At a few KiB the copies cost little, so the
figure is the shared call path: argument checks, buffer resolution, planning, the
per-call agreement with the peers through the mailboxes, the bounds checks and the
executor issuing the steps (on the host backend, onto worker threads that run in the
same process and share its interpreter).  Rank 0 prints the slowest rank's figure of
each of ``--repeats`` rounds, their median and their minimum (the round least disturbed
by other work on the machine); ``--profile`` adds a cProfile of rank 0's
calls of one more round, sorted by own time.

On the host backend the worker threads that run the streams share the interpreter (and,
on a small machine, the cores) with the calling thread, so the figure also holds their
work and varies from run to run.  ``--no-stream-work`` gives every rank a host device
whose stream operations do nothing but write the completion words at once (no worker
threads, no copies, no waits): the figure is then the shared call path alone, mailbox
exchange included, which is what a GPU call adds to its driver calls.

``--cpu-time`` takes each rank's process CPU time instead of the wall clock: on a
machine loaded by other work the wall clock holds the time a rank waited to be run.
``--count-calls`` adds, for rank 0, the Python function calls inside hoccl per call of
one more round, the polls for the peer's messages left out (their number is the
waiting, not the path): a figure that moves much less than the times with the machine's
load.
"""

import argparse
import cProfile
import ctypes
import io
import pstats
import statistics
import time

import numpy as np
from mpi4py import MPI

import hoccl
import hoccl._build
from hoccl.backends._cross_memory import RemotePtr
from hoccl.backends.host import HostDevice
from hoccl.bench._harness import parse_size

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


class CallPathDevice(HostDevice):
    """The host device with the work of its streams left out: a stream is a name, events
    are reached when recorded, copies, reductions and waits do nothing, and writes into
    this process's memory (the completion and host words, own pad slots) happen at once,
    so calls complete as soon as they are issued."""

    def create_stream(self):
        return "stream"

    def destroy_stream(self, stream):
        pass

    def record(self, stream, event):
        event.latest = [True]

    def wait_event(self, stream, event):
        pass

    def synchronize_stream(self, stream, timeout):
        pass

    def copy(self, stream, dst, src, nbytes):
        pass

    def local_copy(self, stream, dst, src, nbytes, sms=None):
        pass

    def write_value(self, stream, address, value):
        if not isinstance(address, RemotePtr):
            ctypes.c_uint64.from_address(address).value = value

    def wait_value(self, stream, address, value):
        pass

    def reduce(self, stream, output, inputs, count, dtype, op, **extras):
        pass

    def direct(self, stream, program, value=0):
        if value:  # the kernel's end: the call's completion words
            ctypes.c_uint64.from_address(int(program.completion)).value = value
            ctypes.c_uint64.from_address(int(program.host_word)).value = value


def in_place_call(comm, collective, nbytes, registered=False):
    """A function making one in-place call of ``collective`` (float32, ``nbytes`` in the
    large buffer), on buffers made once (``registered``: with ``hoccl.empty``)."""
    n, rank = comm.world_size, comm.rank
    block = max(1, nbytes // 4 // n)

    def ones(count):
        if not registered:
            return np.ones(count, dtype=np.float32)
        array = hoccl.empty(count, "float32", comm)
        array[:] = 1
        return array
    if collective == "all_reduce":
        buffer = ones(block * n)
        return lambda: comm.all_reduce(buffer, buffer, "sum")
    full = ones(block * n)
    own = full[rank * block:(rank + 1) * block]
    if collective == "all_gather":
        return lambda: comm.all_gather(own, full)
    return lambda: comm.reduce_scatter(full, own, "sum")


def _polling(path, name):
    """Whether a function is the waiting for a peer's message: the mailbox's polls, and
    the process group's checks of whether a peer's next message has come (``_ready`` and
    what ``wait_until`` calls) in its module, ``_groups/process.py`` (``bootstrap.py``
    before 2026-12-02)."""
    return path.endswith("_mailbox.py") or (
        path.endswith(("process.py", "bootstrap.py"))
        and name in ("_ready", "_check_peer", "<lambda>", "<genexpr>"))


def timed(comm, call, iters, clock=time.perf_counter):
    """Seconds per call of ``iters`` calls, with one synchronize at the end, by ``clock``."""
    MPI.COMM_WORLD.Barrier()
    start = clock()
    for _ in range(iters):
        call()
    comm.synchronize()
    return (clock() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4K", help="bytes in the large buffer (4K, 1M, ...)")
    parser.add_argument("--iters", type=int, default=1000, help="calls per round")
    parser.add_argument("--repeats", type=int, default=10, help="rounds per collective")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--cpu-time", action="store_true",
                        help="time each rank's process CPU time, not the wall clock")
    parser.add_argument("--count-calls", action="store_true",
                        help="print rank 0's Python calls inside hoccl per call of one more round")
    parser.add_argument("--profile", action="store_true",
                        help="print a cProfile of rank 0's calls of one more round")
    parser.add_argument("--no-stream-work", action="store_true",
                        help="a host device whose streams do no work: the call path alone")
    parser.add_argument("--registered", action="store_true",
                        help="buffers registered with hoccl.empty: no descriptor exchange")
    parser.add_argument("--kernel-bytes", default="0",
                        help="Options.kernel_bytes: calls up to it run as direct kernels")
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    if args.no_stream_work:
        # hoccl.init opens its device through this name (hoccl._build)
        hoccl._build.open_device = lambda backend, ordinal, **settings: CallPathDevice(**settings)
    comm = hoccl.init(backend="host", kernel_bytes=parse_size(args.kernel_bytes))
    world = MPI.COMM_WORLD
    if comm.rank == 0:
        work = "no stream work" if args.no_stream_work else "streams on worker threads"
        if args.registered:
            work += ", registered buffers"
        if comm.options.kernel_bytes:
            work += f", kernel_bytes={args.kernel_bytes}"
        print(f"host backend ({work}), {comm.world_size} ranks, {args.size} in place, float32, "
              f"{args.iters} calls per round, {args.repeats} rounds", flush=True)
        print(f"{'collective':16s} {'median':>8s} {'min':>8s}   rounds (µs/call, slowest rank)")
    for collective in args.collectives.split(","):
        call = in_place_call(comm, collective, nbytes, args.registered)
        for _ in range(100):  # warm up: plans, lanes, events, imports
            call()
        comm.synchronize()
        rounds = []
        for _ in range(args.repeats):
            rounds.append(max(world.allgather(timed(
                comm, call, args.iters,
                time.process_time if args.cpu_time else time.perf_counter))) * 1e6)
        if comm.rank == 0:
            print(f"{collective:16s} {statistics.median(rounds):8.1f} {min(rounds):8.1f}   "
                  + " ".join(f"{value:.1f}" for value in rounds), flush=True)
        if args.profile or args.count_calls:
            profile = cProfile.Profile()
            world.Barrier()
            profile.enable()
            for _ in range(args.iters):
                call()
            comm.synchronize()
            profile.disable()
            if comm.rank == 0 and args.count_calls:
                calls = sum(count for (path, _, name), (_, count, _, _, _)
                            in pstats.Stats(profile).stats.items()  # type: ignore[attr-defined]
                            if "/hoccl/" in path and not _polling(path, name))
                print(f"{collective:16s} {calls / args.iters:8.1f} Python calls inside hoccl "
                      f"per call (polls for the peer left out)", flush=True)
            if comm.rank == 0 and args.profile:
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
                # the mailbox polls (ready, take) count the waits for the peer, not the path
                print(f"rank 0, {collective}, {args.iters} calls:")
                print(text.getvalue(), flush=True)
    comm.close()


if __name__ == "__main__":
    main()
