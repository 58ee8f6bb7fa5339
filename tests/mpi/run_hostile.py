"""Ranks that disagree, under mpiexec (any rank count): ``python run_hostile.py [--backend B]``.

Every scenario of ``tests/hostile.py``: each rank makes its call (deviant ranks change
count, dtype, root, op or the collective); every rank must raise MismatchError naming
the call, leave every byte in and around its buffers as it was, and complete a checked
all_reduce afterwards.  Also a pair whose sizes disagree and a grouped ring of
send/recv.  Prints ``rank R: N passed, M failed``.
"""

import argparse
import os
import sys
import zlib

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hoccl  # noqa: E402
from hoccl.testing import poison  # noqa: E402
from hostile import Guarded, make_call, scenarios  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="host")
    args = parser.parse_args()
    comm = hoccl.init(backend=args.backend, timeout=60)
    rank, n = comm.rank, comm.world_size
    passed, failures = 0, []

    device = comm.device  # None on the host backend: numpy arrays; else cupy on this GPU

    def array(values):
        if device is None:
            return np.array(values)
        import cupy
        with cupy.cuda.Device(device):
            return cupy.asarray(values)

    def host(values):
        if device is None:
            return values
        import cupy
        cupy.cuda.Device(device).synchronize()
        return cupy.asnumpy(values)

    def usable(seed):
        data = array(np.full(7, float(rank + 1 + seed), np.float32))
        out = array(poison(7, "float32"))
        comm.all_reduce(data, out)
        comm.synchronize()
        want = np.full(7, sum(r + 1 + seed for r in range(n)), np.float32)  # exact: integers
        return np.array_equal(host(out).view(np.uint32), want.view(np.uint32))

    for name, collective, change, deviants in scenarios(n):
        rng = np.random.default_rng(zlib.crc32(f"{name}/{rank}".encode()))
        call, buffers = make_call(rng, rank, n, collective, change, deviants, device)
        error = None
        try:
            call(comm)
            comm.synchronize()
        except hoccl.MismatchError as raised:
            error = str(raised)
        ok = (error is not None and "called (" in error
              and all(buffer.untouched() for buffer in buffers) and usable(len(name)))
        if ok:
            passed += 1
        else:
            failures.append(f"{name}: error={error!r}")
    if n >= 2 and rank < 2:  # a pair whose sizes disagree
        rng = np.random.default_rng(rank)
        buffer = Guarded(rng, 4 if rank == 1 else 1000, np.float32, fill=np.nan, device=device)
        try:
            comm.send(buffer.view, 1) if rank == 0 else comm.recv(buffer.view, 0)
            failures.append("pair: no error")
        except hoccl.MismatchError as raised:
            if buffer.untouched() and "count=4" in str(raised) and "count=1000" in str(raised):
                passed += 1
            else:
                failures.append(f"pair: {raised}")
    # a ring of send/recv inside a group completes
    data = array(np.arange(5, dtype=np.int64) + 100 * rank)
    out = array(np.full(5, -1, np.int64))
    if n >= 2:
        with hoccl.group():
            comm.send(data, (rank + 1) % n)
            comm.recv(out, (rank - 1) % n)
        comm.synchronize()
        if np.array_equal(host(out), np.arange(5, dtype=np.int64) + 100 * ((rank - 1) % n)):
            passed += 1
        else:
            failures.append(f"grouped ring: got {out}")
    # a group with two sends and two receives of one pair and two collectives completes
    if n >= 2:
        peer = rank ^ 1 if (rank ^ 1) < n else rank
        if peer != rank:
            first = array(np.full(4, rank + 1.0, np.float32))
            second = array(np.full(4, rank + 11.0, np.float32))
            got = [array(np.zeros(4, np.float32)) for _ in range(2)]
            with hoccl.group():
                comm.send(first, peer)
                comm.send(second, peer)
                comm.recv(got[0], peer)
                comm.recv(got[1], peer)
            comm.synchronize()
            if (np.array_equal(host(got[0]), np.full(4, peer + 1.0, np.float32))
                    and np.array_equal(host(got[1]), np.full(4, peer + 11.0, np.float32))):
                passed += 1
            else:
                failures.append(f"grouped pair twice: got {host(got[0])} {host(got[1])}")
        else:
            passed += 1
    if usable(999):
        passed += 1
    else:
        failures.append("final all_reduce wrong")
    for failure in failures:
        print(f"rank {rank}: FAILED {failure}", flush=True)
    print(f"rank {rank}: hostile {n} ranks: {passed} passed, {len(failures)} failed", flush=True)
    comm.close()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
