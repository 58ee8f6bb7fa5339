"""Under mpiexec -n 2 (host backend, two simulated hosts of one rank, MPI between them):
a rank whose peer on the other host never makes the call gets an error, not a hang.

Rank 1 makes no call.  Rank 0's all_reduce crosses the hosts through MPI: it must raise
``HocclTimeoutError`` within the communicator's timeout (and a grace), and its next call
``AbortedError`` at once (the MPI step left unfinished cannot be taken back).  Its output
must still hold what the call found there before the step across hosts.  Prints
``absent across hosts: rank 0 OK ...`` and exits 0 when all of that holds.

Both ranks leave with ``os._exit``: MPI cannot finalize over a request that never
completes.
"""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import hoccl

TIMEOUT = 3.0


def main() -> None:
    world = MPI.COMM_WORLD
    comm = hoccl.init(backend="host", timeout=TIMEOUT, local_size=1, inter_host="mpi")
    if world.rank == 1:  # absent: outlive rank 0's wait, then go
        time.sleep(TIMEOUT * 4)
        os._exit(0)
    problems = []
    data = np.arange(17, dtype=np.float32)
    start = time.monotonic()
    try:
        comm.all_reduce(data, data, "sum")
        problems.append("all_reduce returned though rank 1 never called it")
    except hoccl.HocclTimeoutError as error:
        waited = time.monotonic() - start
        if waited > TIMEOUT * 2:
            problems.append(f"the timeout came after {waited:.1f} s (timeout {TIMEOUT} s)")
        if "across hosts" not in str(error):
            problems.append(f"the error does not say where it waited: {error}")
        print(f"rank 0: HocclTimeoutError after {waited:.1f} s: {error}", flush=True)
    if not np.array_equal(data, np.arange(17, dtype=np.float32)):
        problems.append(f"the output changed: {data}")
    start = time.monotonic()
    try:
        comm.all_reduce(data, data, "sum")
        problems.append("a call after the timeout was taken")
    except hoccl.AbortedError as error:
        if time.monotonic() - start > 1:
            problems.append("the call after the timeout was refused only after a wait")
        print(f"rank 0: next call AbortedError: {error}", flush=True)
    for problem in problems:
        print(f"rank 0 FAILED: {problem}", flush=True)
    print(f"absent across hosts: rank 0 {'OK' if not problems else 'FAILED'}", flush=True)
    sys.stdout.flush()
    os._exit(1 if problems else 0)


if __name__ == "__main__":
    main()
