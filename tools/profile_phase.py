"""Where one phase of a mixed job's all_reduce spends its time, rank by rank.

  mpirun -np 4 python tools/profile_phase.py --devices cuda,cuda,cpu,cpu \
      --intra-host cuda,cuda,host,host --local-size 2 --size 256M --phase "rail all_reduce"

Runs the phase alone (as ``python -m hoccl.bench.mixed`` times it: the level's engine at
the size it has inside an all_reduce of ``--size`` per rank) once to warm up, then
``--iters`` times under cProfile, and prints each rank's wall time per call and its
functions by own time (``--top``), rank after rank.  The thread that calls is profiled:
a staged engine's steps run there; a host backend's stream threads do not.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

from hoccl.bench.mixed import Job, _phase_callers, arguments


def main() -> None:
    argv = sys.argv[1:]
    own = {"--phase": "rail all_reduce", "--size": "256M", "--top": "12"}
    rest = []
    while argv:
        word = argv.pop(0)
        if word in own:
            own[word] = argv.pop(0)
        else:
            rest.append(word)
    args = arguments(rest + ["--iters", str(max(1, int(_value(rest, "--iters", "3"))))])
    job = Job(args)
    from hoccl.bench._harness import parse_size
    comm = job.hoccl()
    once = _phase_callers(job, comm, parse_size(own["--size"]), args.dtype)[own["--phase"]]
    once()
    job.mpi.Barrier()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.iters):
        once()
    profile.disable()
    micros = (time.perf_counter() - start) / args.iters * 1e6
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(int(own["--top"]))
    report = f"== rank {job.rank} ({job.kind}): {own['--phase']} {micros:.0f} us per call\n"
    report += "\n".join(line for line in text.getvalue().splitlines()
                        if line.strip() and not line.startswith(("   Ordered", "   List")))
    reports = job.mpi.gather(report)
    if job.rank == 0:
        print("\n\n".join(reports), flush=True)
    comm.close()


def _value(words, name, default):
    return words[words.index(name) + 1] if name in words else default


if __name__ == "__main__":
    main()
