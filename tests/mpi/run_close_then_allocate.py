"""A rank that lets go of its communicator and lives on, while its peers make a call it
never makes: ``python run_close_then_allocate.py HOW [--kernel-bytes N]`` (2 or more
ranks, host backend).

After two calls every rank finished, the last rank lets go of the communicator (HOW:
``close``, or ``raise``: an exception leaves its ``with`` block) and then allocates and
frees Python objects (lists, dicts, bytes, numpy arrays of many sizes) for a while,
checking their contents.  Every other rank makes an all_reduce the last rank never
makes: it raises PeerClosedError (or AbortedError naming the close, where another rank
aborted first) and aborts (its abort writes the abort value into the
peers' pads for a while), then waits a little and closes.  Nothing any rank does may
land in memory the last rank released: a write into its freed heap shows as a crash
("malloc(): unsorted double linked list corrupted") or as a changed object.

The last rank lets the interpreter exit (freeing its memory) while the others keep their
aborted communicators open for ``--seconds`` more.  Each rank prints ``rank R: OK ...`` or
``rank R: FAILED ...``, then ``released pad writes N``: with ``HOCCL_HOST_CHECK_SIGNALS=1``
the host backend's count of words written into this process's signal pads after their
owner released them (``hoccl.backends.host.released_pad_writes``).
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.backends import host


def churn(seconds: float, seed: int) -> str:
    """Allocate, fill, check and drop objects of many sizes for ``seconds``; '' or what
    differed from what was written."""
    rng = np.random.default_rng(seed)
    kept = []
    until = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < until:
        rounds += 1
        size = int(rng.integers(1, 1 << 16))
        array = np.full(size, rounds % 251, dtype=np.uint8)
        kept.append((rounds % 251, array, [rounds] * (size % 97), {rounds: bytes(size % 301)},
                     bytes([rounds % 256]) * (size % 4099)))
        if len(kept) > 200:
            kept.pop(int(rng.integers(0, len(kept))))
        for value, array, items, mapping, data in kept[-4:]:
            if (array != value).any() or len(set(items)) > 1 or len(set(data)) > 1:
                return f"an object changed after it was written (round {rounds})"
    return ""


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("how", choices=["close", "raise"])
    parser.add_argument("--kernel-bytes", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    options = {"kernel_bytes": args.kernel_bytes} if args.kernel_bytes else {}
    comm = hoccl.init(backend="host", timeout=30, **options)
    rank, last = comm.rank, comm.world_size - 1
    rng = np.random.default_rng(rank)
    data = rng.integers(-100, 100, 4096).astype(np.int32)
    want = sum(np.random.default_rng(peer).integers(-100, 100, 4096).astype(np.int32)
               for peer in range(comm.world_size))
    for _ in range(2):
        out = np.full(4096, -7, np.int32)
        comm.all_reduce(data, out)
        comm.synchronize()
        if not np.array_equal(out, want):
            print(f"rank {rank}: FAILED the first calls were wrong", flush=True)
    world.Barrier()
    if rank == last:
        if args.how == "close":
            comm.close()
        else:
            try:
                with comm:
                    raise RuntimeError("the rank's own work failed")
            except RuntimeError:
                pass
        problem = churn(args.seconds, rank)
        report(rank, f"FAILED {problem}" if problem else "OK lived on after letting go")
        for peer in range(last):
            world.send("done", dest=peer)
        # the interpreter's exit frees this process's memory while the peers' communicators
        # (and their aborts' pumps) are still open
        return
    try:
        comm.all_reduce(data, np.empty_like(data))
        comm.synchronize()
        verdict = "FAILED the call the last rank never made returned"
    except (hoccl.PeerClosedError, hoccl.AbortedError) as error:
        # AbortedError: another rank saw the close first, and its abort says so
        verdict = (f"OK caught {type(error).__name__}: {error}"
                   if f"rank {last}, which closed the communicator" in str(error)
                   else f"FAILED the error does not name the close: {error!r}")
    world.recv(source=last)
    churn(args.seconds, rank)  # the abort's pump runs on while the last rank exits
    comm.close()
    report(rank, verdict)


def report(rank: int, verdict: str) -> None:
    print(f"rank {rank}: {verdict}; released pad writes {host.released_pad_writes()}",
          flush=True)


if __name__ == "__main__":
    main()
