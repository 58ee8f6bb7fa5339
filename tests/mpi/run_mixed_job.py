"""A real mixed job: ranks 0-1 on the GPU (hoccl's cuda backend inside their host), ranks
2-3 on CPUs (hoccl's host backend inside theirs), MPI between the two (the staged
engine: device data through pinned host memory on copy engines)::

    mpirun -np 4 python tests/mpi/run_mixed_job.py
    mpirun -np 4 python tests/mpi/run_mixed_job.py --cpu-only      # every rank on the CPU

Every collective (both forms, odd and large counts, each dtype and op, every root),
send/recv between every pair and a barrier are checked on every rank against numpy bit
for bit (``hoccl.testing.check_collective`` with the hosts' reduction,
``hierarchical_reduced``), first with sequential phases, then pipelined in small chunks;
each rank prints ``rank R: OK n/n`` or its failures, and the exit status is non-zero
when any rank failed.  Without a GPU (or with ``--cpu-only``) ranks 0-1 run the host
backend too.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import hoccl

sys.path.insert(0, str(Path(__file__).parent))
from run_hierarchical import check_every_call  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
OPS = ("sum", "prod", "max", "min", "avg")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-only", action="store_true", help="every rank on the host backend")
    parser.add_argument("--counts", default="0,1,5,17,1000,65537")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--ops", default=",".join(OPS))
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    if world.size != 4:
        sys.exit("run_mixed_job.py: run with 4 ranks (mpirun -np 4)")
    on_gpu = world.rank < 2 and not args.cpu_only and hoccl.backends.cuda_device_count() > 0
    comm = hoccl.init(timeout=120, local_size=2, inter_host="mpi",
                      intra_host="cuda" if on_gpu else "host")
    if world.rank == 0:
        print(f"mixed job: {comm.describe()}", flush=True)
    counts = [int(c) for c in args.counts.split(",")]
    passed, failures = 0, []
    for phases, phase_bytes in (("sequential", 4 << 20), ("pipelined", 4096)):
        comm.set_options(phases=phases, phase_bytes=phase_bytes)
        checked, failed = check_every_call(comm, 2, args.dtypes.split(","), counts,
                                           args.ops.split(","), label=f"{phases} ")
        passed += checked
        failures += failed
    comm.close()
    total = passed + len(failures)
    if failures:
        print(f"rank {world.rank}: FAILED {len(failures)}/{total}; first:\n{failures[0]}",
              flush=True)
    else:
        print(f"rank {world.rank}: OK {passed}/{total}", flush=True)
    failed = world.allreduce(len(failures), op=MPI.SUM)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
