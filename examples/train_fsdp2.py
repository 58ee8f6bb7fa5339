#!/usr/bin/env python3
"""Train a Llama-style decoder with FSDP2 in bf16 on NCCL, hoccl or gloo: the training
code is the same, only the backend name changes.

  torchrun --nproc-per-node 2 examples/train_fsdp2.py --backend hoccl     # GPUs
  mpirun -np 2 python examples/train_fsdp2.py --backend nccl               # same, mpirun
  mpiexec -n 2 python examples/train_fsdp2.py --backend hoccl --tiny       # CPU, host backend

The model (RMSNorm, rotary causal attention through SDPA, SwiGLU MLP) is the one of
``python -m hoccl.bench.train``.  Every rank starts from the same weights and trains on
its own batches (token sequences that follow a fixed rule, with noise, so the loss
falls); rank 0 prints the loss of every step (the mean over ranks), so two runs with
different backends can be compared line by line.  ``--hooks`` keeps the
backend for the process group and sends only FSDP2's all-gathers and reduce-scatters
through hoccl (``hoccl.torch.use_for_fsdp``).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import sys

try:
    import torch
    import torch.distributed as dist
except ImportError:
    sys.exit("train_fsdp2.py needs PyTorch: pip install 'hoccl[torch]'")

from hoccl.bench.train import ModelShape, batch, init_distributed, optimizer_for, shard, train_step


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("nccl", "hoccl", "gloo"), default=None,
                        help="default: nccl with GPUs, gloo without")
    parser.add_argument("--hooks", action="store_true",
                        help="FSDP2's all-gather and reduce-scatter through hoccl, the rest of "
                             "the process group on --backend")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW's learning rate")
    parser.add_argument("--tiny", action="store_true", help="a model small enough for CPUs")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dump-stacks-after", type=float, default=0, metavar="SECONDS",
                        help="if the run has not ended after SECONDS, print every thread's "
                             "stack and exit (to see where a stuck run waits)")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    if args.dump_stacks_after:
        faulthandler.dump_traceback_later(args.dump_stacks_after, exit=True)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size, device = init_distributed(backend)
    shape = (ModelShape(dim=64, layers=2, heads=4, seq=32, batch=2, vocab=256) if args.tiny
             else ModelShape(args.dim, args.layers, args.heads, args.seq, args.batch))
    model = shard(shape, None, device)
    hooks = None
    if args.hooks:
        import hoccl.torch
        group = dist.new_group(backend="hoccl")
        hooks = hoccl.torch.use_for_fsdp(model, group)
    optimizer = optimizer_for(model, device, args.lr)
    if rank == 0:
        print(f"{backend}{' + hoccl hooks' if args.hooks else ''}, {world_size} ranks, {device}, "
              f"{shape.parameters() / 1e6:.1f} M parameters", flush=True)
    for step in range(args.steps):
        tokens, targets = batch(shape, step, rank, device)
        loss = train_step(model, optimizer, tokens, targets)
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        if rank == 0:
            print(f"step {step} loss {loss.item() / world_size:.6f}", flush=True)
    if hooks is not None and rank == 0:
        print(f"through hoccl without a descriptor exchange: {hooks.all_gather.without_exchange} "
              f"of {hooks.all_gather.calls} all-gathers (registered memory), "
              f"{hooks.reduce_scatter.without_exchange} of {hooks.reduce_scatter.calls} "
              f"reduce-scatters", flush=True)
    # drop what holds the process groups (the sharded model's mesh, the optimizer's
    # state) before tearing them down: a gloo group left to die while the interpreter
    # exits can end the process with "terminate called without an active exception"
    # (2 of 30 runs on 2 loaded cores; none of 30 this way)
    del model, optimizer, hooks
    gc.collect()
    # every rank done with the process groups before any tears its own down (a rank that
    # closes its gloo pairs while a peer is still in its last collective can make the
    # peer's gloo threads end the process)
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
