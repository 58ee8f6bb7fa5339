"""Under mpirun: repeated copy-engine calls on registered buffers go the shortest path
(their prepared calls, found in the engine's cache, issued without asking the peers) and
stay exact, on the caller's stream (one-lane plans) and on the lanes; a prepared call is
never reused with a scratch buffer that has been replaced since.
``python run_repeats.py [--backend B] [--rounds N]``.

Every rank registers its buffers once (``hoccl.empty``) and makes, round after round,
the same calls on them (all_gather and all_to_all, reduce_scatter and all_reduce in
place and out of place, broadcast), with fresh values written into the inputs and the
outputs poisoned before each round; every output is checked against numpy.  The repeats
are counted.  Then a reduce_scatter of a larger count makes hoccl replace its reduction
scratch; the next call of the smaller one must be prepared afresh (not a reuse of a
program bound to the old scratch, which is freed at the next synchronize) and exact, and
the ones after it repeats again.  Prints ``repeats ranks=N: P passed, F failed``.
"""

import argparse
import sys

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import array_module_for, poison, reduced, run_or_abort

COUNT = 3000  # elements per rank's block: float32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    comm = hoccl.init(backend=args.backend, timeout=60)
    engine = comm._engine
    n, r = comm.world_size, comm.rank
    arrays = array_module_for(comm.backend, "float32")
    preparer = engine.preparer

    def found():  # calls that found their prepared call, or replayed it
        return preparer.reused + engine.replayed

    reused, fast = found(), engine.issued_fast

    def registered(count):
        array = hoccl.empty(count, "float32", comm)
        arrays.fill(array, poison(count, "float32"))
        return array

    def numbers(count, seed):
        return np.random.default_rng(seed).standard_normal(count).astype(np.float32)

    full, send, total, out = (registered(COUNT * n), registered(COUNT * n),
                              registered(COUNT * n), registered(COUNT))
    own = full[r * COUNT:(r + 1) * COUNT]
    failures = []

    def check(what, want, got):
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            bad = int(np.sum(~np.isclose(got, want, rtol=1e-5, atol=1e-5)))
            failures.append(f"{what}: {bad} of {want.size} elements wrong")

    def reduce_scatter(what, send, out, inputs, count):
        """A reduce_scatter of ``count`` elements per rank into a poisoned ``out``, checked."""
        arrays.fill(out, poison(count, "float32"))
        comm.reduce_scatter(send, out, "sum")
        comm.synchronize()
        check(what, reduced([inputs[peer][r * count:(r + 1) * count] for peer in range(n)],
                            "sum"), arrays.to_numpy(out, "float32"))

    def round_(index):
        """Every call once, on the same buffers, with fresh values."""
        seed = 100 * index
        blocks = [numbers(COUNT, seed + peer) for peer in range(n)]
        inputs = [numbers(COUNT * n, seed + 50 + peer) for peer in range(n)]
        arrays.fill(full, poison(COUNT * n, "float32"))
        arrays.fill(own, blocks[r])
        comm.all_gather(own, full)
        comm.synchronize()
        check(f"round {index} all_gather", np.concatenate(blocks),
              arrays.to_numpy(full, "float32"))
        arrays.fill(send, inputs[r])
        arrays.fill(total, poison(COUNT * n, "float32"))
        comm.all_to_all(send, total)
        comm.synchronize()
        check(f"round {index} all_to_all",
              np.concatenate([inputs[peer][r * COUNT:(r + 1) * COUNT] for peer in range(n)]),
              arrays.to_numpy(total, "float32"))
        reduce_scatter(f"round {index} reduce_scatter", send, out, inputs, COUNT)
        arrays.fill(total, inputs[r])
        comm.all_reduce(total, total, "max")
        comm.synchronize()
        check(f"round {index} all_reduce in place", reduced(inputs, "max"),
              arrays.to_numpy(total, "float32"))
        arrays.fill(full, poison(COUNT * n, "float32"))
        if r == index % n:
            arrays.fill(full, inputs[r])
        comm.broadcast(full, full, root=index % n)
        comm.synchronize()
        check(f"round {index} broadcast", inputs[index % n],
              arrays.to_numpy(full, "float32"))

    for index in range(args.rounds):
        round_(index)
    calls = 5 * args.rounds
    # the first round's reductions grow the scratch (which ends the first calls' prepared
    # calls); broadcast, rooted, is never issued without asking: every later symmetric
    # call repeats
    repeats = min(found() - reused, engine.issued_fast - fast)
    if repeats < 4 * (args.rounds - 2):
        failures.append(f"{repeats} repeats (prepared calls found and issued without asking) "
                        f"in {calls} calls on the same buffers; expected "
                        f"{4 * (args.rounds - 2)} or more")
    # a larger reduce_scatter replaces the scratch; the smaller one is then planned afresh
    big_send, big_out = registered(8 * COUNT * n), registered(8 * COUNT)
    inputs = [numbers(8 * COUNT * n, 7000 + peer) for peer in range(n)]
    arrays.fill(big_send, inputs[r])
    reduce_scatter("larger reduce_scatter", big_send, big_out, inputs, 8 * COUNT)
    before = found()
    for index in range(3):
        inputs = [numbers(COUNT * n, 9000 + 10 * index + peer) for peer in range(n)]
        arrays.fill(send, inputs[r])
        reduce_scatter(f"reduce_scatter after the scratch grew, call {index}", send, out,
                       inputs, COUNT)
    afresh = 3 - (found() - before)
    if afresh != 1:
        failures.append(f"after the scratch was replaced, {afresh} of 3 calls were prepared "
                        f"afresh; expected 1 (then repeats)")
    comm.close()
    for failure in failures:
        print(f"rank {r}: FAILED {failure}", flush=True)
    failed = MPI.COMM_WORLD.allreduce(len(failures))
    if r == 0:
        print(f"repeats ranks={n}: {n * (calls + 4)} passed, {failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    run_or_abort(main)
