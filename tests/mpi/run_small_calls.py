"""Under mpirun (any number of ranks): long sequences of small calls that every rank
makes alike, checked call by call; a correct program, so no rank may raise.
``python run_small_calls.py SEQUENCE [--backend B] [--calls N] [--kernel-bytes K]
[--start I]``.

mixed  all_reduce, all_gather, reduce_scatter, broadcast (root cycling) and all_to_all of
       3 float32 elements per rank, cycled, a ``synchronize()`` after each call
zero   all_gather, reduce_scatter and broadcast of zero elements, cycled; the outputs are
       one-element arrays sliced to nothing, so a write past the end shows in the element
       beside them

Each rank prints ``rank R: OK <calls> calls`` or ``rank R: FAILED ...`` and exits 1 on a
failure.  A broadcast in the cycle lets its receivers finish without hearing from each
other, so a rank may finish its next call while a peer is still in the one before: the
program shows that no later call then writes into what that peer still reads.
"""

import argparse
import sys

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import array_module_for, poison

MIXED = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
ZERO = ("all_gather", "reduce_scatter", "broadcast")


def numbers(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(count).astype(np.float32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("sequence", choices=["mixed", "zero"])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--kernel-bytes", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--start", type=int, default=0,
                        help="where the cycle starts (3: a broadcast is the first direct call)")
    args = parser.parse_args()
    comm = hoccl.init(backend=args.backend, timeout=args.timeout,
                      kernel_bytes=args.kernel_bytes)
    arrays = array_module_for(comm.backend, "float32")
    n, r = comm.world_size, comm.rank
    cycle = MIXED if args.sequence == "mixed" else ZERO
    count = 3 if args.sequence == "mixed" else 0
    wrong = 0
    try:
        for index in range(args.calls):
            name = cycle[(index + args.start) % len(cycle)]
            seed = 7919 * index
            root = (index // len(cycle)) % n
            inputs = [numbers(count * (n if name in ("reduce_scatter", "all_to_all") else 1),
                              seed + peer) for peer in range(n)]
            if name == "all_reduce":
                expected = np.sum(np.stack(inputs).astype(np.float64), 0).astype(np.float32)
            elif name == "all_gather":
                expected = np.concatenate(inputs)
            elif name == "reduce_scatter":
                total = np.sum(np.stack(inputs).astype(np.float64), 0).astype(np.float32)
                expected = total[r * count:(r + 1) * count]
            elif name == "broadcast":
                expected = inputs[root]
            else:
                expected = np.concatenate([block[r * count:(r + 1) * count] for block in inputs])
            # one poisoned element past the output: a write beyond it shows there
            whole = arrays.asarray(poison(expected.size + 1, "float32"), comm.device)
            out = whole[:expected.size]
            send = arrays.asarray(inputs[r], comm.device)
            if name == "all_reduce":
                comm.all_reduce(send, out)
            elif name == "all_gather":
                comm.all_gather(send, out)
            elif name == "reduce_scatter":
                comm.reduce_scatter(send, out)
            elif name == "broadcast":
                comm.broadcast(send, out, root=root)
            else:
                comm.all_to_all(send, out)
            comm.synchronize()
            got = arrays.to_numpy(whole, "float32")
            want = np.concatenate([expected, poison(1, "float32")])
            if name in ("all_reduce", "reduce_scatter"):
                fine = (np.allclose(got[:-1], want[:-1], rtol=1e-5, atol=1e-5)
                        and got[-1:].view(np.uint32) == want[-1:].view(np.uint32))
            else:
                fine = np.array_equal(got.view(np.uint32), want.view(np.uint32))
            if not fine:
                wrong += 1
                print(f"rank {r}: FAILED call {index} ({name}): got {got}, want {want}",
                      flush=True)
        MPI.COMM_WORLD.Barrier()
    except hoccl.HocclError as error:
        print(f"rank {r}: FAILED {type(error).__name__}: {error}", flush=True)
        comm.close()
        return 1
    comm.close()
    if wrong:
        return 1
    print(f"rank {r}: OK {args.calls} {args.sequence} calls, every output exact", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
