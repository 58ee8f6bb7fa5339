"""Collectives across (simulated) hosts under mpirun: hoccl inside each host, an engine
between hosts.  Run with, for example::

    HOCCL_LOCAL_SIZE=2 mpiexec -n 4 python tests/mpi/run_hierarchical.py --backend host
    mpirun -np 2 -x NCCL_P2P_DISABLE=1 -x NCCL_SHM_DISABLE=1 \\
        python tests/mpi/run_hierarchical.py --backend cuda --inter-host nccl --local-size 1

    HOCCL_LOCAL_SIZE=2 mpiexec -n 4 python tests/mpi/run_hierarchical.py --backend host \
        --inter-host mpi --torch-hosts 1     # host 1 runs a torch gloo group inside

Every rank draws the same inputs from the same seeds and checks its own output of each
collective (both forms, odd counts, several dtypes, ops and roots) against numpy bit for
bit (``hoccl.testing.check_collective`` with ``local_size``: reductions as every engine
across hosts computes them, ``hoccl.testing.hierarchical_reduced``), then send/recv
between every pair of ranks and a barrier.  ``--torch-hosts`` lists the hosts whose
ranks use a torch.distributed gloo group inside (``intra_host="torch"``, standing for a
vendor library), the others hoccl's backend; torch.distributed is then initialised
with gloo on every rank first.  ``--local-size`` (or ``HOCCL_LOCAL_SIZE``) groups
consecutive ranks into simulated hosts; a local size equal to the world size is one
host, which must give the plain single-host Communicator.  Rank 0 prints how the world
was split and ``N passed, M failed``; the exit status is non-zero when any rank failed.
"""

import argparse
import os
import sys
import traceback

import numpy as np

if "ucx" in sys.argv:  # ucxx's UCX libraries before MPI's own copy (hoccl._hierarchy.ucx)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx  # noqa: F401
from mpi4py import MPI  # noqa: E402

import hoccl
from hoccl.testing import IN_PLACE_FORMS, array_module_for, check_collective, poison, random_array

ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("reduce_scatter", "all_reduce", "reduce")


def roots(world_size, local_size):
    """The first rank, the last, and one on another host at another local rank."""
    return sorted({0, world_size - 1, min(world_size - 1, local_size + 1)})


def cases(world_size, local_size, dtypes, counts, ops):
    seed = 0
    for collective in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
                       "reduce", "gather", "scatter"):
        for dtype in dtypes:
            for count in counts:
                for in_place in ([False, True] if collective in IN_PLACE_FORMS else [False]):
                    for root in (roots(world_size, local_size) if collective in ROOTED else [0]):
                        for op in (ops if collective in REDUCING else ["sum"]):
                            seed += 1
                            yield dict(collective=collective, dtype=dtype, count=count,
                                       in_place=in_place, root=root, op=op, seed=seed)


def check_pairs(comm, seed):
    """Every ordered pair (sender, receiver), one after another: within a host, along a
    rail and across both."""
    arrays = array_module_for(comm.backend, "int32")
    n, r = comm.world_size, comm.rank
    for sender in range(n):
        for receiver in range(n):
            if sender == receiver or r not in (sender, receiver):
                continue
            rng = np.random.default_rng([seed, sender, receiver])
            data = random_array(rng, 37, "int32")
            if r == sender:
                comm.send(arrays.asarray(data, comm.device), receiver)
            else:
                out = arrays.asarray(poison(37, "int32"), comm.device)
                comm.recv(out, sender)
                comm.synchronize()
                got = arrays.to_numpy(out, "int32")
                assert np.array_equal(got, data), f"send {sender} -> {receiver}: got {got[:4]}"
    comm.synchronize()


def check_phases_agree(comm, seed):
    """all_reduce, broadcast, reduce (1000 elements, in chunks of 64 bytes), all_gather
    and reduce_scatter (a chunk per host), sequential and pipelined: the same bits on
    every rank."""
    if not isinstance(comm, hoccl.HierarchicalCommunicator):
        return
    before = comm.config
    n = comm.world_size
    for collective, dtype, op in (("all_reduce", "bfloat16", "avg"), ("all_reduce", "float32",
                                  "sum"), ("reduce", "float16", "sum"), ("broadcast", "int8", ""),
                                  ("all_gather", "int32", ""), ("reduce_scatter", "bfloat16",
                                                                "avg")):
        arrays = array_module_for(comm.backend, dtype)
        rng = np.random.default_rng([seed, comm.rank])
        data = random_array(rng, 1000 * n, dtype)
        results = []
        for phases in ("sequential", "pipelined"):
            comm.set_options(phases=phases, phase_bytes=64)
            out = arrays.asarray(poison(1000 * (n if collective == "all_gather" else 1),
                                        dtype), comm.device)
            send = arrays.asarray(data[:1000 * (n if collective == "reduce_scatter" else 1)],
                                  comm.device)
            if collective == "all_reduce":
                comm.all_reduce(send, out, op)
            elif collective == "all_gather":
                comm.all_gather(send, out)
            elif collective == "reduce_scatter":
                comm.reduce_scatter(send, out, op)
            elif collective == "reduce":
                comm.reduce(send, out, n - 1, op)
            else:
                comm.broadcast(send, out, n - 1)
            comm.synchronize()
            results.append(arrays.to_numpy(out, dtype).view(np.uint8))
        assert np.array_equal(results[0], results[1]), f"{collective}: pipelined differs"
    comm.set_options(phases=before.phases, phase_bytes=before.phase_bytes)


def check_barrier(comm):
    comm.barrier()
    comm.synchronize()


def init_torch_gloo(world):
    """torch.distributed on gloo over the same ranks (a file store rank 0 names)."""
    import tempfile
    import torch.distributed as dist
    path = world.bcast(tempfile.mktemp(prefix="hoccl-gloo-") if world.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=world.rank,
                            world_size=world.size)


def check_every_call(comm, local_size, dtypes, counts, ops, label=""):
    """Every collective case, send/recv between every pair, a barrier and the phases'
    agreement, each checked on this rank: (how many passed, a text per failure)."""
    passed, failures = 0, []
    checks = [(f"{label}{case}", lambda case=case: check_collective(
        [comm], arrays=array_module_for(comm.backend, case["dtype"]), local_size=local_size,
        **case)) for case in cases(comm.world_size, local_size, dtypes, counts, ops)]
    checks += [("send/recv", lambda: check_pairs(comm, 7)), ("barrier", lambda: check_barrier(comm)),
               ("phases", lambda: check_phases_agree(comm, 11))]
    for name, action in checks:
        try:
            action()
            passed += 1
        except Exception:
            failures.append(f"{name}\n{traceback.format_exc()}")
    return passed, failures


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--inter-host", default=None, choices=["nccl", "mpi", "gloo", "ucx", "hoccl"])
    parser.add_argument("--torch-hosts", default="",
                        help="hosts (comma-separated) whose ranks use a torch gloo group inside")
    parser.add_argument("--phases", default=None, choices=["auto", "pipelined", "sequential"])
    parser.add_argument("--phase-bytes", type=int, default=None)
    parser.add_argument("--local-size", type=int, default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16,int32,uint8")
    parser.add_argument("--counts", default="0,1,5,17,1000")
    parser.add_argument("--ops", default="sum,max,avg")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    local_size = args.local_size or int(os.environ.get("HOCCL_LOCAL_SIZE", 0)) or world.size
    torch_hosts = {int(h) for h in args.torch_hosts.split(",") if h}
    settings = {}
    if torch_hosts or args.inter_host == "gloo":
        init_torch_gloo(world)
    if torch_hosts:
        settings["intra_host"] = "torch" if world.rank // local_size in torch_hosts else None
    if args.phases:
        settings["phases"] = args.phases
    if args.phase_bytes:
        settings["phase_bytes"] = args.phase_bytes
    comm = hoccl.init(backend=args.backend, timeout=120, local_size=local_size,
                      inter_host=args.inter_host, **settings)
    across = local_size < world.size
    describe = comm.describe() if across else {"hosts": 1, "local_size": world.size,
                                               "inter_host": "none"}
    if world.rank == 0:
        print(f"world {world.size} ranks: {describe}", flush=True)
    passed = failed = 0
    if across != isinstance(comm, hoccl.HierarchicalCommunicator):
        failed += 1
        print(f"rank {world.rank} FAILED: local size {local_size} of {world.size} gave {comm!r}",
              flush=True)
    counts = [int(c) for c in args.counts.split(",")]
    checked, failures = check_every_call(comm, local_size, args.dtypes.split(","), counts,
                                         args.ops.split(","))
    passed += checked
    failed += len(failures)
    for failure in failures:
        print(f"rank {comm.rank} FAILED {failure}", flush=True)
    comm.close()
    if torch_hosts or args.inter_host == "gloo":
        import torch.distributed as dist
        dist.destroy_process_group()
    totals = world.allreduce(np.array([passed, failed]), op=MPI.SUM)
    if world.rank == 0:
        print(f"hierarchical ranks={world.size} hosts={describe['hosts']}x"
              f"{describe['local_size']} backend={comm.backend} "
              f"inter={describe['inter_host']}: {totals[0]} passed, {totals[1]} failed",
              flush=True)
    sys.exit(1 if totals[1] else 0)


if __name__ == "__main__":
    main()
