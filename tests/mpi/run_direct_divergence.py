"""Under mpirun (2 ranks): direct-kernel calls that go without a message, and ranks whose
calls then differ.  ``python run_direct_divergence.py SCENARIO [--backend B]``.

silent     after the first direct call (which learns the peers' rings), 50 more direct
           calls of every kind send no message to the peer (counted at the mailboxes),
           every output exact
count      then rank 0 calls all_reduce of 1000 elements, rank 1 of 1001: each rank's
           kernel finds the other's signature beside its own; both ranks raise
           DivergedError naming the call, their outputs not written (still poisoned)
blocks     the same with counts whose kernels differ in blocks (1000 and 200000): no
           rank waits for a block its peer does not have
collective rank 0 calls all_gather, rank 1 all_reduce, of the same bytes
Each rank prints ``rank R: OK <what happened>`` or ``rank R: FAILED ...``.
"""

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import array_module_for, poison

KERNEL_BYTES = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=["silent", "count", "blocks", "collective"])
    parser.add_argument("--backend", default=None)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = hoccl.init(backend=args.backend, timeout=30, kernel_bytes=KERNEL_BYTES)
    arrays = array_module_for(comm.backend, "float32")
    n, r = comm.world_size, comm.rank
    sent = [0]
    original_send = comm._group.mailboxes.send

    def counting_send(*send_args, **kwargs):
        sent[0] += 1
        return original_send(*send_args, **kwargs)
    comm._group.mailboxes.send = counting_send

    def numbers(count, seed):
        return np.random.default_rng(seed).standard_normal(count).astype(np.float32)

    ok = False
    try:
        # the first call learns the peer's ring; later direct calls go without a message
        total = arrays.asarray(numbers(256, r), comm.device)
        comm.all_reduce(total, total)
        comm.synchronize()
        before = sent[0]
        wrong = 0
        for index in range(50):
            count = 10 + 37 * index
            mine = numbers(count, 1000 * index + r)
            if index % 3 == 0:
                out = arrays.asarray(poison(count * n, "float32"), comm.device)
                comm.all_gather(arrays.asarray(mine, comm.device), out)
                expected = np.concatenate([numbers(count, 1000 * index + peer)
                                           for peer in range(n)])
            elif index % 3 == 1:
                out = arrays.asarray(poison(count, "float32"), comm.device)
                comm.all_reduce(arrays.asarray(mine, comm.device), out, "max")
                expected = np.maximum.reduce([numbers(count, 1000 * index + peer)
                                              for peer in range(n)])
            else:
                out = arrays.asarray(poison(count, "float32"), comm.device)
                comm.broadcast(arrays.asarray(mine, comm.device), out, root=index % n)
                expected = numbers(count, 1000 * index + index % n)
            comm.synchronize()
            got = arrays.to_numpy(out, "float32")
            wrong += int(not np.array_equal(got.view(np.uint32), expected.view(np.uint32)))
        silent = sent[0] - before
        if args.scenario == "silent":
            ok = wrong == 0 and silent == 0 and comm._engine.issued_fast >= 50
            print(f"rank {r}: {'OK' if ok else 'FAILED'} 50 direct calls, {wrong} wrong, "
                  f"{silent} messages sent, {comm._engine.issued_fast} issued without asking",
                  flush=True)
        else:
            world.Barrier()
            if args.scenario == "count":
                count = 1000 + r
                send = arrays.asarray(numbers(count, r), comm.device)
                out = arrays.asarray(poison(count, "float32"), comm.device)
                comm.all_reduce(send, out)
            elif args.scenario == "blocks":
                count = (1000, 200000)[r]
                send = arrays.asarray(numbers(count, r), comm.device)
                out = arrays.asarray(poison(count, "float32"), comm.device)
                comm.all_reduce(send, out)
            else:  # rank 0 all_gather, rank 1 all_reduce: 2000 floats of output each
                count = 2000
                out = arrays.asarray(poison(count, "float32"), comm.device)
                if r == 0:
                    comm.all_gather(arrays.asarray(numbers(count // n, r), comm.device), out)
                else:
                    comm.all_reduce(arrays.asarray(numbers(count, r), comm.device), out)
            started = time.monotonic()
            try:
                comm.synchronize()
                print(f"rank {r}: FAILED synchronize returned", flush=True)
            except hoccl.DivergedError as error:
                waited = time.monotonic() - started
                text = str(error)
                untouched = np.array_equal(arrays.to_numpy(out, "float32").view(np.uint32),
                                           poison(count, "float32").view(np.uint32))
                ok = (text.startswith("synchronize:") and "direct kernel" in text
                      and untouched and comm.aborted and waited < 20)
                print(f"rank {r}: {'OK' if ok else 'FAILED'} DivergedError after "
                      f"{waited:.2f} s, output untouched: {untouched}: {text}", flush=True)
            # the communicator is aborted: the next call says so
            try:
                comm.barrier()
                ok = False
                print(f"rank {r}: FAILED a call after the divergence went on", flush=True)
            except hoccl.AbortedError:
                pass
    except Exception as error:  # report, then fail
        print(f"rank {r}: FAILED unexpected {type(error).__name__}: {error}", flush=True)
    sys.stdout.flush()
    world.Barrier()
    os._exit(0 if ok else 1)  # skip MPI_Finalize: the communicator is aborted


if __name__ == "__main__":
    main()
