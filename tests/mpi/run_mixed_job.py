"""A real mixed job: ranks 0-1 on the GPU (hoccl's cuda backend inside their host), ranks
2-3 on CPUs (hoccl's host backend inside theirs), MPI between the two (the staged
engine: device data through pinned host memory on copy engines)::

    mpirun -np 4 python tests/mpi/run_mixed_job.py --json results/mixed_job/mixed_job.json
    mpirun -np 4 python tests/mpi/run_mixed_job.py --cpu-only      # every rank on the CPU

Every collective (both forms, odd and large counts, each dtype and op, every root),
send/recv between every pair and a barrier are checked on every rank against numpy bit
for bit (``hoccl.testing.check_collective`` with the hosts' reduction,
``hierarchical_reduced``), first with sequential phases, then pipelined in small chunks.
Then point to point across the hosts: sends and receives batched in ``hoccl.group()``
(rings in either direction, and each rank with its peer on the other host both ways) at
counts 0, 1, odd and 64 MiB + 4 bytes, every receive poisoned first, on the devices of
the ranks (GPU to CPU and back); then its bandwidth beside gloo's on the same tensors
(``hoccl.bench.mixed``'s sendrecv: each rank with the rank of its local rank on the other
host, both ways at once; checked, then timed); then torch.distributed.pipelining's
``--schedules`` (GPipe and 1F1B) on the "hoccl" backend, each pipeline one rank per host
(ranks 0 and 2, 1 and 3: the stages alternate GPU and CPU), against a single-process
reference on the CPU and the same schedule on gloo (``tests/torch_programs/
run_pipeline.py``).  Each rank prints ``rank R: OK n/n`` or its failures, and the exit
status is non-zero when any rank failed; ``--json`` (rank 0) writes the checks, the
bandwidth records and the schedules' differences from the reference.  Without a GPU (or
with ``--cpu-only``) ranks 0-1 run the host backend too.
"""

import argparse
import json
import os
import socket
import sys
import traceback
from pathlib import Path

import numpy as np

if "ucx" in sys.argv:  # ucxx's UCX libraries before MPI's own copy (hoccl._hierarchy.ucx)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx  # noqa: F401
from mpi4py import MPI  # noqa: E402

import hoccl
from hoccl.testing import array_module_for, poison, random_array

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
    parser.add_argument("--pair-counts", default=f"0,1,65537,{(64 << 20) // 4 + 1}",
                        help="element counts of the batched sends and receives")
    parser.add_argument("--p2p-sizes", default="1M,16M,64M,256M",
                        help="sizes of the point-to-point bandwidth beside gloo (empty: none)")
    parser.add_argument("--schedules", default="GPipe,1F1B",
                        help="pipelining schedules to check (empty: none)")
    parser.add_argument("--json", default="", help="write the results here (rank 0)")
    parser.add_argument("--inter-host", default="mpi", choices=("mpi", "ucx", "gloo"),
                        help="the engine between the two hosts")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    if world.size != 4:
        sys.exit("run_mixed_job.py: run with 4 ranks (mpirun -np 4)")
    on_gpu = world.rank < 2 and not args.cpu_only and hoccl.backends.cuda_device_count() > 0
    comm = hoccl.init(timeout=120, local_size=2, inter_host=args.inter_host,
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
    results = {"devices": world.allgather("cuda" if on_gpu else "cpu"),
               "describe": comm.describe(), "collectives": {"passed": passed}}
    checked, failed = check_batched_pairs(comm, [int(c) for c in args.pair_counts.split(",")])
    passed += checked
    failures += failed
    results["pairs"] = {"passed": checked}
    if args.p2p_sizes:
        try:
            results["p2p"] = p2p_bandwidth(comm, on_gpu, args.p2p_sizes)
            passed += 1
        except Exception:
            failures.append(f"p2p bandwidth\n{traceback.format_exc()}")
    comm.close()
    if args.schedules:
        checked, failed, results["pipelining"] = check_pipelines(on_gpu, args.schedules,
                                                                 args.inter_host)
        passed += checked
        failures += failed
    total = passed + len(failures)
    if failures:
        print(f"rank {world.rank}: FAILED {len(failures)}/{total}; first:\n{failures[0]}",
              flush=True)
    else:
        print(f"rank {world.rank}: OK {passed}/{total}", flush=True)
    failed = world.allreduce(len(failures), op=MPI.SUM)
    if args.json and world.rank == 0:
        results.update(command=" ".join(sys.argv), failed=failed)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"wrote {args.json}", flush=True)
    sys.exit(1 if failed else 0)


def check_batched_pairs(comm, counts):
    """Rings in either direction and each rank with its peer on the other host both ways,
    each batch in one hoccl.group(), on this rank's device: (passed, failures)."""
    n, r, local = comm.world_size, comm.rank, comm.describe()["local_size"]
    passed, failures = 0, []
    seed = 500
    for dtype in ("int32", "bfloat16"):
        arrays = array_module_for(comm.backend, dtype)
        for count in counts:
            if dtype == "bfloat16" and count > 1 << 20:
                continue  # the large case once, in int32
            for name, pairs in (("ring forward", [("send", (r + 1) % n), ("recv", (r - 1) % n)]),
                                ("ring backward", [("recv", (r + 1) % n), ("send", (r - 1) % n)]),
                                ("across both ways", [("recv", (r + local) % n),
                                                      ("send", (r + local) % n)])):
                seed += 1
                try:
                    outs = []
                    with hoccl.group():
                        for kind, peer in pairs:
                            if kind == "send":
                                data = random_array(np.random.default_rng([seed, r]), count, dtype)
                                comm.send(arrays.asarray(data, comm.device), peer)
                            else:
                                out = arrays.asarray(poison(count, dtype), comm.device)
                                outs.append((peer, out))
                                comm.recv(out, peer)
                    comm.synchronize()
                    for peer, out in outs:
                        want = random_array(np.random.default_rng([seed, peer]), count, dtype)
                        got = arrays.to_numpy(out, dtype)
                        same = got.view(np.uint8) == want.view(np.uint8)
                        assert same.all(), (f"{name} {dtype} x{count}: from rank {peer}, byte "
                                            f"{int(np.flatnonzero(~same)[0])} differs")
                    passed += 1
                except Exception:
                    failures.append(f"{name} {dtype} x{count}\n{traceback.format_exc()}")
    return passed, failures


def p2p_bandwidth(comm, on_gpu, sizes):
    """``hoccl.bench.mixed``'s sendrecv at ``sizes``, hoccl (this communicator) beside gloo
    on the same tensors: every record (the slowest rank's time, wrong elements summed)."""
    from hoccl.bench import mixed
    from hoccl.bench._harness import parse_size
    world = MPI.COMM_WORLD
    kinds = world.allgather("cuda" if on_gpu else "cpu")
    job = mixed.Job(mixed.arguments(["--devices", ",".join(kinds), "--local-size",
                                     str(comm.describe()["local_size"]), "--iters", "5",
                                     "--warmup", "1"]))
    gloo = job.gloo()
    records = []
    for text in sizes.split(","):
        for library, handle in (("hoccl", comm), ("gloo", gloo)):
            record = mixed.measure(job, library, handle, "sendrecv", parse_size(text),
                                   "float32")
            assert "error" not in record and record["wrong"] == 0, record
            records.append(record)
    return records


def check_pipelines(on_gpu, schedules, inter_host="mpi"):
    """torch.distributed.pipelining on the "hoccl" backend, a pipeline per local rank (one
    rank per host, so the stages alternate GPU and CPU), against the reference and gloo
    (``run_pipeline.check_schedule``): (passed, failures, results)."""
    world = MPI.COMM_WORLD
    os.environ.setdefault("MASTER_ADDR", world.bcast(socket.gethostname()))
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        os.environ["MASTER_PORT"] = str(world.bcast(port))
    os.environ["HOCCL_LOCAL_SIZE"] = "2"
    # the process groups' communicators: hoccl's cuda backend inside the GPU host, its host
    # backend inside the CPU host (a GPU is visible there too)
    os.environ["HOCCL_INTRA_HOST"] = "cuda" if on_gpu else "host"
    sys.path.insert(0, str(Path(__file__).parents[1] / "torch_programs"))
    import torch
    import torch.distributed as dist
    import common
    import run_pipeline
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    common.use_device(device)
    dist.init_process_group("hoccl", rank=world.rank, world_size=world.size,
                            pg_options=hoccl.torch.Options(inter_host=inter_host))
    rails = [[0, 2], [1, 3]]
    group, _ = dist.new_subgroups_by_enumeration(
        rails, backend="hoccl", pg_options=hoccl.torch.Options(inter_host=inter_host))
    gloo, _ = dist.new_subgroups_by_enumeration(rails, backend="gloo")
    exact = not any(world.allgather(on_gpu))
    passed, failures, results = 0, [], []
    for seed, name in enumerate(schedules.split(","), start=1):
        try:
            results.append(run_pipeline.check_schedule(name, group, gloo, device, seed,
                                                       exact=exact))
            passed += 1
        except Exception:
            failures.append(f"pipelining {name}\n{traceback.format_exc()}")
    dist.destroy_process_group()
    return passed, failures, results


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
