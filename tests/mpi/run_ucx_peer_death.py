"""A peer across hosts that dies, with UCX between the hosts: started by
``tests/test_ucx.py`` as plain processes on a torch TCPStore (no MPI launcher, which would
end the job itself when a process dies).  Two simulated hosts of one rank; after one
exact all_reduce the last rank exits abruptly; the first rank's next all_reduce must end
in PeerDeadError within the timeout (never a hang) and name the rank, its next call must
be refused, and its close must return.  Prints ``peer death: rank 0 OK`` or what went
wrong.

    RANK=0 WORLD_SIZE=2 MASTER_PORT=... python tests/mpi/run_ucx_peer_death.py --how exit
"""

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import numpy as np

import hoccl
from hoccl.torch import StoreBootstrap


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=("exit", "kill", "mid"), default="exit",
                        help="mid: the victim is SIGKILLed 0.1 s into a run of all_reduces "
                             "that both ranks make, most likely in the middle of one")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--count", type=int, default=1 << 20)
    args = parser.parse_args()
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timedelta(seconds=60))
    comm = hoccl.init(backend="host", bootstrap=StoreBootstrap(store, rank, world),
                      local_size=1, inter_host="ucx", timeout=args.timeout)
    rng = np.random.default_rng(rank)
    send = rng.integers(-9, 9, args.count).astype(np.float32)
    recv = np.full(args.count, np.nan, np.float32)
    comm.all_reduce(send, recv, "sum")
    comm.synchronize()
    # how the peer is reached: watched (shared memory) or in UCX's peer-failure mode
    watched = len(comm._levels["rail"].transport._watched)
    print(f"rank {rank}: peers watched: {watched}", flush=True)
    want = sum(np.random.default_rng(r).integers(-9, 9, args.count).astype(np.float32)
               for r in range(world))
    problems = [] if np.array_equal(recv, want) else ["the first all_reduce was not exact"]
    victim = world - 1
    if args.how == "mid":
        return died_mid_call(comm, rank, victim, send, recv, want, problems, args.timeout)
    if rank == victim:
        store.set(f"gone{rank}", "1")
        if args.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)
    store.wait([f"gone{victim}"])
    time.sleep(0.5)  # the victim's process has ended by now
    start = time.monotonic()
    try:
        comm.all_reduce(send, recv, "sum")
        comm.synchronize()
        problems.append("the all_reduce with a dead peer returned")
    except hoccl.PeerDeadError as error:
        waited = time.monotonic() - start
        print(f"rank {rank}: PeerDeadError after {waited:.2f} s: {error}", flush=True)
        if waited > args.timeout:
            problems.append(f"detected only after {waited:.1f} s")
        if f"rank {victim}" not in str(error):
            problems.append(f"the error does not name rank {victim}: {error}")
    except hoccl.HocclError as error:
        problems.append(f"{type(error).__name__} instead of PeerDeadError: {error}")
    try:
        comm.all_reduce(send, recv, "sum")
        problems.append("a call after the failure was taken")
    except hoccl.HocclError as error:
        print(f"rank {rank}: next call {type(error).__name__}", flush=True)
    finish(comm, rank, problems)


def died_mid_call(comm, rank, victim, send, recv, want, problems, timeout):
    """Both ranks repeat the all_reduce; the victim is killed 0.1 s in. Every call that
    returns on the survivor is exact; one ends in PeerDeadError naming the victim, within
    the timeout."""
    import threading
    if rank == victim:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    calls = 0
    try:
        while time.monotonic() - start < timeout:
            recv[:] = np.nan
            comm.all_reduce(send, recv, "sum")
            comm.synchronize()
            calls += 1
            if not np.array_equal(recv, want):
                problems.append(f"all_reduce {calls} was not exact")
                break
        else:
            problems.append(f"no error within {timeout:g} s")
    except hoccl.PeerDeadError as error:
        print(f"rank {rank}: PeerDeadError after {calls} exact calls, "
              f"{time.monotonic() - start:.2f} s in: {error}", flush=True)
        if f"rank {victim}" not in str(error):
            problems.append(f"the error does not name rank {victim}: {error}")
    except hoccl.HocclError as error:
        problems.append(f"{type(error).__name__} instead of PeerDeadError: {error}")
    finish(comm, rank, problems)


def finish(comm, rank, problems):
    """Close, say what went wrong (or OK) and exit at once: no interpreter teardown waits
    on the dead peer."""
    comm.close()
    for problem in problems:
        print(f"rank {rank} FAILED: {problem}", flush=True)
    print(f"peer death: rank {rank} {'OK' if not problems else 'FAILED'}", flush=True)
    sys.stdout.flush()
    os._exit(1 if problems else 0)


if __name__ == "__main__":
    main()
