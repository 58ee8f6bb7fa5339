"""Several calls in one ``hoccl.group()``, checked against the same calls made one by one.

``python run_groups.py [--local N] [--backend B] [--mix M] [--groups G] [--seed S]``:
under mpirun (one rank per process) or, with ``--local N``, N ranks in this process
(``init_local``).  Every process draws the same groups from the seed: group g holds
1 to 5 calls, each a collective (any kind, size, dtype, op and root, some in place) or
a ring of send/recv in either direction, every output poisoned first.  After each
group every output of this process's ranks is compared exactly with ``expected``
(numpy).

Mixes: ``random`` (the above); ``sums`` (two int32 sum all_reduces of different sizes a
group); ``broadcast`` (a broadcast then an all_reduce); ``scatter`` (a scatter then an
all_reduce, all_gather, all_to_all or reduce_scatter).

Prints ``rank R: OK G groups, C calls`` (or the first wrong outputs and ``rank R:
FAILED W of C outputs wrong``) and exits 1 on a wrong output.  A hang ends in hoccl's
timeout (``--timeout``), which aborts the job.
"""

import argparse
import sys

import numpy as np

import hoccl
from hoccl.testing import (MAX_INPUTS, POISON_BITS, array_module_for, expected, is_poison,
                           poison, random_array)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "reduce", "gather", "scatter", "send_recv")
DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64")
#: (send, receive) elements in multiples of the count: 1 or the world size
SIZES = {"all_gather": (1, "n"), "reduce_scatter": ("n", 1), "all_reduce": (1, 1),
         "all_to_all": ("n", "n"), "broadcast": (1, 1), "reduce": (1, 1),
         "gather": (1, "n"), "scatter": ("n", 1), "send_recv": (1, 1)}
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def draw(rng: np.random.Generator, mix: str, n: int, dtypes) -> list:
    """One group's calls: ``(collective, count, dtype, op, root, in_place, shift)``."""
    def call(name, count=None, dtype=None, op="sum", root=None):
        if count is None:
            count = int(rng.choice([0, 1, int(rng.integers(2, 300)),
                                    int(rng.integers(300, 20000))], p=[.05, .1, .55, .3]))
        dtype = dtype or str(rng.choice(dtypes))
        if name in ("all_reduce", "reduce_scatter", "reduce") and op is None:
            ops = ["sum", "max", "min"] + (["avg"] if dtype.startswith(("float", "bf")) else [])
            op = str(rng.choice(ops))
        root = int(rng.integers(n)) if root is None else root
        in_place = name in ("all_reduce", "broadcast") and bool(rng.integers(2))
        shift = int(rng.choice([1, -1]))  # the ring's direction
        return (name, count, dtype, op, root, in_place, shift)

    if mix == "sums":
        return [call("all_reduce", 1000, "int32", root=0),
                call("all_reduce", 37, "int32", root=0)]
    if mix == "broadcast":
        return [call("broadcast", op=None), call("all_reduce", op=None)]
    if mix == "scatter":
        second = str(rng.choice(["all_reduce", "all_gather", "all_to_all", "reduce_scatter"]))
        return [call("scatter", op=None), call(second, op=None)]
    return [call(str(rng.choice(COLLECTIVES)), op=None) for _ in range(int(rng.integers(1, 6)))]


def run_group(comms, calls, n, rng, arrays_for) -> list:
    """Issue ``calls`` on every communicator of ``comms`` inside one group; return, per
    output, ``(what, want, got_array, dtype, module, bits)`` to check after synchronize."""
    planned = []
    for name, count, dtype, op, root, in_place, shift in calls:
        send_count, recv_count = (count * n if times == "n" else count
                                  for times in SIZES[name])
        inputs = [random_array(rng, send_count, dtype) for _ in range(n)]
        if name in ("broadcast", "scatter"):
            inputs = [x if r == root else None for r, x in enumerate(inputs)]
        if name == "send_recv":
            want = [inputs[(r - shift) % n].copy() if n > 1 else None for r in range(n)]
        else:
            want = expected(name, inputs, op=op, root=root,
                            inputs_per_launch=MAX_INPUTS if comms[0].backend == "cuda" else None)
        planned.append((name, count, dtype, op, root, in_place, shift, inputs, want,
                        recv_count))
    outputs = []
    with hoccl.group():
        for comm in comms:
            r = comm.rank
            for index, (name, count, dtype, op, root, in_place, shift, inputs, want,
                        recv_count) in enumerate(planned):
                module = arrays_for(dtype)
                bits = POISON_BITS[dtype]
                if want[r] is not None and is_poison(want[r], bits).any():
                    bits ^= (1 << 8 * np.dtype(want[r].dtype).itemsize) - 1
                recv = (module.asarray(poison(recv_count, dtype, bits), comm.device)
                        if want[r] is not None else None)
                send = (module.asarray(inputs[r], comm.device)
                        if inputs[r] is not None else None)
                if in_place and recv is not None:
                    module.fill(recv, inputs[r] if send is not None
                                else poison(recv_count, dtype, bits))
                    send = recv
                what = f"call {index} {name} count={count} {dtype} op={op} root={root}" \
                       f"{' in place' if in_place else ''}: rank {r}"
                if name == "send_recv":
                    if n > 1:
                        comm.send(send, (r + shift) % n)
                        comm.recv(recv, (r - shift) % n)
                elif name in ("broadcast", "gather", "scatter"):
                    getattr(comm, name)(send, recv, root)
                elif name == "reduce":
                    comm.reduce(send, recv, root, op)
                elif name in ("all_reduce", "reduce_scatter"):
                    getattr(comm, name)(send, recv, op)
                else:
                    getattr(comm, name)(send, recv)
                if want[r] is not None:
                    outputs.append((what, want[r], recv, dtype, module, bits))
    return outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local", type=int, default=0, help="ranks in this process")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--mix", default="random", choices=["random", "sums", "broadcast",
                                                            "scatter"])
    parser.add_argument("--groups", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    if args.local:
        comms = hoccl.init_local(args.local, backend=args.backend, timeout=args.timeout)
    else:
        comms = [hoccl.init(backend=args.backend, timeout=args.timeout)]
    n = comms[0].world_size
    backend = comms[0].backend
    dtypes = DTYPES
    if backend == "cuda":
        try:
            import torch  # noqa: F401  (bfloat16 arrays)
        except ImportError:
            dtypes = tuple(d for d in DTYPES if d != "bfloat16")
    labels = ",".join(str(comm.rank) for comm in comms)
    print(f"ranks {labels} of {n} ({backend}): mix {args.mix}, {args.groups} groups, "
          f"seed {args.seed}", flush=True)
    wrong = calls = 0
    for index in range(args.groups):
        rng = np.random.default_rng([args.seed, index])
        group = draw(rng, args.mix, n, dtypes)
        outputs = run_group(comms, group, n, rng, lambda dtype: array_module_for(backend, dtype))
        for comm in comms:
            comm.synchronize()
        calls += len(group)
        for what, want, recv, dtype, module, bits in outputs:
            got = module.to_numpy(recv, dtype)
            bad = np.flatnonzero(want.view(f"u{want.dtype.itemsize}")
                                 != got.view(f"u{got.dtype.itemsize}"))
            if bad.size:
                wrong += 1
                if wrong <= 5:
                    first = int(bad[0])
                    print(f"group {index} (seed {args.seed}): {what}: {bad.size} of {want.size} "
                          f"wrong, {int(is_poison(got, bits)[bad].sum())} unwritten; first at "
                          f"{first}: got {got[first]!r}, expected {want[first]!r}", flush=True)
    for comm in comms:
        comm.close()
    if wrong:
        print(f"rank {labels}: FAILED {wrong} outputs wrong ({calls} calls in {args.groups} "
              f"groups, seed {args.seed})", flush=True)
        return 1
    print(f"rank {labels}: OK {args.groups} groups, {calls} calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
