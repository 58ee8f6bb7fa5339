"""Which CUDA driver calls hoccl's host time goes to, in any program.

Run: ``mpirun -np 2 python tools/driver_profile.py -m hoccl.bench.train --shapes comm ...``
(or ``tools/driver_profile.py script.py args``).  Wraps hoccl's checked driver gateway
(``hoccl.backends._cuda_driver._call``, in every module of the cuda backend that calls
it) to add up, per driver function, the calls and the host time inside them, then runs
the program; at exit each rank prints its table, the functions with the most time first.  A driver call that waits (for room in a stream's
queue, for the GPU, for a lock) shows here as time far above its usual few µs.
"""

import atexit
import os
import runpy
import sys
import time


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    from hoccl.backends import _cuda_driver, _cuda_kernels, _cuda_memory, cuda
    totals: dict = {}
    original = _cuda_driver._call

    def timed(function, *args):
        start = time.perf_counter()
        try:
            return original(function, *args)
        finally:
            name = getattr(function, "__name__", str(function))
            count, seconds, worst = totals.get(name, (0, 0.0, 0.0))
            spent = time.perf_counter() - start
            totals[name] = (count + 1, seconds + spent, max(worst, spent))
    for module in (_cuda_driver, _cuda_kernels, _cuda_memory, cuda):
        module._call = timed

    def report() -> None:
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0"))
        lines = [f"driver calls of rank {rank} (calls, total ms, mean µs, worst µs):"]
        for name, (count, seconds, worst) in sorted(totals.items(), key=lambda x: -x[1][1]):
            lines.append(f"  {name:36s} {count:9d} {seconds * 1e3:10.1f} "
                         f"{seconds / count * 1e6:9.1f} {worst * 1e6:10.1f}")
        print("\n".join(lines), file=sys.stderr, flush=True)
    atexit.register(report)
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
