"""Registered buffers under mpirun: ``mpiexec -n N python run_registered.py [--backend B]``.

Calls on registered buffers are issued without a descriptor exchange; these checks show
what keeps that safe, on every rank, against numpy:

* calls on registered and unregistered buffers interleaved, in and out of
  ``hoccl.group()``, are exact, and the registered ones went without an exchange;
* a rank whose registered call differs (another count, another offset, a buffer outside
  its window) makes every rank raise DivergedError and abort, and nothing outside the
  registered windows changes (guard bytes on both sides of each window are checked);
* registration mistakes (an overlapping or empty array on one rank) raise on every rank;
* deregistered memory is no longer used without an exchange, and registering again works;
* a registered call in a ``hoccl.group()`` that every rank abandons runs on none; one
  that one rank abandons makes the others raise DivergedError at once.

Rank 0 prints ``N passed, M failed``; the exit status is non-zero when a check failed.
"""

import argparse
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import array_module_for, assert_exact, poison, random_array

GUARD = 4096  # bytes on each side of a registered window, which nothing may write


class Slab:
    """One array per rank: [guard | window | guard]; only the window is registered."""

    def __init__(self, comm, count, dtype="float32"):
        self.comm, self.dtype = comm, dtype
        self.arrays = array_module_for(comm.backend, dtype)
        itemsize = np.dtype(dtype).itemsize
        self.guard = GUARD // itemsize
        self.count = count
        self.base = self.arrays.asarray(poison(count + 2 * self.guard, dtype), comm.device)
        self.window = self.base[self.guard:self.guard + count]
        comm.register(self.window)

    def view(self, start, count):
        return self.window[start:start + count]

    def guards_intact(self, what):
        whole = self.arrays.to_numpy(self.base, self.dtype)
        for part in (whole[:self.guard], whole[-self.guard:]):
            assert_exact(f"{what}: rank {self.comm.rank}'s guard bytes", poison(len(part),
                         self.dtype), part)


def fill(arrays, view, data, device):
    view[...] = arrays.asarray(data, device)


def check_mixed(comm, seed):
    """Registered and unregistered all_gather / all_reduce / reduce_scatter / all_to_all,
    alternating, then the same inside one hoccl.group(): exact; the registered calls went
    without an exchange."""
    n, r = comm.world_size, comm.rank
    count = 1000
    slab = Slab(comm, 8 * n * count)
    arrays, device = slab.arrays, comm.device
    rng = np.random.default_rng(seed)
    before = comm._engine.issued_fast
    for round_ in range(4):
        registered = round_ % 2 == 0
        data = [random_array(rng, n * count, "float32") for _ in range(n)]
        if registered:
            send, recv = slab.view(0, n * count), slab.view(n * count, n * count)
            ar, rs = slab.view(2 * n * count, n * count), slab.view(3 * n * count, count)
            a2a = slab.view(4 * n * count, n * count)
        else:
            send, recv, ar, a2a = (arrays.asarray(poison(n * count, "float32"), device)
                                   for _ in range(4))
            rs = arrays.asarray(poison(count, "float32"), device)
        for view in (recv, rs, a2a):
            fill(arrays, view, poison(len(view), "float32"), device)
        fill(arrays, send, data[r], device)
        fill(arrays, ar, data[r], device)
        grouped = round_ >= 2
        if grouped:
            hoccl.group_start()
        comm.all_gather(send[:count], recv)
        comm.all_reduce(ar, ar, "max")
        comm.reduce_scatter(send, rs, "sum")
        comm.all_to_all(send, a2a)
        if grouped:
            hoccl.group_end()
        comm.synchronize()
        what = f"round {round_} ({'registered' if registered else 'unregistered'}" \
               f"{', grouped' if grouped else ''})"
        assert_exact(f"{what} all_gather", np.concatenate([d[:count] for d in data]),
                     arrays.to_numpy(recv, "float32"))
        assert_exact(f"{what} all_reduce max", np.maximum.reduce(data),
                     arrays.to_numpy(ar, "float32"))
        want = np.sum(np.stack(data).astype(np.float64), axis=0).astype(np.float32) \
            if n <= 2 else None
        got = arrays.to_numpy(rs, "float32")
        if want is not None:  # two addends: exact in any order
            assert_exact(f"{what} reduce_scatter", want[r * count:(r + 1) * count], got)
        else:
            np.testing.assert_allclose(got, np.sum(np.stack(data), axis=0)[r * count:(r + 1) *
                                       count], rtol=1e-5, atol=1e-5)
        assert_exact(f"{what} all_to_all",
                     np.concatenate([d[r * count:(r + 1) * count] for d in data]),
                     arrays.to_numpy(a2a, "float32"))
    # 2 registered rounds of 4 calls each (the first reduce_scatter learns the peers'
    # scratch by an exchange)
    fast = comm._engine.issued_fast - before
    assert fast >= 7, f"rank {r}: only {fast} registered calls went without an exchange"
    slab.guards_intact("mixed calls")
    comm.deregister(slab.window)


def diverging(world, backend, seed, how):
    """One rank's registered call differs; every rank must raise DivergedError, abort,
    and leave the guard bytes alone."""
    comm = hoccl.init(backend=backend, timeout=30)
    n, r = comm.world_size, comm.rank
    count = 256
    odd = r == n - 1
    # "beyond": the last rank registers more, and its call reaches past the others' windows
    slab = Slab(comm, (8 if odd and how == "beyond" else 4) * n * count)
    arrays = slab.arrays
    # warm up: one agreed registered call, so that the diverging one is fast on every rank;
    # every rank finishes it before any makes the diverging call (whose abort would
    # otherwise reach a slower rank still synchronizing the warm-up)
    comm.all_gather(slab.view(r * count, count), slab.view(0, n * count))
    comm.synchronize()
    world.Barrier()
    if how == "count":
        mine = count // 2 if odd else count
        send, recv = slab.view(r * mine, mine), slab.view(0, n * mine)
    elif how in ("offset", "beyond"):
        start = (n * count if how == "offset" else 6 * n * count) if odd else 0
        send, recv = slab.view(start + r * count, count), slab.view(start, n * count)
    else:  # "unregistered": the last rank passes a buffer outside any window
        if odd:
            recv = arrays.asarray(poison(n * count, "float32"), comm.device)
            send = recv[r * count:(r + 1) * count]
        else:
            send, recv = slab.view(r * count, count), slab.view(0, n * count)
    raised = None
    try:
        comm.all_gather(send, recv)
        comm.synchronize()
    except (hoccl.MismatchError, hoccl.AbortedError) as error:
        # AbortedError: a peer had aborted on the divergence before this rank's call began
        raised = error
    aborted = comm.aborted
    comm.close()
    # every rank reaches this gather, whatever it saw (an MPI collective left out by one
    # rank would hang the others)
    kinds = world.allgather((type(raised).__name__ if raised else "nothing", aborted,
                             str(raised)[:300]))
    assert raised is not None, f"rank {r}: a diverging registered call ({how}) raised nothing"
    assert aborted, f"rank {r}: {type(raised).__name__} without an abort"
    assert any(kind == "DivergedError" for kind, _, _ in kinds), \
        f"no rank saw the divergence: {kinds}"
    slab.guards_intact(f"diverging ({how})")
    return ", ".join(kind for kind, _, _ in kinds)


def abandon(call):
    """Make ``call`` inside a ``hoccl.group()`` whose body then raises (and is caught)."""
    try:
        with hoccl.group():
            call()
            raise RuntimeError("body")
    except RuntimeError:
        pass


def abandoned_by_one(world, backend):
    """The last rank abandons a repeated registered call (its ``hoccl.group()`` body
    raises) that the others made and issued without asking: they raise DivergedError
    naming the abandoned call well within the timeout (not HocclTimeoutError after it),
    and every communicator is aborted."""
    comm = hoccl.init(backend=backend, timeout=30)
    n, r = comm.world_size, comm.rank
    count = 64
    slab = Slab(comm, n * count)
    send, recv = slab.view(r * count, count), slab.view(0, n * count)
    comm.all_gather(send, recv)  # the first call: described to the peers
    comm.synchronize()
    world.Barrier()
    started = time.monotonic()
    raised = None
    try:
        if r == n - 1:
            abandon(lambda: comm.all_gather(send, recv))
        else:
            comm.all_gather(send, recv)
        comm.synchronize()
    except hoccl.HocclError as error:
        raised = error
    took = time.monotonic() - started
    aborted = comm.aborted
    comm.close()
    kinds = world.allgather((type(raised).__name__ if raised else "nothing", aborted,
                             str(raised)[:300], took))
    for rank, (kind, rank_aborted, message, seconds) in enumerate(kinds):
        assert rank_aborted, f"rank {rank} was not aborted: {kinds}"
        assert seconds < 10, f"rank {rank} took {seconds:.1f} s: {kinds}"
        if rank != n - 1:
            assert kind in ("DivergedError", "AbortedError"), kinds
    assert any(kind == "DivergedError" and "abandoned" in message
               for kind, _, message, _ in kinds[:-1]), f"no rank named the abandoned call: {kinds}"
    slab.guards_intact("abandoned by one")
    return ", ".join(kind for kind, _, _, _ in kinds)


def check_registration_errors(comm):
    """An empty array or an overlapping one on one rank raises InvalidArgumentError on
    every rank; the communicator stays usable and registers again."""
    n, r = comm.world_size, comm.rank
    slab = Slab(comm, 64)
    for what in ("overlapping", "empty"):
        if r == n - 1:
            bad = slab.window[8:16] if what == "overlapping" else slab.window[:0]
        else:
            bad = slab.arrays.asarray(poison(16, "float32"), comm.device)
        try:
            comm.register(bad)
            raise AssertionError(f"rank {r}: an {what} registration on rank {n - 1} was "
                                 f"accepted")
        except hoccl.InvalidArgumentError as error:
            assert f"rank {n - 1}" in str(error), str(error)
    other = Slab(comm, 64)  # registration still works
    assert len(comm.windows) == 2, comm.windows
    comm.deregister(other.window)
    comm.deregister(slab.window)
    assert not comm.windows
    try:
        comm.deregister(slab.window)
        raise AssertionError("deregistering twice was accepted")
    except hoccl.InvalidArgumentError:
        pass


def check_deregistered(comm, seed):
    """After deregister, a call on that memory goes with an exchange, and is exact."""
    n, r = comm.world_size, comm.rank
    count = 100
    slab = Slab(comm, n * count)
    comm.deregister(slab.window)
    before = comm._engine.issued_fast
    rng = np.random.default_rng(seed)
    data = [random_array(rng, count, "float32") for _ in range(n)]
    fill(slab.arrays, slab.view(r * count, count), data[r], comm.device)
    comm.all_gather(slab.view(r * count, count), slab.view(0, n * count))
    comm.synchronize()
    assert_exact("all_gather after deregister", np.concatenate(data),
                 slab.arrays.to_numpy(slab.window, "float32"))
    assert comm._engine.issued_fast == before, "a deregistered buffer went without an exchange"


def check_abandoned_everywhere(comm, seed):
    """Every rank's ``hoccl.group()`` body raises after a registered all_gather (a repeat:
    issued without asking): no rank runs it, synchronize is quiet, the window keeps its
    poison; the same call afterwards is exact."""
    n, r = comm.world_size, comm.rank
    count = 32
    slab = Slab(comm, n * count)
    data = [random_array(np.random.default_rng(seed + rank), count, "float32")
            for rank in range(n)]

    def load():
        fill(slab.arrays, slab.view(0, n * count), poison(n * count, "float32"), comm.device)
        fill(slab.arrays, slab.view(r * count, count), data[r], comm.device)

    def gather():
        comm.all_gather(slab.view(r * count, count), slab.view(0, n * count))

    load()
    gather()  # the first call of the prepared call: its description goes to the peers
    comm.synchronize()
    load()
    abandon(gather)
    comm.synchronize()
    got = slab.arrays.to_numpy(slab.window, "float32")
    mine = np.concatenate([poison(r * count, "float32"), data[r],
                           poison((n - r - 1) * count, "float32")])
    assert_exact("after a group every rank abandoned", mine, got)
    gather()
    comm.synchronize()
    assert_exact("all_gather after the abandoned group", np.concatenate(data),
                 slab.arrays.to_numpy(slab.window, "float32"))
    comm.deregister(slab.window)


def check_rank_ahead(comm, seed, calls=12):
    """Rank 0 makes each call late: its peers make all of them and ``synchronize``,
    sending their digests, which come before rank 0 has made the calls they cover.  Its
    ``synchronize`` returns (with no message left to come: the peers wait in an MPI
    barrier by then, not in a call of hoccl's), and the outputs are exact (each call gathers the same blocks)."""
    n, r = comm.world_size, comm.rank
    count = 64
    slab = Slab(comm, n * count)
    data = [random_array(np.random.default_rng(seed + rank), count, "float32")
            for rank in range(n)]
    fill(slab.arrays, slab.view(0, n * count), poison(n * count, "float32"), comm.device)
    fill(slab.arrays, slab.view(r * count, count), data[r], comm.device)
    for _ in range(calls):
        if r == 0:
            time.sleep(0.02)
        comm.all_gather(slab.view(r * count, count), slab.view(0, n * count))
    try:
        comm.synchronize()
    finally:  # no hoccl message comes while rank 0 synchronizes (its timeout ends a wait)
        MPI.COMM_WORLD.Barrier()
    assert_exact("all_gather, rank 0 late", np.concatenate(data),
                 slab.arrays.to_numpy(slab.window, "float32"))
    comm.deregister(slab.window)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default=None)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    results = []

    def run(name, action):
        try:
            outcome = action()
            ok = True
        except Exception:
            ok, outcome = False, None
            print(f"rank {world.rank} FAILED {name}\n{traceback.format_exc()}", flush=True)
        ok = world.allreduce(ok, op=MPI.LAND)
        results.append(ok)
        if world.rank == 0:
            print(f"{'ok    ' if ok else 'FAILED'} {name}{f': {outcome}' if outcome else ''}",
                  flush=True)

    comm = hoccl.init(backend=args.backend, timeout=30)
    run("registered and unregistered calls mixed", lambda: check_mixed(comm, 1))
    run("registration errors raise on every rank", lambda: check_registration_errors(comm))
    run("deregistered memory", lambda: check_deregistered(comm, 2))
    run("rank 0 late to every call", lambda: check_rank_ahead(comm, 3))
    run("a group every rank abandons", lambda: check_abandoned_everywhere(comm, 4))
    comm.close()
    for how in ("count", "offset", "beyond", "unregistered"):
        run(f"diverging registered call ({how})",
            lambda how=how: diverging(world, args.backend, 10, how))
    run("a repeated registered call one rank abandons",
        lambda: abandoned_by_one(world, args.backend))
    failed = results.count(False)
    if world.rank == 0:
        print(f"registered ranks={world.size}: {len(results) - failed} passed, {failed} failed",
              flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
