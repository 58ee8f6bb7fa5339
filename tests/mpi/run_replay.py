"""Replayed repeats (``hoccl._engine.replay``) stay exact, and end where they must.

``python run_replay.py [--backend B]`` (world 1) or under ``mpirun -n N``: every rank
makes all_gather, reduce_scatter, all_reduce (in place and out of place) and all_to_all
six times each on the same buffers, registered (``hoccl.empty``) and plain, with fresh
random values and outputs poisoned before each call; each output is compared with
numpy's.  Calls that may be replayed (every call at world 1; across processes, registered
buffers of these symmetric collectives, and plain buffers where the plan the backend
chose touches no peer buffer but its scratch: a pushed reduce_scatter, a one-shot
all_reduce) are counted as replayed from their second or third call on, the others
never; at world 1 the repeats of a call in place enqueue nothing.  Then what a replay
was built from changes, and the next call
goes the full path (prepared afresh) and stays exact, its repeats replayed again: another
caller stream, new options (``set_options``), a newly registered window; and a call
inside ``hoccl.group()``, which is never replayed.

Each rank prints ``rank R: replay ok (...)`` or ``rank R: FAILED ...``; exits 1 on a
failure.
"""

import argparse
import sys

import numpy as np

import hoccl
from hoccl._engine.prepared import Preparer
from hoccl.sched.plan import RING
from hoccl.testing import array_module_for, assert_exact, expected, poison, random_array

COUNT = 96  # elements of each rank's block: float32
CALLS = 6

prepared = [0]
last = [None]  # the last prepared call
_call = Preparer.call


def _counting(self, *args, **kwargs):
    prepared[0] += 1
    last[0] = _call(self, *args, **kwargs)
    return last[0]


def touches_only_scratch(plan, rank):
    """Whether ``rank``'s peers' buffers that the plan touches are only their scratch (or
    a direct kernel's ring): known after the first exchange, whatever the caller passed."""
    return all(name in ("scratch", RING) or not plan.buffer(peer, name).nbytes
               for peer in plan.participants if peer != rank for name in plan.shared(peer))


Preparer.call = _counting


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="host")
    args = parser.parse_args()
    comm = hoccl.init(backend=args.backend, timeout=30)
    n, r = comm.world_size, comm.rank
    engine = comm._engine
    arrays = array_module_for(comm.backend, "float32")
    rng = np.random.default_rng(11 + r)
    failures = []

    def buffer(count, registered):
        if registered:
            return hoccl.empty(count, "float32", comm)
        return arrays.asarray(poison(count, "float32"), comm.device)

    def inputs_of(count, seed):
        # every rank draws every rank's input from one seed: each knows what all sent
        generator = np.random.default_rng(seed)
        return [random_array(generator, count, "float32") for _ in range(n)]

    def one(collective, send, recv, seed, stream=None, in_place=False):
        """One call on fresh values, its output poisoned first, checked against numpy."""
        count = {"all_gather": COUNT, "reduce_scatter": COUNT * n, "all_reduce": COUNT * n,
                 "all_to_all": COUNT * n}[collective]
        out = COUNT if collective == "reduce_scatter" else COUNT * n
        inputs = inputs_of(count, seed)
        arrays.fill(recv, poison(out, "float32"))
        arrays.fill(send, inputs[r])
        if in_place:
            recv = send
        if stream is not None and comm.backend == "cuda":
            # the fills ran on torch's current stream: the call on another stream is
            # ordered after them by its caller, as with NCCL
            import torch
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        getattr(comm, collective)(send, recv, stream=stream)
        comm.synchronize()
        assert_exact(f"{collective}{' in place' if in_place else ''} seed {seed}",
                     expected(collective, inputs)[r], arrays.to_numpy(recv, "float32"))

    cases = [("all_gather", COUNT, COUNT * n, False), ("reduce_scatter", COUNT * n, COUNT, False),
             ("all_reduce", COUNT * n, COUNT * n, False), ("all_reduce", COUNT * n, None, True),
             ("all_to_all", COUNT * n, COUNT * n, False)]
    seed = 1000
    for registered in (True, False):
        for collective, sends, recvs, in_place in cases:
            send = buffer(sends, registered)
            recv = send if in_place else buffer(recvs, registered)
            before, numbered = engine.replayed, engine.calls
            for _ in range(CALLS):
                seed += 1
                try:
                    one(collective, send, recv, seed, in_place=in_place)
                except AssertionError as error:
                    failures.append(str(error))
            # a plan whose peers' buffers are their scratch only (which the backend's
            # choice of path decides: pushed or one-shot reductions) knows them after the
            # first exchange; its first call may grow the scratch, which ends the prepared
            # call of the second
            replayable = n == 1 or registered or touches_only_scratch(last[0].plan, r)
            got = engine.replayed - before
            least = 0 if not replayable else CALLS - 1 if n == 1 else CALLS - 2
            if got < least or got > (CALLS - 1 if replayable else 0):
                failures.append(f"{collective} {'registered' if registered else 'plain'}"
                                f"{' in place' if in_place else ''}: {got} of {CALLS} calls "
                                f"replayed; expected {least}"
                                f"{f' to {CALLS - 1}' if replayable else ''}")
            # a world of one in place has nothing to move: its repeats enqueue nothing (no
            # completion value taken), its first call alone is numbered
            if n == 1 and in_place and engine.calls - numbered != 1:
                failures.append(f"{collective} in place at world 1: {engine.calls - numbered} "
                                f"of {CALLS} calls enqueued; expected the first alone")

    send, recv = buffer(COUNT * n, True), buffer(COUNT * n, True)

    def changed(what, change, stream=None):
        """After ``change``, the next call is prepared afresh, later ones replayed."""
        nonlocal seed
        one("all_reduce", send, recv, seed)  # made, then replayed
        one("all_reduce", send, recv, seed + 1)
        change()
        before_prepared, before_replayed = prepared[0], engine.replayed
        for index in range(3):
            seed += 1
            try:
                one("all_reduce", send, recv, seed + 2, stream=stream)
            except AssertionError as error:
                failures.append(f"{what}: {error}")
        fresh, replays = prepared[0] - before_prepared, engine.replayed - before_replayed
        if (fresh, replays) != (1, 2):
            failures.append(f"{what}: {fresh} of 3 calls prepared afresh and {replays} "
                            f"replayed; expected 1 and 2")

    changed("another caller stream", lambda: None, stream=engine.device.create_stream()
            if comm.backend == "host" else _torch_stream(comm))
    changed("new options", lambda: comm.set_options(chunk_bytes=1 << 16))
    windows = []
    changed("a newly registered window", lambda: windows.append(buffer(64, True)))
    before = engine.replayed
    seed += 1
    inputs = inputs_of(COUNT * n, seed)
    arrays.fill(send, inputs[r])
    arrays.fill(recv, poison(COUNT * n, "float32"))
    with hoccl.group():
        comm.all_reduce(send, recv)
    comm.synchronize()
    try:
        assert_exact("all_reduce in hoccl.group()", expected("all_reduce", inputs)[r],
                     arrays.to_numpy(recv, "float32"))
    except AssertionError as error:
        failures.append(str(error))
    if engine.replayed != before:
        failures.append("a call inside hoccl.group() was replayed")
    comm.close()
    for failure in failures:
        print(f"rank {r}: FAILED {failure}", flush=True)
    if not failures:
        print(f"rank {r}: replay ok ({engine.replayed} calls replayed)", flush=True)
    return 1 if failures else 0


def _torch_stream(comm):
    import torch
    return torch.cuda.Stream(device=comm.device)


if __name__ == "__main__":
    sys.exit(main())
