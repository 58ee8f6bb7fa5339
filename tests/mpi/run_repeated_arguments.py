"""Repeated calls skip the argument checks, stay exact, and still meet mismatches.

``python run_repeated_arguments.py CASE [--local N]``: under mpirun (one rank per process), or with
``--local N`` N ranks in this process (``init_local``); host backend.

exact     all_gather, reduce_scatter and all_reduce (in place and out of place), each
          repeated 6 times on plain and on registered buffers with fresh random data
          (outputs poisoned), also through new array objects over the same memory: every
          result equals numpy's, and only each argument list's first call resolves its
          arrays (``as_buffer`` is counted)
mismatch  after two calls of an all_reduce, rank 1's third uses buffers of another
          size while the others repeat theirs: every rank raises MismatchError, and the
          communicator stays usable (5 exact all_reduces after)
folds     (one rank a process) 50 repeats of an all_reduce on registered buffers, exact,
          replayed (``hoccl._engine.replay``): no array resolved, no call prepared, no
          message sent nor any peer's awaited by the calls themselves (their checks are folded,
          ``hoccl._groups.folds``, and go as one digest at each synchronize); then rank
          1 replays its all_reduce on other registered buffers where the others replay
          theirs: every rank's synchronize raises DivergedError

Each rank prints ``rank R: CASE ok ...`` or ``rank R: FAILED ...``; exits 1 on a failure.
"""

import argparse
import sys

import numpy as np

import hoccl
import hoccl._api
from hoccl import MismatchError
from hoccl.testing import assert_exact, poison, random_array

resolved = {"arrays": 0}
_as_buffer = hoccl._api.as_buffer


def _counting(*args, **kwargs):
    resolved["arrays"] += 1
    return _as_buffer(*args, **kwargs)


hoccl._api.as_buffer = _counting


def _step(comms, call):
    """Make ``call(comm)`` on every rank, then synchronize each."""
    for comm in comms:
        call(comm)
    for comm in comms:
        comm.synchronize()


def exact(comms, rng) -> str:
    n = comms[0].world_size
    count = 1000 + n  # blocks of odd size
    for registered in (False, True):
        def make(size, comm):
            return hoccl.empty(size, "float32", comm) if registered else \
                np.empty(size, np.float32)
        sends = {comm.rank: make(count * n, comm) for comm in comms}
        recvs = {comm.rank: make(count * n, comm) for comm in comms}
        cases = [
            ("all_gather", lambda c: (sends[c.rank][:count], recvs[c.rank])),
            ("reduce_scatter", lambda c: (sends[c.rank], recvs[c.rank][:count])),
            ("all_reduce", lambda c: (sends[c.rank], recvs[c.rank])),
            ("all_reduce in place", lambda c: (recvs[c.rank], recvs[c.rank])),
        ]
        for name, arrays in cases:
            before = resolved["arrays"]
            for repeat in range(6):
                data = {rank: random_array(rng, count * n, "float32") for rank in range(n)}
                for comm in comms:
                    sends[comm.rank][:] = data[comm.rank]
                    recvs[comm.rank][:] = data[comm.rank] if name.endswith("in place") \
                        else poison(count * n, "float32")
                # a new array object over the same memory (as a framework's allocator hands
                # back) is the same argument list
                views = {comm.rank: tuple(a.view() if repeat % 2 else a
                                          for a in arrays(comm)) for comm in comms}
                method = name.split()[0]
                _step(comms, lambda comm: getattr(comm, method)(*views[comm.rank]))
                stacked = np.stack([data[rank] for rank in sorted(data)])
                for comm in comms:
                    out = views[comm.rank][1]
                    if method == "all_gather":
                        want = stacked[:, :count].reshape(-1)
                    elif method == "reduce_scatter":
                        want = stacked.sum(0, dtype=np.float32)[comm.rank * count:
                                                                (comm.rank + 1) * count]
                    else:
                        want = stacked.sum(0, dtype=np.float32)
                    _close(f"{name} repeat {repeat}", want, out)
            made = resolved["arrays"] - before
            if made != 2 * len(comms):  # the first call of each rank, two arrays each
                raise AssertionError(f"{name} ({'registered' if registered else 'plain'}): "
                                     f"{made} arrays resolved in 6 calls of {len(comms)} "
                                     f"rank(s); expected {2 * len(comms)}")
    return f"resolved {resolved['arrays']} arrays"


def _close(what, want, got):
    # sums of float32 in another order: within a few ulps; copies bit for bit
    if not np.allclose(got, want, rtol=1e-5, atol=1e-4):
        assert_exact(what, want, got)


def mismatch(comms, rng) -> str:
    small = {comm.rank: (np.ones(64, np.float32), np.zeros(64, np.float32)) for comm in comms}
    other = (np.ones(80, np.float32), np.zeros(80, np.float32))
    for _ in range(2):
        _step(comms, lambda comm: comm.all_reduce(*small[comm.rank]))
    raised = {}
    for comm in comms:
        try:
            comm.all_reduce(*(other if comm.rank == 1 else small[comm.rank]))
        except MismatchError as error:
            raised[comm.rank] = error
    for comm in comms:
        try:
            comm.synchronize()
        except MismatchError as error:
            raised.setdefault(comm.rank, error)
    missing = [comm.rank for comm in comms if comm.rank not in raised]
    if missing:
        raise AssertionError(f"ranks {missing} raised no MismatchError for the mismatched "
                             f"repeat")
    for comm in comms:
        if comm.aborted:
            raise AssertionError(f"rank {comm.rank} aborted after a mismatch the ranks skip")
    for _ in range(5):
        data = {rank: random_array(rng, 64, "float32") for rank in range(comms[0].world_size)}
        for comm in comms:
            small[comm.rank][0][:] = data[comm.rank]
            small[comm.rank][1][:] = poison(64, "float32")
        _step(comms, lambda comm: comm.all_reduce(*small[comm.rank]))
        want = np.stack([data[rank] for rank in sorted(data)]).sum(0, dtype=np.float32)
        for comm in comms:
            _close("all_reduce after the mismatch", want, small[comm.rank][1])
    return "MismatchError on every rank, usable after"


def folds(comms, rng) -> str:
    import threading

    import hoccl._groups.folds
    import hoccl._groups.matching
    import hoccl._groups.process
    from hoccl._engine.prepared import Preparer
    from hoccl._mailbox import Mailboxes
    (comm,) = comms
    n = comm.world_size
    engine = comm._engine
    sent, received, prepared = [], [], []
    calling = [False]
    waits = (hoccl._groups.process, hoccl._groups.folds, hoccl._groups.matching)
    originals = Mailboxes.send, hoccl._groups.process.wait_until, Preparer.call

    def mine():  # a call's own work (not synchronize's, nor the watchdog's)
        return calling[0] and threading.current_thread() is threading.main_thread()

    def counting_send(self, *args, **kwargs):
        if mine():
            sent.append(args[1][0])
        return originals[0](self, *args, **kwargs)

    def counting_wait(*args, **kwargs):  # a wait for a peer's message
        if mine():
            received.append(args[2] if len(args) > 2 else "wait")
        return originals[1](*args, **kwargs)

    def counting_prepare(self, *args, **kwargs):
        if mine():
            prepared.append(args[0])
        return originals[2](self, *args, **kwargs)

    Mailboxes.send, Preparer.call = counting_send, counting_prepare
    for module in waits:
        module.wait_until = counting_wait
    send, recv = hoccl.empty(1000, "float32", comm), hoccl.empty(1000, "float32", comm)
    other = hoccl.empty(1000, "float32", comm)
    for _ in range(2):  # a second call on other buffers, made twice: replayed later
        comm.all_reduce(send, other)
    comm.synchronize()
    for repeat in range(52):
        if repeat == 2:  # the first calls tell the peers their descriptions
            sent.clear(), received.clear(), prepared.clear()
            resolved["arrays"], replayed = 0, engine.replayed
        data = [random_array(rng, 1000, "float32") for _ in range(n)]
        send[:] = data[comm.rank]
        recv[:] = poison(1000, "float32")
        calling[0] = True
        comm.all_reduce(send, recv)
        calling[0] = False
        if repeat % 10 == 9:
            comm.synchronize()
            _close(f"registered all_reduce repeat {repeat}", np.sum(data, 0, dtype=np.float32),
                   recv)
    comm.synchronize()
    if sent or received:
        raise AssertionError(f"50 repeated calls sent {len(sent)} message(s) ({sent[:5]}) "
                             f"and waited for the peers {len(received)} times")
    if resolved["arrays"] or prepared or engine.replayed - replayed != 50:
        raise AssertionError(f"50 repeated calls resolved {resolved['arrays']} arrays, were "
                             f"prepared {len(prepared)} times and replayed "
                             f"{engine.replayed - replayed} times; expected 0, 0 and 50")
    # rank 1 replays its call on other buffers where the others replay theirs: both are
    # repeats, neither asks; the folds' digests differ at the synchronize
    replayed = engine.replayed
    comm.all_reduce(send, other if comm.rank == 1 else recv)
    if engine.replayed != replayed + 1:
        raise AssertionError("the diverging repeat was not replayed")
    try:
        comm.synchronize()
    except hoccl.DivergedError as error:
        if not comm.aborted:
            raise AssertionError(f"DivergedError but not aborted: {error}")
        return (f"no message, no array resolved, no call prepared in 50 replayed repeats; "
                f"DivergedError: {str(error)[:100]}")
    raise AssertionError("a diverged repeat on registered buffers raised nothing")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("case", choices=("exact", "mismatch", "folds"))
    parser.add_argument("--local", type=int, default=0)
    args = parser.parse_args()
    comms = (hoccl.init_local(args.local, backend="host", timeout=20) if args.local
             else [hoccl.init(backend="host", timeout=20)])
    # every process draws the data of every rank alike (each checks its own ranks' results)
    rng = np.random.default_rng(comms[0].world_size)
    try:
        seen = {"exact": exact, "mismatch": mismatch, "folds": folds}[args.case](comms, rng)
    except AssertionError as error:
        for comm in comms:
            print(f"rank {comm.rank}: FAILED {args.case}: {error}", flush=True)
        return 1
    for comm in comms:
        print(f"rank {comm.rank}: {args.case} ok: {seen}", flush=True)
        try:
            comm.close()
        except hoccl.HocclError as error:  # an aborted communicator may say why again
            print(f"rank {comm.rank}: close: {error}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
