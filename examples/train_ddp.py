#!/usr/bin/env python3
"""DDP on hoccl, one script for every launcher:

  torchrun --standalone --nproc_per_node 2 examples/train_ddp.py
  mpiexec -n 2 python examples/train_ddp.py          # Open MPI, MPICH, Intel MPI
  srun -n 2 python examples/train_ddp.py             # SLURM
  ... --backend gloo                                 # the same training on gloo

``import hoccl.torch`` fills torch's rendezvous variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) from mpirun's or srun's where they are unset, so
``dist.init_process_group`` needs no arguments under any of them.  Trains a small MLP
on data drawn per rank and prints rank 0's loss each step, as a float and its exact hex
form (the tests compare runs bit for bit).
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist

import hoccl.torch  # noqa: F401  (the "hoccl" backend; rendezvous variables from mpirun/srun)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="hoccl", help="hoccl (default), gloo or nccl")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if args.backend == "nccl" or (args.backend == "hoccl" and torch.cuda.is_available()):
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # 2 buckets
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1000 + rank)
    if rank == 0:
        print(f"backend={args.backend} world_size={world_size} "
              f"launcher variables RANK={os.environ.get('RANK')} "
              f"LOCAL_RANK={os.environ.get('LOCAL_RANK')}", flush=True)
    for step in range(args.steps):
        inputs = torch.randn(8, 16, generator=generator).to(device)
        targets = inputs.sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f} {loss.item().hex()}", flush=True)
    # drop what holds the process group (DDP's reducer) before tearing it down, as
    # train_fsdp2.py does: a gloo group left to die while the interpreter exits can end
    # the process
    del ddp, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
