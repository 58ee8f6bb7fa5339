"""Going on without a lost rank: ``Communicator.shrink`` under mpirun:
``python run_shrink.py SCENARIO --victims R[+R...][,R2] --stamps DIR [--no-wait]
[--backend B]`` (``--backend``: host, the default, or cuda: the ranks' arrays on their
GPU, which they may share); under ``HOCCL_LOCAL_SIZE`` the communicator spans simulated
hosts.

After an exact all_reduce every rank made, the first victim (a rank of ``hoccl.init()``'s
communicator; ``R+R...``: several at once, a whole host) goes, as SCENARIO says:

dead      it exits (os._exit) between two calls;
killed    it is killed (SIGKILL) while a 64 MiB all_reduce of every rank is in flight
          (launch it under a shell that outlives it: MPICH's mpiexec ends the job when a
          rank dies of a signal);
closed    it closes its communicator and lives on;
excluded  it stays alive and makes a call the others never make: they leave it out
          without waiting (``wait=False``), their abort ends its call with AbortedError.

The others' next call raises (PeerDeadError, PeerClosedError; none for ``excluded``),
they shrink the communicator excluding the victim, and check 20 all_reduces and a
broadcast on the new one against numpy (fresh random data, outputs poisoned first).
With a second victim, that rank (numbered as in ``hoccl.init()``) then exits in turn and
the survivors shrink the shrunk communicator again, and check it again.

A victim writes the time it goes (``time.time()``) into ``DIR/victim-R``; each survivor
prints ``rank R: OK detect D s shrink S s first T s (...; rank r of n on h hosts)`` per failure,
from the victim's time (the earliest) to the error, to the new communicator, and to its
first exact all_reduce; or
``rank R: FAILED ...``.  A job that lost a process ends with MPI_Abort at exit (hoccl's
``end_of_job``): its exit status is not 0.
"""

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np

if "ucx" in sys.argv:  # ucxx's UCX libraries before MPI's own copy (hoccl._hierarchy.ucx)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx  # noqa: F401
from mpi4py import MPI  # noqa: E402

import hoccl
from hoccl.testing import array_module_for

BIG = 8 << 20  # int64 elements: 64 MiB


def exact_all_reduce(comm, seed, count=4099):
    """An all_reduce of fresh random int64 data, checked against numpy; True if exact."""
    rng = np.random.default_rng([seed, comm.rank])
    data = rng.integers(-1 << 40, 1 << 40, count)
    want = sum(np.random.default_rng([seed, peer]).integers(-1 << 40, 1 << 40, count)
               for peer in range(comm.world_size))
    out = on_device(comm, np.full(count, np.iinfo(np.int64).min))
    comm.all_reduce(on_device(comm, data), out)
    comm.synchronize()
    return bool(np.array_equal(from_device(comm, out), want))


def exact_broadcast(comm, seed, root):
    data = np.random.default_rng(seed).integers(0, 1 << 62, 777)
    out = on_device(comm, np.full(777, -1))
    comm.broadcast(on_device(comm, data) if comm.rank == root else None, out, root)
    comm.synchronize()
    return bool(np.array_equal(from_device(comm, out), data))


def on_device(comm, data):
    """``data`` (int64) where ``comm``'s backend takes it: numpy, or cupy on its GPU."""
    return array_module_for(comm.backend, "int64").asarray(data, comm.device)


def from_device(comm, array):
    return array_module_for(comm.backend, "int64").to_numpy(array, "int64")


def go(comm, how, stamps, rank):
    """This rank is the victim: go as ``how`` says."""
    stamp = Path(stamps) / f"victim-{rank}"
    if how == "killed":
        big = on_device(comm, np.ones(BIG, np.int64))
        comm.all_reduce(big, big)  # issued (every rank made it); its copies run on
        time.sleep(0.05)
        stamp.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "closed":
        stamp.write_text(repr(time.time()))
        comm.close()
        time.sleep(3)
        return "OK closed and lived on"
    if how == "excluded":
        stamp.write_text(repr(time.time()))
        try:
            comm.all_reduce(on_device(comm, np.ones(16, np.int64)),
                            on_device(comm, np.zeros(16, np.int64)))  # the others never make it
            comm.synchronize()
            return "FAILED the call nobody else made returned"
        except hoccl.AbortedError as error:
            comm.close()
            return f"OK left out: {type(error).__name__}: {error}"
    stamp.write_text(repr(time.time()))
    sys.stdout.flush()
    os._exit(3)


def survive(comm, how, stamps, victims, wait, seed, named):
    """One failure seen from a survivor: the error, the shrink excluding ``victims`` (ranks
    ``named`` of ``hoccl.init()``), the checks; the new communicator and a report."""
    error = None
    if how == "killed":
        big = on_device(comm, np.ones(BIG, np.int64))
        try:
            comm.all_reduce(big, big)
            comm.synchronize()
        except hoccl.HocclError as caught:
            error = caught
    elif how != "excluded":
        try:
            for index in range(50):  # the victim goes between two of these
                exact_all_reduce(comm, seed + index)
        except hoccl.HocclError as caught:
            error = caught
    detected = time.time()
    if how != "excluded" and not isinstance(error, (hoccl.PeerDeadError, hoccl.PeerClosedError,
                                                    hoccl.AbortedError)):
        return None, f"FAILED expected the victim's loss to raise; got {error!r}"
    child = comm.shrink(victims, wait=wait)
    shrunk = time.time()
    first = None
    wrong = 0
    for index in range(20):
        good = exact_all_reduce(child, seed + 100 + index)
        wrong += not good
        if good and first is None:
            first = time.time()
    wrong += not exact_broadcast(child, seed + 200, root=child.world_size - 1)
    comm.close()
    went = min(_stamp(stamps, rank) for rank in named)
    if wrong or first is None:
        return child, f"FAILED {wrong} of 21 checks wrong on the shrunk communicator"
    return child, (f"OK detect {detected - went:.3f} s shrink {shrunk - went:.3f} s first "
                   f"{first - went:.3f} s ({type(error).__name__ if error else 'none'}; "
                   f"rank {child.rank} of {child.world_size} on {_hosts(child)} hosts)")


def _stamp(stamps, rank):
    """The time victim ``rank`` went (written before it goes)."""
    path = Path(stamps) / f"victim-{rank}"
    for _ in range(100):
        if path.exists() and path.read_text():
            break
        time.sleep(0.05)
    return float(path.read_text())


def _hosts(comm):
    topology = getattr(comm, "topology", None)
    return 1 if topology is None else topology.hosts


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=["dead", "killed", "closed", "excluded"])
    parser.add_argument("--victims", required=True)
    parser.add_argument("--stamps", required=True)
    parser.add_argument("--no-wait", action="store_true")
    parser.add_argument("--backend", default="host")
    parser.add_argument("--inter-host", default=None, choices=["ucx", "hoccl"])
    args = parser.parse_args()
    first, *later = args.victims.split(",")
    together = [int(rank) for rank in first.split("+")]
    victims = [together[0]] + [int(rank) for rank in later]
    # MPICH's mpiexec (-disable-auto-cleanup) tells the other ranks of a rank's failure
    # with SIGUSR1, whose default action would end them too
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    comm = hoccl.init(backend=args.backend, inter_host=args.inter_host)
    rank = comm.rank
    if not exact_all_reduce(comm, 1):
        print(f"rank {rank}: FAILED the first all_reduce", flush=True)
    MPI.COMM_WORLD.Barrier()
    wait = not args.no_wait and args.scenario != "excluded"
    try:
        if rank in together:
            print(f"rank {rank}: {go(comm, args.scenario, args.stamps, rank)}", flush=True)
            return
        child, report = survive(comm, args.scenario, args.stamps, together, wait, 1000,
                                together)
        print(f"rank {rank}: {report}", flush=True)
        if len(victims) > 1 and child is not None:
            second = [r for r in range(comm.world_size) if r not in together].index(victims[1])
            if rank == victims[1]:
                go(child, "dead", args.stamps, rank)
            grandchild, report = survive(child, "dead", args.stamps, [second], wait, 5000,
                                        [victims[1]])
            print(f"rank {rank}: second {report}", flush=True)
            child = grandchild
        if child is not None:
            child.barrier()  # every survivor has printed before any exits
            child.synchronize()
            child.close()
    except Exception:
        print(f"rank {rank}: FAILED {traceback.format_exc()}", flush=True)


if __name__ == "__main__":
    main()
