"""Under mpiexec (host backend): calls run on their callers' streams (direct kernels, and
copy-engine plans of one lane) keep the completion values in call order.

Each rank interleaves direct-kernel calls (at most ``kernel_bytes``) on two streams of its
own with copy-engine calls (larger): all_gathers, on the callers' streams where their
plans take one lane (two ranks), and all_reduces in several chunks, pipelined on the
lanes (a one-chunk all_reduce of two ranks takes one lane: the caller's stream).  It holds the first
stream back for a while before some of its calls: a call on the other stream, or the
lanes' next completion write, must then wait for the held call's value rather than
overtake it.  A thread samples the host completion word throughout; it must never go
down.  The host device checks every signal and completion word as a write lands
(``HOCCL_HOST_CHECK_SIGNALS``, set here): a write that would lower it (an earlier call's
signal landing after a later call's, leaving a peer waiting past it for ever) fails the
call with "signal order".  Every output is checked against numpy; at least 8 calls must have gone on
their callers' streams and 4 on the lanes.  Prints ``on caller: N passed, 0 failed``.
"""

import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import assert_exact, random_array, run_or_abort

KERNEL_BYTES = 64 << 10
CHUNK_BYTES = 32 << 10  # a large all_reduce's 80 KB block: 3 chunks


def main() -> None:
    os.environ["HOCCL_HOST_CHECK_SIGNALS"] = "1"  # read by the host device as it opens
    comm = hoccl.init(backend="host", timeout=60, kernel_bytes=KERNEL_BYTES,
                      chunk_bytes=CHUNK_BYTES)
    engine, device = comm._engine, comm._engine.device
    n, r = comm.world_size, comm.rank
    streams = [device.create_stream(), device.create_stream()]
    on_caller, lanes = [0], [0]
    original_on_caller, original_issue = engine.executor.issue_on_caller, engine.executor.issue

    def count_on_caller(*args, **kwargs):
        on_caller[0] += 1
        return original_on_caller(*args, **kwargs)

    def count_issue(*args, **kwargs):
        lanes[0] += 1
        return original_issue(*args, **kwargs)
    engine.executor.issue_on_caller = count_on_caller
    engine.executor.issue = count_issue

    seen, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            seen.append(engine.completed)
            time.sleep(0.0005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    checks = []
    for round_ in range(16):
        # small (direct kernel) or large (copy engines); the all_gather on one stream and
        # the all_reduce on the other, the first stream held back in every other round so
        # that the later call, on the lanes, could overtake the held one
        count = 100 if round_ % 3 == 0 else 40000
        stream = streams[round_ % 2]
        if round_ % 2 == 0:
            streams[0].enqueue(lambda: time.sleep(0.05))
        data = [random_array(np.random.default_rng(1000 * round_ + peer), count, "float32")
                for peer in range(n)]
        full = np.full(count * n, np.nan, np.float32)
        full[r * count:(r + 1) * count] = data[r]
        comm.all_gather(full[r * count:(r + 1) * count], full, stream=stream)
        total = np.array(data[r])
        comm.all_reduce(total, total, "sum", stream=streams[(round_ + 1) % 2])
        checks.append((round_, data, full, total))
    comm.synchronize()
    stop.set()
    sampler.join()
    failed = 0
    for round_, data, full, total in checks:
        try:
            assert_exact(f"round {round_} all_gather", np.concatenate(data), full)
            expected = data[0].copy()
            for peer in range(1, n):
                expected = expected + data[peer]
            np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-5)
        except AssertionError as error:
            failed += 1
            print(f"rank {r}: {error}", flush=True)
    drops = [(a, b) for a, b in zip(seen, seen[1:]) if b < a]
    if drops:
        failed += 1
        print(f"rank {r}: the completion word went down: {drops[:5]}", flush=True)
    if engine.completed != engine.calls:
        failed += 1
        print(f"rank {r}: completion {engine.completed} after {engine.calls} calls", flush=True)
    if on_caller[0] < 8 or lanes[0] < 4:
        failed += 1
        print(f"rank {r}: {on_caller[0]} calls on their callers' streams and {lanes[0]} on "
              f"the lanes; expected 8 or more and 4 or more", flush=True)
    comm.close()
    failed = MPI.COMM_WORLD.allreduce(failed)
    if r == 0:
        print(f"on caller: {len(checks) * n} passed, {failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    run_or_abort(main)
