"""Sends and receives across (simulated) hosts under mpiexec: single and batched in
``hoccl.group()``, every dtype, checked bit for bit against numpy.  Run with, e.g.::

    HOCCL_LOCAL_SIZE=2 mpiexec -n 4 python tests/mpi/run_pairs.py --inter-host mpi
    HOCCL_LOCAL_SIZE=1 mpiexec -n 2 python tests/mpi/run_pairs.py --inter-host gloo
    HOCCL_LOCAL_SIZE=1 mpiexec -n 2 python tests/mpi/run_pairs.py --unmatched group
    HOCCL_LOCAL_SIZE=2 mpiexec -n 4 python tests/mpi/run_pairs.py --torch-hosts 1

``--torch-hosts``: the hosts whose ranks use a torch gloo group inside (standing for a
vendor library), the others hoccl's host backend.

Every receive lands in a poisoned array, and every rank checks what it received against
the data its sender drew (the same seeds on every rank):

* single: every ordered pair of ranks, one pair after another (inside a host, along a
  rail, across both);
* rings: in one group, a send to the next rank and a receive from the one before, in
  either direction, even ranks sending first and odd ranks receiving first;
* everyone: in one group, a send to and a receive from every other rank, and a second
  send to the next rank (two pairs of one peer and direction, matched in their order),
  in an order of its own on each rank;
* ``--large`` bytes (float32, an odd count): a ring in a group and one send from the
  first rank to the last.

``--fault R``: rank R flips a bit of everything it received before checking it, so
every check with a receive there must fail.  ``--unmatched single|group``: the first rank sends to the last, which never receives:
the send must end within the timeout in ``HocclTimeoutError`` naming both ranks and
their hosts, the next call must be refused (``AbortedError``), and bad arguments must
be refused at once; prints ``unmatched across hosts: rank 0 OK``.  Each rank prints
``pairs rank R: N passed, M failed`` (rank 0 the totals); the exit status is non-zero
when any check failed.
"""

import argparse
import os
import sys
import time
import traceback

import numpy as np

if "ucx" in sys.argv:  # ucxx's UCX libraries before MPI's own copy (hoccl._hierarchy.ucx)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx  # noqa: F401
from mpi4py import MPI  # noqa: E402

import hoccl
from hoccl.testing import poison, random_array

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_hierarchical import init_torch_gloo  # noqa: E402

DTYPES = "float16,bfloat16,float32,float64,int8,uint8,int32,int64"


def sent(seed, sender, receiver, index, count, dtype):
    """What ``sender`` sends ``receiver`` as its ``index``-th pair of a check."""
    return random_array(np.random.default_rng([seed, sender, receiver, index]), count, dtype)


#: ``--fault``: this rank flips the first bit of everything it received before checking it
FAULT = {"rank": None}


def expect(got, want, what):
    if FAULT["rank"] == MPI.COMM_WORLD.rank and got.size:
        got = got.copy()
        got.view(np.uint8)[0] ^= 1
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{what}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    same = got.view(np.uint8) == want.view(np.uint8)
    if not same.all():
        first = int(np.flatnonzero(~same)[0]) // want.itemsize
        raise AssertionError(f"{what}: element {first} of {want.size} is {got[first]!r}, "
                             f"want {want[first]!r}")


def check_single(comm, dtype, count, seed):
    """Every ordered pair in turn; the receives checked once every pair has gone (a
    failed check must not leave a peer's later pair unmatched)."""
    n, r = comm.world_size, comm.rank
    received = []
    for sender in range(n):
        for receiver in range(n):
            if sender == receiver or r not in (sender, receiver):
                continue
            data = sent(seed, sender, receiver, 0, count, dtype)
            if r == sender:
                comm.send(data, receiver)
                continue
            out = poison(count, dtype)
            comm.recv(out, sender)
            comm.synchronize()
            received.append((out, data, f"send {sender} -> {receiver}"))
    for out, data, what in received:
        expect(out, data, what)


def run_group(comm, calls, seed, dtype, count):
    """``calls``: this rank's (kind, peer, index) in the order it makes them, inside one
    group; every receive checked after it."""
    r = comm.rank
    outs = []
    with hoccl.group():
        for kind, peer, index in calls:
            if kind == "send":
                comm.send(sent(seed, r, peer, index, count, dtype), peer)
            else:
                out = poison(count, dtype)
                outs.append((peer, index, out))
                comm.recv(out, peer)
    comm.synchronize()
    for peer, index, out in outs:
        expect(out, sent(seed, peer, r, index, count, dtype),
               f"group: recv {index} from {peer} on rank {r}")


def check_ring(comm, dtype, count, seed, step):
    n, r = comm.world_size, comm.rank
    calls = [("send", (r + step) % n, 0), ("recv", (r - step) % n, 0)]
    run_group(comm, calls if r % 2 == 0 else calls[::-1], seed, dtype, count)


def check_everyone(comm, dtype, count, seed):
    n, r = comm.world_size, comm.rank
    calls = []
    for step in range(1, n):
        peer = (r + step) % n if r % 2 else (r - step) % n
        pair = [("send", peer, 0), ("recv", peer, 0)]
        calls += pair if (r + step) % 2 else pair[::-1]
    # the k-th send to a peer matches its k-th receive from this rank (as MPI's order)
    first = calls.index(("send", (r + 1) % n, 0))
    calls.insert(first + 1, ("send", (r + 1) % n, 1))
    calls.append(("recv", (r - 1) % n, 1))
    run_group(comm, calls, seed, dtype, count)


def check_large(comm, nbytes, seed):
    count = nbytes // 4 | 1
    n, r = comm.world_size, comm.rank
    check_ring(comm, "float32", count, seed, 1)
    last = n - 1
    if r in (0, last):
        data = sent(seed + 1, 0, last, 0, count, "float32")
        if r == 0:
            comm.send(data, last)
        else:
            out = poison(count, "float32")
            comm.recv(out, 0)
            comm.synchronize()
            expect(out, data, f"large send 0 -> {last}")


def unmatched(comm, world, how, timeout):
    """The first rank sends to the last, which never receives (see the module docstring)."""
    n = comm.world_size
    last = n - 1
    if world.rank == last:  # absent: outlive rank 0's wait, then go
        time.sleep(timeout * 4)
        os._exit(0)
    if world.rank != 0:
        os._exit(0)
    problems = []
    local_size = comm.describe()["local_size"]
    for bad, call, match in (
            ("itself", lambda: comm.send(np.zeros(3, np.float32), 0), "peer"),
            ("out of range", lambda: comm.recv(np.zeros(3, np.float32), n), "peer"),
            ("read-only", lambda: comm.recv(np.broadcast_to(np.float32(0), (3,)), last),
             "recv"),
            ("a collective in a group", lambda: _in_group(comm.all_reduce,
                                                          np.zeros(3, np.float32),
                                                          np.zeros(3, np.float32)),
             "only send and recv inside hoccl.group()"),
            ("a bad send after one held in a group", lambda: _in_group_after_a_send(
                comm, last), "peer"),
            ("a stream on the host backend", lambda: comm.send(np.zeros(3, np.float32), last,
                                                               stream=1), "stream=None")):
        start = time.monotonic()
        try:
            call()
            problems.append(f"{bad}: taken")
        except hoccl.InvalidArgumentError as error:
            if match and match not in str(error):
                problems.append(f"{bad}: the error does not say why: {error}")
            if time.monotonic() - start > 1:
                problems.append(f"{bad}: refused only after a wait")
    data = np.arange(17, dtype=np.float32)
    start = time.monotonic()
    try:
        if how == "group":
            with hoccl.group():
                comm.send(data, last)
        else:
            comm.send(data, last)
        problems.append("the send returned though its receiver never called")
    except hoccl.HocclTimeoutError as error:
        waited = time.monotonic() - start
        if waited > timeout * 3:
            problems.append(f"the timeout came after {waited:.1f} s (timeout {timeout} s)")
        host = last // local_size
        for named in ("rank 0 (host 0,", f"rank {last} (host {host},"):
            if named not in str(error):
                problems.append(f"the error does not name {named!r}: {error}")
        print(f"rank 0: HocclTimeoutError after {waited:.1f} s: {error}", flush=True)
    try:
        comm.send(data, last)
        problems.append("a send after the timeout was taken")
    except hoccl.AbortedError as error:
        print(f"rank 0: next call AbortedError: {error}", flush=True)
    for problem in problems:
        print(f"rank 0 FAILED: {problem}", flush=True)
    print(f"unmatched across hosts: rank 0 {'OK' if not problems else 'FAILED'}", flush=True)
    sys.stdout.flush()
    os._exit(1 if problems else 0)


def _in_group(call, *args):
    with hoccl.group():
        call(*args)


def _in_group_after_a_send(comm, peer):
    """A send held in a group, then a send to this rank itself: the body raises the
    second's error (the held send is abandoned, not run)."""
    with hoccl.group():
        comm.send(np.zeros(3, np.float32), peer)
        comm.send(np.zeros(3, np.float32), comm.rank)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inter-host", default="mpi", choices=["mpi", "gloo", "ucx", "hoccl"])
    parser.add_argument("--dtypes", default=DTYPES)
    parser.add_argument("--counts", default="0,1,17,65537")
    parser.add_argument("--large", type=int, default=0, help="bytes of the large checks")
    parser.add_argument("--torch-hosts", default="",
                        help="hosts (comma-separated) whose ranks use a torch gloo group inside")
    parser.add_argument("--unmatched", choices=["single", "group"], default=None)
    parser.add_argument("--fault", type=int, default=None, metavar="RANK",
                        help="RANK flips a bit of every receive before checking it (the "
                             "checker must fail)")
    args = parser.parse_args()
    FAULT["rank"] = args.fault
    world = MPI.COMM_WORLD
    torch_hosts = {int(h) for h in args.torch_hosts.split(",") if h}
    gloo = args.inter_host == "gloo" or bool(torch_hosts)
    if gloo:
        init_torch_gloo(world)
    settings = {}
    if torch_hosts:
        local_size = int(os.environ["HOCCL_LOCAL_SIZE"])
        settings["intra_host"] = "torch" if world.rank // local_size in torch_hosts else None
    timeout = 4.0 if args.unmatched else 120.0
    comm = hoccl.init(backend="host", timeout=timeout, inter_host=args.inter_host, **settings)
    if world.rank == 0:
        print(f"pairs: {comm.describe()}", flush=True)
    if not isinstance(comm, hoccl.HierarchicalCommunicator):
        sys.exit(f"rank {world.rank}: not across hosts ({comm!r}): set HOCCL_LOCAL_SIZE")
    if args.unmatched:
        unmatched(comm, world, args.unmatched, timeout)
    checks = []
    seed = 0
    for dtype in args.dtypes.split(","):
        for count in (int(c) for c in args.counts.split(",")):
            seed += 10
            checks += [(f"single {dtype} x{count}", lambda d=dtype, c=count, s=seed:
                        check_single(comm, d, c, s)),
                       (f"ring forward {dtype} x{count}", lambda d=dtype, c=count, s=seed:
                        check_ring(comm, d, c, s + 1, 1)),
                       (f"ring backward {dtype} x{count}", lambda d=dtype, c=count, s=seed:
                        check_ring(comm, d, c, s + 2, -1)),
                       (f"everyone {dtype} x{count}", lambda d=dtype, c=count, s=seed:
                        check_everyone(comm, d, c, s + 3))]
    if args.large:
        checks.append((f"large {args.large} bytes", lambda: check_large(comm, args.large, 99)))
    passed, failures = 0, []
    for name, check in checks:
        try:
            check()
            passed += 1
        except Exception:
            failures.append(f"{name}\n{traceback.format_exc()}")
            if comm.aborted:
                break
    for failure in failures[:3]:
        print(f"rank {world.rank} FAILED {failure}", flush=True)
    print(f"pairs rank {world.rank}: {passed} passed, {len(failures)} failed", flush=True)
    comm.close()
    totals = world.allreduce(np.array([passed, len(failures)]), op=MPI.SUM)
    if gloo:
        import torch.distributed as dist
        dist.destroy_process_group()
    if world.rank == 0:
        print(f"pairs across hosts ranks={world.size} inter={args.inter_host}: "
              f"{totals[0]} passed, {totals[1]} failed", flush=True)
    sys.exit(1 if totals[1] else 0)


if __name__ == "__main__":
    main()
