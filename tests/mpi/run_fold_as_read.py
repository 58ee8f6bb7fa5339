"""The staged engine's all_reduce between a staged member and a member in host memory,
two processes over the cross-memory transport: the host member folds its peer's pinned
slots as it reads them (``StagedEngine._folded_as_read``), the staged member takes an
all_gather and a fold.  Run with::

    mpiexec -n 2 python tests/mpi/run_fold_as_read.py --host-member 1

The staged member's device is host memory whose copies run when issued (its slots are
segments, not page-locked), so the slots, chunks and offers are the GPU's.  Pieces in a
peer's segment are read where they are mapped (``--no-map``: all by cross-memory
attach).  Both members draw the same inputs (fresh seeds, shared), poison their outputs,
and check them bit for bit against numpy's fold in member order (``reduce_arrays``), in
place and out of place, for every dtype, op, count and stage size given; the host member
also checks that it folded as it read.  ``--plant`` flips one bit of each host member's output before the check: every
check with elements must then fail.  Prints ``N passed, M failed (P faults planted)`` on
member 0; the exit status is non-zero unless exactly the planted checks failed.
"""

import argparse
import sys

import numpy as np
from mpi4py import MPI

from hoccl._dtypes import reduce_arrays
from hoccl._hierarchy import staged
from hoccl._hierarchy.cma import CmaTransport
from hoccl.backends._segments import PeerSegments, shared_bytes
from hoccl._hierarchy.slots import _HostCopies
from hoccl.testing import poison, random_array


class _Engine(staged.StagedEngine):
    name = "test"

    @classmethod
    def transports(cls, setup):
        raise NotImplementedError


class _StagedMember(_Engine):
    """Arrays count as device memory: staged through slots (plain arrays)."""

    @staticmethod
    def _on_host(arrays):
        return False

    @staticmethod
    def pinned(nbytes):
        return shared_bytes(nbytes)

    @staticmethod
    def unpinned(memory):
        pass


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host-member", type=int, default=1)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16,int32")
    parser.add_argument("--ops", default="sum,avg,max,prod")
    parser.add_argument("--counts", default="0,1,17,4099")
    parser.add_argument("--stage-bytes", default="64,4096")
    parser.add_argument("--plant", action="store_true")
    parser.add_argument("--no-map", action="store_true",
                        help="map no peer's segment: every piece read by cross-memory attach")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("run_fold_as_read.py: run it on 2 ranks")
    member = comm.Get_rank()
    transport = CmaTransport.connect(comm.Dup())
    if not isinstance(transport, CmaTransport):
        raise SystemExit("run_fold_as_read.py: the members cannot read each other's memory")
    on_host = member == args.host_member
    mapped = 0
    plain_view = PeerSegments.view

    def view(segments, *given):
        nonlocal mapped
        found = None if args.no_map else plain_view(segments, *given)
        mapped += found is not None
        return found
    PeerSegments.view = view
    folds_as_read = 0
    plain_fold = staged._fold_into

    def counted(out, op):
        nonlocal folds_as_read
        folds_as_read += 1
        return plain_fold(out, op)
    staged._fold_into = counted
    passed = failed = planted = 0
    rng = np.random.default_rng(comm.bcast(int(np.random.SeedSequence().entropy % 2**63)))
    for stage_bytes in map(int, args.stage_bytes.split(",")):
        if on_host:
            engine = _Engine(transport, None, 30.0, stage_bytes)
        else:
            engine = _StagedMember(transport, _HostCopies(), 30.0, stage_bytes)
        for dtype in args.dtypes.split(","):
            for op in args.ops.split(","):
                for count in map(int, args.counts.split(",")):
                    for in_place in (False, True):
                        inputs = [random_array(rng, count, dtype) for _ in range(2)]
                        want = reduce_arrays(inputs, op, inputs[0].dtype)
                        send = inputs[member].copy()
                        recv = send if in_place else poison(count, dtype)
                        before = folds_as_read
                        engine.all_reduce(send, recv, op)
                        if args.plant and on_host and count:
                            recv.view(np.uint8)[count // 2 * recv.itemsize] ^= 1
                        good = np.array_equal(recv.view(np.uint8), want.view(np.uint8))
                        if on_host and count and folds_as_read == before:
                            good = False
                            print(f"member {member}: {dtype} {op} {count} in_place={in_place} "
                                  f"stage {stage_bytes}: did not fold as it read", flush=True)
                        passed, failed = passed + good, failed + (not good)
                        planted += bool(args.plant and on_host and count)
    total = comm.allreduce(np.array([passed, failed, planted, mapped]), op=MPI.SUM)
    if member == 0:
        print(f"fold as read, host member {args.host_member}: {total[0]} passed, "
              f"{total[1]} failed ({total[2]} faults planted); {total[3]} pieces read where "
              f"mapped", flush=True)
    transport.close()
    return 0 if total[1] == total[2] else 1


if __name__ == "__main__":
    sys.exit(main())
