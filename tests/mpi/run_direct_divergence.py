"""Under mpirun (2 ranks): direct-kernel calls that go without a message, and ranks whose
calls then differ.  ``python run_direct_divergence.py SCENARIO [--backend B]``.

silent     after the first direct call (which learns the peers' rings), 50 more direct
           calls of every kind send no message to the peer (counted at the mailboxes),
           every output exact
count      then rank 0 calls all_reduce of 1000 elements, rank 1 of 1001: each rank's
           kernel finds the other's signature beside its own; both ranks raise
           DivergedError naming the call, their outputs not written (still poisoned)
blocks     the same with counts whose kernels differ in blocks (1000 and 200000): no
           rank waits for a block its peer does not have
collective rank 0 calls all_gather, rank 1 all_reduce, of the same bytes
late       (host only) the same, with rank 1's kernel slow to look at its wait (half a
           second, as on a loaded machine): rank 0 finds the divergence and aborts first,
           and its abort's value releases rank 1's wait before rank 1 has seen rank 0's
           signature; rank 1 learns why from rank 0's abort and raises DivergedError too
           (not a bare AbortedError)
repeat     40 calls alternating between an all_reduce and an all_gather on the same
           arrays, fresh values each time, every output exact: the repeats find their
           prepared calls (``hoccl._engine.prepared``); then rank 0 repeats the all_reduce
           while rank 1 calls one of another count: both raise DivergedError
replay     (cuda only) both ranks capture two CUDA graphs, an all_reduce of 1000 elements
           and one of 1001; rank 0 replays the first, rank 1 the second: the replayed
           kernels see each other's signatures, and both ranks raise DivergedError naming
           a replay, their outputs unwritten
Each rank prints ``rank R: OK <what happened>`` or ``rank R: FAILED ...``.
"""

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import array_module_for, poison

KERNEL_BYTES = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=["silent", "count", "blocks", "collective", "late",
                                             "repeat", "replay"])
    parser.add_argument("--backend", default=None)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = hoccl.init(backend=args.backend, timeout=30, kernel_bytes=KERNEL_BYTES)
    if args.scenario == "late" and comm.backend != "host":
        parser.error("late slows the host backend's kernel emulation; it runs on the host "
                     "backend only (--backend host)")
    arrays = array_module_for(comm.backend, "float32")
    n, r = comm.world_size, comm.rank
    sent = [0]
    original_send = comm._group.mailboxes.send

    def counting_send(*send_args, **kwargs):
        sent[0] += 1
        return original_send(*send_args, **kwargs)
    comm._group.mailboxes.send = counting_send

    def numbers(count, seed):
        return np.random.default_rng(seed).standard_normal(count).astype(np.float32)

    ok = False
    try:
        # the first call learns the peer's ring; later direct calls go without a message
        total = arrays.asarray(numbers(256, r), comm.device)
        comm.all_reduce(total, total)
        comm.synchronize()
        before = sent[0]
        wrong = 0
        for index in range(50):
            count = 10 + 37 * index
            mine = numbers(count, 1000 * index + r)
            if index % 3 == 0:
                out = arrays.asarray(poison(count * n, "float32"), comm.device)
                comm.all_gather(arrays.asarray(mine, comm.device), out)
                expected = np.concatenate([numbers(count, 1000 * index + peer)
                                           for peer in range(n)])
            elif index % 3 == 1:
                out = arrays.asarray(poison(count, "float32"), comm.device)
                comm.all_reduce(arrays.asarray(mine, comm.device), out, "max")
                expected = np.maximum.reduce([numbers(count, 1000 * index + peer)
                                              for peer in range(n)])
            else:
                out = arrays.asarray(poison(count, "float32"), comm.device)
                comm.broadcast(arrays.asarray(mine, comm.device), out, root=index % n)
                expected = numbers(count, 1000 * index + index % n)
            comm.synchronize()
            got = arrays.to_numpy(out, "float32")
            wrong += int(not np.array_equal(got.view(np.uint32), expected.view(np.uint32)))
        silent = sent[0] - before
        # calls that found their prepared call, or replayed it
        reused = comm._engine.preparer.reused + comm._engine.replayed
        if args.scenario == "repeat":
            total = arrays.asarray(poison(1000, "float32"), comm.device)
            full = arrays.asarray(poison(640 * n, "float32"), comm.device)
            own = full[r * 640:(r + 1) * 640]
            for index in range(40):
                if index % 2 == 0:
                    arrays.fill(total, numbers(1000, 7 * index + r))
                    comm.all_reduce(total, total)
                    expected = sum(numbers(1000, 7 * index + peer).astype(np.float64)
                                   for peer in range(n)).astype(np.float32)
                    comm.synchronize()
                    got = arrays.to_numpy(total, "float32")
                    wrong += int(not np.allclose(got, expected, rtol=1e-5, atol=1e-5))
                else:
                    arrays.fill(own, numbers(640, 7 * index + r))
                    comm.all_gather(own, full)
                    comm.synchronize()
                    expected = np.concatenate([numbers(640, 7 * index + peer)
                                               for peer in range(n)])
                    got = arrays.to_numpy(full, "float32")
                    wrong += int(not np.array_equal(got.view(np.uint32), expected.view(np.uint32)))
            repeats = comm._engine.preparer.reused + comm._engine.replayed - reused
            if wrong or repeats < 36:
                print(f"rank {r}: FAILED 40 calls on the same arrays: {wrong} wrong, "
                      f"{repeats} repeats", flush=True)
                raise SystemExit
            print(f"rank {r}: 40 calls on the same arrays: 0 wrong, {repeats} repeats",
                  flush=True)
        if args.scenario == "silent":
            ok = wrong == 0 and silent == 0 and comm._engine.issued_fast >= 50
            print(f"rank {r}: {'OK' if ok else 'FAILED'} 50 direct calls, {wrong} wrong, "
                  f"{silent} messages sent, {comm._engine.issued_fast} issued without asking",
                  flush=True)
        else:
            world.Barrier()
            if args.scenario == "replay":  # graphs of other counts replayed on the ranks
                import torch
                device = torch.device("cuda", comm.device)
                tensors = [torch.zeros(count, device=device) for count in (1000, 1001)]
                for tensor in tensors:  # the kernels loaded, the rings known
                    comm.all_reduce(tensor, tensor)
                comm.synchronize()
                capture = torch.cuda.Stream(device=device)
                graphs = [torch.cuda.CUDAGraph() for _ in tensors]
                for graph, tensor in zip(graphs, tensors):
                    with torch.cuda.graph(graph, stream=capture):
                        comm.all_reduce(tensor, tensor)
                world.Barrier()
                count = (1000, 1001)[r]
                out = tensors[r]
                out.copy_(torch.from_numpy(numbers(count, r)))
                graphs[r].replay()
                torch.cuda.synchronize(device)
            elif args.scenario == "repeat":  # rank 0 repeats, rank 1 calls another count
                if r == 0:
                    count, out = 1000, total
                    arrays.fill(total, numbers(1000, r))
                    comm.all_reduce(total, total)
                else:
                    count = 1001
                    send = arrays.asarray(numbers(count, r), comm.device)
                    out = arrays.asarray(poison(count, "float32"), comm.device)
                    comm.all_reduce(send, out)
            elif args.scenario == "count":
                count = 1000 + r
                send = arrays.asarray(numbers(count, r), comm.device)
                out = arrays.asarray(poison(count, "float32"), comm.device)
                comm.all_reduce(send, out)
            elif args.scenario == "blocks":
                count = (1000, 200000)[r]
                send = arrays.asarray(numbers(count, r), comm.device)
                out = arrays.asarray(poison(count, "float32"), comm.device)
                comm.all_reduce(send, out)
            else:  # rank 0 all_gather, rank 1 all_reduce: 2000 floats of output each
                count = 2000
                out = arrays.asarray(poison(count, "float32"), comm.device)
                if r == 0:
                    comm.all_gather(arrays.asarray(numbers(count // n, r), comm.device), out)
                else:
                    if args.scenario == "late":
                        device = comm.device_handle
                        poll = device._poll

                        def slow_poll(stream, ready):
                            time.sleep(0.5)
                            poll(stream, ready)
                        device._poll = slow_poll
                    comm.all_reduce(arrays.asarray(numbers(count, r), comm.device), out)
            started = time.monotonic()
            try:
                comm.synchronize()
                print(f"rank {r}: FAILED synchronize returned", flush=True)
            except hoccl.DivergedError as error:
                waited = time.monotonic() - started
                text = str(error)
                before = (numbers(1000, 0) if args.scenario == "repeat" and r == 0
                          else numbers(count, r) if args.scenario == "replay"
                          else poison(count, "float32"))
                got = (out.cpu().numpy() if args.scenario == "replay"
                       else arrays.to_numpy(out, "float32"))
                untouched = np.array_equal(got.view(np.uint32), before.view(np.uint32))
                ok = (text.startswith("synchronize:") and "direct kernel" in text
                      and untouched and comm.aborted and waited < 20
                      and ("replayed from a CUDA graph" in text) == (args.scenario == "replay"))
                print(f"rank {r}: {'OK' if ok else 'FAILED'} DivergedError after "
                      f"{waited:.2f} s, output untouched: {untouched}: {text}", flush=True)
            # the communicator is aborted: the next call says so
            try:
                comm.barrier()
                ok = False
                print(f"rank {r}: FAILED a call after the divergence went on", flush=True)
            except hoccl.AbortedError:
                pass
    except Exception as error:  # report, then fail
        print(f"rank {r}: FAILED unexpected {type(error).__name__}: {error}", flush=True)
    sys.stdout.flush()
    world.Barrier()
    # every rank is here, so MPI can finalize (without it OpenMPI's mpirun counts the exit
    # as improper and exits non-zero whatever the scenario said); then leave at once,
    # without the interpreter's teardown of an aborted communicator
    MPI.Finalize()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
