"""Where one phase of a mixed job's all_reduce spends its time, rank by rank; or when
each step of the whole call ran (``--phase pipelined`` or ``sequential``).

  mpirun -np 4 python tools/profile_phase.py --devices cuda,cuda,cpu,cpu \
      --intra-host cuda,cuda,host,host --local-size 2 --size 256M --phase "rail all_reduce"
  mpirun -np 4 python tools/profile_phase.py ... --size 256M --phase pipelined
  mpirun -np 4 python tools/profile_phase.py ... --size 64M --phase pipelined \
      --host-memory shared   # the CPU ranks' tensors in hoccl.host_empty's memory

With ``pipelined`` each rank prints, for its last call, every step of the plan: its
worker (level), when the worker took it, when the step it waits for was done, when it
returned (ms from the call's start).  On a GPU a step returns once its work is
enqueued (a staged step waits for its copies), on the host once it is done.

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
    if own["--phase"] in ("pipelined", "sequential"):
        timeline(job, comm, parse_size(own["--size"]), own["--phase"])
        return
    once = _phase_callers(job, comm, parse_size(own["--size"]), args.dtype,
                          args.host_memory != "plain")[own["--phase"]]
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


def timeline(job, comm, nbytes: int, phases: str) -> None:
    """The whole all_reduce, ``--iters`` calls; each rank's steps of the last one."""
    import numpy as np
    from hoccl.bench.mixed import _tensor
    count = max(nbytes // np.dtype(job.args.dtype).itemsize, job.world_size)
    shared = job.args.host_memory != "plain"
    send = _tensor(job, np.ones(count, job.args.dtype), shared)
    recv = _tensor(job, np.zeros(count, job.args.dtype), shared)
    if job.kind == "cpu":
        send, recv = send.numpy(), recv.numpy()
    comm.set_options(phases=phases)

    def once():
        comm.all_reduce(send, recv)
        comm.synchronize()
        job.synchronize()
    once()
    job.mpi.Barrier()
    runner = comm._runner
    times = []
    for _ in range(job.args.iters):
        runner.trace = []
        start = time.monotonic()
        once()
        times.append((time.monotonic() - start) * 1e3)
    trace, runner.trace = runner.trace, None
    lines = [f"== rank {job.rank} ({job.kind}{', shared memory' if shared else ''}): "
             f"all_reduce {phases}, ms per call "
             + " ".join(f"{t:.1f}" for t in times)]
    for index, worker, taken, waited, returned in sorted(trace):
        at = [1e3 * (t - start) for t in (taken, waited, returned)]
        lines.append(f"  step {index:3d} {worker:22s} taken {at[0]:7.1f}  ready {at[1]:7.1f}  "
                     f"returned {at[2]:7.1f}  ({at[2] - at[1]:6.1f} ms)")
    reports = job.mpi.gather("\n".join(lines))
    if job.rank == 0:
        print("\n\n".join(reports), flush=True)
    comm.close()


def _value(words, name, default):
    return words[words.index(name) + 1] if name in words else default


if __name__ == "__main__":
    main()
