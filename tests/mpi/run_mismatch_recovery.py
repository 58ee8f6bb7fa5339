"""After a mismatch every rank is in the same state: usable where the ranks could skip the
failed call together, else aborted everywhere with a ``DivergedError`` naming the calls.

``python run_mismatch_recovery.py CASE [--local N] [--timeout T]``: under mpirun (one
rank per process), or with ``--local N`` N ranks in this process (``init_local``).

Cases that stay usable (each rank's error is named; then 5 all_reduces of data that
differs from call to call must be exact on every rank, so a shift of one rank's calls
against the others' shows):

refused_recv   rank 0 sends to rank 1, whose recv is refused (a read-only buffer)
refused_coll   rank 1's all_reduce is refused (its buffers differ in size)
all_refused    every rank's all_reduce is refused (an unknown op)
refused_group  inside ``hoccl.group()`` rank 1's second all_reduce is refused, and the
               body raises
refused_send   rank 1's send to rank 0 is refused (a dtype hoccl does not take)

Cases that abort every rank (each rank raises DivergedError, or the error of the peer
that found the divergence, within the timeout; later calls raise):

skipped_register  rank 1 skips a ``hoccl.empty`` registration that the others make
ungrouped_cycle   every rank sends to rank+1, then receives from rank-1, outside a group
                  (2 ranks: each finds the other's send where it waits for its recv,
                  DivergedError; more: a cycle of waits on the host, HocclTimeoutError)

Each rank prints ``rank R: <case> usable`` or ``rank R: <case> aborted`` followed by what
it saw, or ``rank R: FAILED ...``; exits 1 on a failure.
"""

import argparse
import sys
import time

import numpy as np

import hoccl
from hoccl import (AbortedError, DivergedError, HocclError, HocclTimeoutError,
                   InvalidArgumentError, MismatchError)

USABLE = ("refused_recv", "refused_coll", "all_refused", "refused_group", "refused_send")
ABORTED = ("skipped_register", "ungrouped_cycle")


def first_step(case: str, comms: list) -> dict:
    """Make each rank's first step of ``case``; what each rank raised (by rank)."""
    raised: dict = {}
    n = comms[0].world_size

    def attempt(comm, step):
        try:
            step()
        except HocclError as error:
            raised[comm.rank] = error

    x = {comm.rank: np.arange(10, dtype=np.float32) + comm.rank for comm in comms}
    if case == "ungrouped_cycle":
        # every rank first sends: the send waits on the host for its peer's recv
        for comm in comms:
            attempt(comm, lambda comm=comm: (comm.send(x[comm.rank], (comm.rank + 1) % n),
                                             comm.recv(np.zeros(10, np.float32),
                                                       (comm.rank - 1) % n)))
    elif case == "skipped_register":
        for comm in comms:
            if comm.rank != 1:
                attempt(comm, lambda comm=comm: hoccl.empty(64, "float32", comm))
    elif case == "refused_group":
        def grouped():
            with hoccl.group():
                for comm in comms:
                    out = np.zeros(10 if comm.rank != 1 else 3, np.float32)
                    comm.all_reduce(x[comm.rank], np.zeros(10, np.float32))
                    comm.all_reduce(x[comm.rank], out)
        try:
            grouped()
        except HocclError as error:
            raised.setdefault(1 if len(comms) > 1 else comms[0].rank, error)
    else:
        for comm in comms:
            r = comm.rank
            if case == "refused_recv":
                if r == 0:
                    attempt(comm, lambda comm=comm: comm.send(x[0], 1))
                elif r == 1:
                    read_only = np.zeros(10, np.float32)
                    read_only.flags.writeable = False
                    attempt(comm, lambda comm=comm: comm.recv(read_only, 0))
            elif case == "refused_send":
                if r == 0:
                    attempt(comm, lambda comm=comm: comm.recv(np.zeros(10, np.float32), 1))
                elif r == 1:
                    attempt(comm, lambda comm=comm: comm.send(np.zeros(10, np.complex64), 0))
            elif case == "refused_coll":
                out = np.zeros(10 if r != 1 else 5, np.float32)
                attempt(comm, lambda comm=comm, out=out: comm.all_reduce(x[comm.rank], out))
            elif case == "all_refused":
                attempt(comm, lambda comm=comm: comm.all_reduce(x[comm.rank],
                                                                np.zeros(10, np.float32), "nope"))
    for comm in comms:
        try:
            comm.synchronize()
        except HocclError as error:
            raised.setdefault(comm.rank, error)
    return raised


def later_calls(comms: list, calls: int = 5) -> dict:
    """``calls`` all_reduces of data that differs from call to call: per rank, None if all
    were exact, else what went wrong."""
    n = comms[0].world_size
    problems: dict = {comm.rank: None for comm in comms}
    for index in range(calls):
        outputs = {}
        for comm in comms:
            data = np.full(7, 100 * index + comm.rank, np.int64)
            outputs[comm.rank] = np.full(7, -1, np.int64)
            try:
                comm.all_reduce(data, outputs[comm.rank])
            except HocclError as error:
                problems[comm.rank] = problems[comm.rank] or f"call {index}: {error!r}"
        want = sum(100 * index + r for r in range(n))
        for comm in comms:
            try:
                comm.synchronize()
            except HocclError as error:
                problems[comm.rank] = problems[comm.rank] or f"call {index}: {error!r}"
                continue
            if problems[comm.rank] is None and not (outputs[comm.rank] == want).all():
                problems[comm.rank] = (f"call {index}: got {outputs[comm.rank][0]}, want {want} "
                                       f"(calls shifted against the peers')")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("case", choices=USABLE + ABORTED)
    parser.add_argument("--local", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    if args.local:
        comms = hoccl.init_local(args.local, backend="host", timeout=args.timeout)
    else:
        comms = [hoccl.init(backend="host", timeout=args.timeout)]
    started = time.monotonic()
    raised = first_step(args.case, comms)
    failed = False
    if args.case in USABLE:
        problems = later_calls(comms)
        for comm in comms:
            error = raised.get(comm.rank)
            seen = f"{type(error).__name__}: {error}" if error else "no error"
            if comm.aborted or problems[comm.rank]:
                failed = True
                print(f"rank {comm.rank}: FAILED {args.case}: aborted={comm.aborted}, "
                      f"{problems[comm.rank]}; first step: {seen}", flush=True)
            elif error is not None and not isinstance(error, (MismatchError,
                                                              InvalidArgumentError)) \
                    or isinstance(error, DivergedError):
                failed = True
                print(f"rank {comm.rank}: FAILED {args.case}: first step raised {seen}",
                      flush=True)
            else:
                print(f"rank {comm.rank}: {args.case} usable; first step: {seen}", flush=True)
    else:
        for comm in comms:
            later = None
            try:
                comm.all_reduce(np.ones(3, np.float32), np.zeros(3, np.float32))
                comm.synchronize()
            except HocclError as error:
                later = error
            error = raised.get(comm.rank) or later
            took = time.monotonic() - started
            ok = (comm.aborted and isinstance(later, (AbortedError, DivergedError))
                  and isinstance(error, (DivergedError, AbortedError) + (
                      (HocclTimeoutError,) if args.case == "ungrouped_cycle" else ()))
                  and took < 2 * args.timeout)
            if not ok:
                failed = True
            print(f"rank {comm.rank}: {'' if ok else 'FAILED '}{args.case} "
                  f"{'aborted' if comm.aborted else 'NOT aborted'} in {took:.2f} s; first: "
                  f"{type(error).__name__}: {error}; later: {type(later).__name__}", flush=True)
    for comm in comms:
        comm.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
