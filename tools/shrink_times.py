"""How long a job takes to go on after losing a rank, on the host backend:
``python tools/shrink_times.py [--runs 5] [--only TEXT] [--json PATH]``.

Runs the test suite's shrink programs: ``tests/mpi/run_shrink.py`` under mpiexec (MPICH's
keep-going flag, each rank under a shell that ignores SIGUSR1) and
``tests/torch_programs/run_shrink.py`` (workers on a TCPStore hosted here, torchrun's
agent store), ``--runs`` times per scenario.  Each survivor reports, from the moment the
victim went (its own clock stamp), the seconds until its call raised, until shrink (or
``dist.shrink_group``) returned and until its first exact all_reduce on the new
communicator; a run counts its slowest survivor.  Prints per scenario the median and the
range over the runs.  The scenarios on simulated hosts set ``HOCCL_LOCAL_SIZE``;
``--only`` keeps the scenarios whose label holds TEXT.  ``--device cuda``: the torch
scenarios of ``CUDA_SCENARIOS`` on hoccl's cuda backend, three workers sharing the
machine's GPUs (one GPU: all three on it).
"""

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MPI_PROGRAM = ROOT / "tests" / "mpi" / "run_shrink.py"
TORCH_PROGRAM = ROOT / "tests" / "torch_programs" / "run_shrink.py"
SURVIVE = ["sh", "-c", 'trap "" USR1; "$@"; exit 0', "sh"]
REPORT = re.compile(r"rank \d+: OK detect (-?[\d.]+) s shrink ([\d.]+) s first ([\d.]+) s")

#: the environment of a job on two simulated hosts of two ranks
HOSTS = {"HOCCL_LOCAL_SIZE": "2"}
#: (label, launcher, ranks, arguments, environment, ranks lost)
SCENARIOS = [
    ("exited between calls", "mpiexec", 3, ["dead", "--victims", "2"], {}, 1),
    ("exited between calls", "mpiexec", 4, ["dead", "--victims", "1"], {}, 1),
    ("SIGKILL during a 64 MiB all_reduce, wait=False", "mpiexec", 4,
     ["killed", "--victims", "2", "--no-wait"], {}, 1),
    ("closed its communicator", "mpiexec", 4, ["closed", "--victims", "0"], {}, 1),
    ("exited between calls", "torch", 3, ["--victims", "2"], {}, 1),
    ("exited between calls (rank 0)", "torch", 4, ["--victims", "0"], {}, 1),
    ("SIGKILL during a 32 MiB all_reduce, SHRINK_ABORT", "torch", 4,
     ["--victims", "2", "--how", "kill", "--abort"], {}, 1),
    ("2 simulated hosts: rank 3 exited between calls", "mpiexec", 4,
     ["dead", "--victims", "3"], HOSTS, 1),
    ("2 simulated hosts: rank 1 exited between calls", "mpiexec", 4,
     ["dead", "--victims", "1"], HOSTS, 1),
    ("2 simulated hosts: host 1 (ranks 2, 3) exited", "mpiexec", 4,
     ["dead", "--victims", "2+3"], HOSTS, 2),
    ("2 simulated hosts: rank 0 exited between calls", "torch", 4, ["--victims", "0"],
     HOSTS, 1),
]
#: the torch scenarios on the cuda backend: three workers, the victim last, first, in the
#: middle killed mid-call, and two failures one after the other
CUDA_SCENARIOS = [
    ("exited between calls", "torch", 3, ["--victims", "2"], {}, 1),
    ("exited between calls (rank 0)", "torch", 3, ["--victims", "0"], {}, 1),
    ("SIGKILL during a 32 MiB all_reduce, SHRINK_ABORT", "torch", 3,
     ["--victims", "1", "--how", "kill", "--abort"], {}, 1),
    ("rank 1 exited, then rank 2 (two shrinks)", "torch", 3, ["--victims", "1,2"], {}, 2),
]


def _env(extra):
    return {**os.environ, **extra,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def run_mpiexec(ranks, arguments, extra):
    mpiexec = shutil.which("mpiexec")
    with tempfile.TemporaryDirectory() as stamps:
        result = subprocess.run([mpiexec, "-disable-auto-cleanup", "-n", str(ranks), *SURVIVE,
                                 sys.executable, str(MPI_PROGRAM), *arguments, "--stamps",
                                 stamps], capture_output=True, text=True, timeout=300,
                                env=_env(extra), start_new_session=True)
    return result.stdout + result.stderr


def run_torch(ranks, arguments, extra):
    import torch.distributed as dist
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    with tempfile.TemporaryDirectory() as stamps:
        workers = [subprocess.Popen(
            [sys.executable, str(TORCH_PROGRAM), *arguments, "--stamps", stamps],
            env={**_env(extra), "RANK": str(rank), "WORLD_SIZE": str(ranks),
                 "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "TORCHELASTIC_USE_AGENT_STORE": "True"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(ranks)]
        output = "".join(worker.communicate(timeout=300)[0] for worker in workers)
    del store
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", default="")
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    scenarios = SCENARIOS
    if args.device == "cuda":
        scenarios = [(label, launcher, ranks, [*arguments, "--device", "cuda"], extra, lost)
                     for label, launcher, ranks, arguments, extra, lost in CUDA_SCENARIOS]
    rows = []
    print(f"{'what went':<50} {'launch':<8} {'ranks':>5}  {'error s':>17}  {'shrunk s':>17}  "
          f"{'first exact s':>17}")
    for label, launcher, ranks, arguments, extra, lost in scenarios:
        if args.only not in label:
            continue
        runs = []
        for _ in range(args.runs):
            output = (run_mpiexec if launcher == "mpiexec" else run_torch)(ranks, arguments,
                                                                           extra)
            found = [tuple(map(float, match)) for match in REPORT.findall(output)]
            if "FAILED" in output or len(found) < ranks - lost:
                print(f"  a run of {label} ({launcher}, {ranks}) failed:\n{output[-2000:]}")
                continue
            runs.append(tuple(max(values) for values in zip(*found)))
        if not runs:
            continue
        columns = list(zip(*runs))
        cells = [f"{statistics.median(c):.3f} ({min(c):.2f}-{max(c):.2f})" for c in columns]
        print(f"{label:<50} {launcher:<8} {ranks:>5}  {cells[0]:>17}  {cells[1]:>17}  "
              f"{cells[2]:>17}")
        rows.append(dict(what=label, launch=launcher, ranks=ranks, device=args.device,
                         runs=len(runs),
                         error=columns[0], shrunk=columns[1], first=columns[2]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
