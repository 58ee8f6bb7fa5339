"""What a chunk of the staged engine costs on this machine, part by part.

  mpirun -np 2 python tools/stage_probe.py --devices cuda,cpu --sizes 1M,4M,16M,64M

Two ranks, each on its own device (``--devices``): for each size, the MPI exchange of
that many bytes between them (Irecv/Isend both ways, the transport's step) from
pageable numpy memory and from page-locked memory (torch's ``pin_memory``), and on a
rank on the GPU, the copy of that many bytes device-to-host and host-to-device into
the page-locked memory (torch ``copy_``, copy engines).  Prints GB/s per part (the
slower rank's time, best of ``--iters``); the staged engine's chunk costs roughly the
sum of the parts that do not overlap.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="cpu,cpu", help="each rank's device, cuda or cpu")
    parser.add_argument("--sizes", default="1M,4M,16M,64M")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--shared", action="store_true",
                        help="also time MPI shared-memory windows: the peer's segment copied "
                             "out, and (on a GPU rank) device-to-host into the registered segment")
    parser.add_argument("--cma", action="store_true",
                        help="also time a cross-memory read (process_vm_readv) of the peer's "
                             "pageable memory, its torch-pinned memory and its page-locked "
                             "ordinary pages (cuMemHostRegister), as the staged engine's "
                             "CmaTransport reads a GPU member's slots")
    args = parser.parse_args()
    from mpi4py import MPI
    import torch
    world = MPI.COMM_WORLD
    rank, peer = world.rank, 1 - world.rank
    kind = args.devices.split(",")[rank]
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

    def slowest(seconds: float) -> float:
        return world.allreduce(seconds, op=MPI.MAX)

    def best(run) -> float:
        times = []
        for _ in range(args.iters):
            world.Barrier()
            start = time.perf_counter()
            run()
            times.append(slowest(time.perf_counter() - start))
        return min(times)

    rows = []
    for text in args.sizes.split(","):
        nbytes = int(text[:-1]) * scale[text[-1]]
        pageable = (np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8))
        pinned = tuple(torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                       for _ in range(2))

        def exchange(send, recv):
            def run():
                MPI.Request.Waitall([world.Irecv(recv, source=peer), world.Isend(send, dest=peer)])
            return run
        row = {"bytes": text,
               "mpi pageable": best(exchange(*pageable)),
               "mpi pinned": best(exchange(pinned[0].numpy(), pinned[1].numpy()))}
        if args.shared:
            node = world.Split_type(MPI.COMM_TYPE_SHARED)
            window = MPI.Win.Allocate_shared(nbytes, 1, comm=node)
            segment = np.frombuffer(window.tomemory(), np.uint8)
            theirs = np.frombuffer(window.Shared_query(node.rank ^ 1)[0], np.uint8)
            segment[:] = 1
            row["shm copy-out"] = best(lambda: np.copyto(pageable[1], theirs))
        if kind == "cuda":
            device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            if args.shared:
                shared = torch.from_numpy(segment)
                status = torch.cuda.cudart().cudaHostRegister(shared.data_ptr(), nbytes, 0)
                if int(status) != 0:
                    print(f"rank {rank}: cudaHostRegister of the window: {status}", flush=True)

                def d2h_shared():
                    shared.copy_(device, non_blocking=True)
                    torch.cuda.synchronize()
                row["d2h shm"] = best(d2h_shared)

            def d2h():
                pinned[1].copy_(device, non_blocking=True)
                torch.cuda.synchronize()

            def h2d():
                device.copy_(pinned[0], non_blocking=True)
                torch.cuda.synchronize()
            row["d2h"], row["h2d"] = best(d2h), best(h2d)
        else:
            row["d2h"] = row["h2d"] = None
            best(lambda: None), best(lambda: None)  # the peer's collective calls
            if args.shared:
                row["d2h shm"] = None
                best(lambda: None)
        if args.shared:
            if kind == "cuda":
                torch.cuda.cudart().cudaHostUnregister(shared.data_ptr())
            window.Free()
            node.Free()
        if args.cma:
            row.update(_cma_reads(world, rank, peer, kind, nbytes, best))
        rows.append((nbytes, row))
    if rank == 0:
        print(f"{'bytes':>6s} " + " ".join(f"{name:>14s}" for name in rows[0][1] if name != "bytes"))
        for nbytes, row in rows:
            cells = [f"{nbytes / seconds / 1e9:10.2f} GB/s" if seconds else f"{'-':>14s}"
                     for name, seconds in row.items() if name != "bytes"]
            print(f"{row['bytes']:>6s} " + " ".join(cells), flush=True)


def _cma_reads(world, rank, peer, kind, nbytes, best):
    """The CPU rank reads each of the GPU rank's three kinds of host memory (on two CPU
    ranks, rank 0's); a read that fails is reported, and timed as None."""
    import mmap
    import os
    import numpy as np
    import torch
    from hoccl._errors import HocclError
    from hoccl.backends._cross_memory import RemotePtr, move
    kinds = world.allgather(kind)  # every rank calls it
    owner = rank if kind == "cuda" else (peer if "cuda" in kinds else 0)
    forms = {"pageable": lambda: np.full(nbytes, 7, np.uint8)}
    if torch.cuda.is_available():
        forms["torch-pinned"] = lambda: torch.full((nbytes,), 7, dtype=torch.uint8,
                                                   pin_memory=True).numpy()

        def registered():
            memory = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
            torch.cuda.cudart().cudaHostRegister(memory.ctypes.data, nbytes, 1)
            memory[:] = 7
            return memory
        forms["registered"] = registered
    names = world.bcast(list(forms), root=owner)
    cells = {}
    for name in names:
        memory = forms[name]() if rank == owner else None
        where = world.bcast((os.getpid(), memory.ctypes.data) if rank == owner else None,
                            root=owner)
        into = np.zeros(nbytes, np.uint8)
        error = ""
        if rank != owner:
            try:
                move(into.ctypes.data, RemotePtr(*where), nbytes)
                error = "" if int(into.min()) == 7 == int(into.max()) else "wrong bytes"
            except HocclError as failed:
                error = str(failed)[:120]
        error = world.bcast(error, root=1 - owner)
        if error:
            if rank == 0:
                print(f"cma read of {name} memory: {error}", flush=True)
            cells[f"cma {name}"] = None
            world.Barrier()
        else:
            cells[f"cma {name}"] = best(
                (lambda: move(into.ctypes.data, RemotePtr(*where), nbytes))
                if rank != owner else (lambda: None))
        world.Barrier()
    return cells


if __name__ == "__main__":
    main()
