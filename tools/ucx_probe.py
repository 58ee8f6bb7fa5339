"""Two processes, one tag send each way over UCX (ucxx's low-level API), with a chosen
endpoint error-handling mode, transports and memory: which UCX setups move bytes between
two processes of this machine.  Run: mpirun -np 2 python tools/ucx_probe.py [options]

Prints one line on rank 0: the setup, and per size "ok <GB/s>" or "stuck" (not done
within --timeout seconds)."""
import argparse
import os
import sys
import time

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
import ucxx._lib.libucxx as api  # noqa: E402  (before MPI's own UCX)
from ucxx._lib.arr import Array  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--error-handling", type=int, default=0)
    parser.add_argument("--tls", default="^cma", help="the context's TLS ('' : UCX's own)")
    parser.add_argument("--pinned", default="", help="ranks whose buffers are CUDA pinned "
                        "host memory (torch pin_memory), e.g. 0 or 0,1")
    parser.add_argument("--cuda", default="", help="ranks that make a CUDA context first")
    parser.add_argument("--sizes", default="2,1048576,67108864")
    parser.add_argument("--timeout", type=float, default=8.0)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rank, peer = world.rank, 1 - world.rank
    cuda = str(rank) in args.cuda.split(",")
    pinned = str(rank) in args.pinned.split(",")
    if cuda or pinned:
        import torch
        torch.zeros(1, device="cuda")
    config = {"TLS": args.tls} if args.tls else {}
    context = api.UCXContext(config_dict=config, feature_flags=(api.Feature.TAG,))
    worker = api.UCXWorker(context)
    addresses = world.allgather(worker.address.tobytes())
    endpoint = api.UCXEndpoint.create_from_worker_address(
        worker, api.UCXAddress.create_from_buffer(addresses[peer]), bool(args.error_handling))
    results = []
    for sequence, size in enumerate(int(s) for s in args.sizes.split(",")):
        if pinned:
            import torch
            send = torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
            recv = torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
        else:
            send, recv = np.empty(size, np.uint8), np.empty(size, np.uint8)
        send[:] = rank + 1
        recv[:] = 0
        world.Barrier()
        start = time.perf_counter()
        requests = [endpoint.tag_recv(Array(recv), api.UCXXTag(peer << 20 | sequence)),
                    endpoint.tag_send(Array(send), api.UCXXTag(rank << 20 | sequence))]
        while not all(r.completed for r in requests):
            worker.progress()
            if time.perf_counter() - start > args.timeout:
                break
        took = time.perf_counter() - start
        done = all(r.completed for r in requests)
        if done:
            for r in requests:
                r.check_error()
        right = done and bool((recv == peer + 1).all())
        results.append(f"{size}: " + (f"ok {2 * size / took / 1e9:.2f} GB/s" if right else
                                      "wrong" if done else "stuck"))
        if not done:
            break
    everyone = world.gather(results)
    if rank == 0:
        info = context.info() if callable(context.info) else str(context.info)
        print(f"eh={args.error_handling} tls={args.tls or '(default)'} pinned={args.pinned} "
              f"cuda={args.cuda}: rank0 {everyone[0]} | rank1 {everyone[1]}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # a stuck request must not hold the process


if __name__ == "__main__":
    sys.exit(main())
