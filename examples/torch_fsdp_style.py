#!/usr/bin/env python3
"""Sharded-parameter training (FSDP style) with hoccl collectives, checked against one device.

  mpirun -np 2 python examples/torch_fsdp_style.py          # one process per GPU (hoccl.init)
  python examples/torch_fsdp_style.py --local 2             # one process drives 2 GPUs
  python examples/torch_fsdp_style.py --backend host        # no GPU: CPU tensors, 4 ranks

Every rank holds the model's parameters in one flat buffer ``full`` and owns one
block of it, its shard (the optimizer touches only the shard).  Each step:

1. all_gather, in place: every rank's shard is its block of ``full``, so
   ``comm.all_gather(full[shard_range], full)`` fills the other blocks and copies
   nothing for the own block (zero SMs on GPUs);
2. forward and backward on the compute stream, parameters being views of ``full``;
3. reduce_scatter, in place: the flat gradient buffer is averaged over ranks and this
   rank's block of it receives its shard of the result (``op="avg"``);
4. SGD on the shard only.

Communication runs on a side stream that is ordered with the compute stream by
``wait_stream`` in both directions, as any torch code does with a second stream;
hoccl's calls are ordered on the stream they are given (``stream=``) and return
without waiting.  The loss is averaged over ranks with ``all_reduce`` on the compute
stream (``stream=None``: torch's current stream) and compared, step by step, with
the same model trained on the whole global batch on one device.

The per-rank work is split into phases, each a loop over this process's ranks.
Under mpirun that loop has one element.  In one process (``--local``) every rank
makes each collective call before any rank waits for it, which is the one rule of
driving several ranks from one thread.
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import torch
except ImportError:
    sys.exit("torch_fsdp_style.py needs PyTorch: pip install torch (a CPU build is enough for "
             "--backend host)")

import hoccl
from hoccl.backends import cuda_device_count

FEATURES, HIDDEN = 32, 64
LOCAL_BATCH = 16


def make_model() -> torch.nn.Module:
    # 6337 parameters: not a multiple of the rank count, so the flat buffer is padded
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, 1))


def global_batch(step: int, world_size: int):
    """The same global batch on every rank; rank r trains on rows [r*B, (r+1)*B)."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world_size * LOCAL_BATCH, FEATURES, generator=generator)
    y = torch.tanh(x[:, :4].sum(dim=1, keepdim=True) / 2)
    return x, y


class Rank:
    """One rank's model, flat buffers and streams."""

    def __init__(self, comm: hoccl.Communicator, template: torch.nn.Module, lr: float,
                 steps: int):
        self.comm, self.lr = comm, lr
        n, r = comm.world_size, comm.rank
        self.device = torch.device("cpu" if comm.backend == "host" else f"cuda:{comm.device}")
        params = list(template.parameters())
        self.numel = sum(p.numel() for p in params)
        self.shard_size = -(-self.numel // n)
        self.shard_range = slice(r * self.shard_size, (r + 1) * self.shard_size)

        # full: the gathered parameters; only the shard is this rank's to keep
        self.full = torch.full((self.shard_size * n,), float("nan"), device=self.device)
        flat = torch.cat([p.detach().reshape(-1) for p in params]).to(self.device)
        padded = torch.zeros(self.shard_size * n, device=self.device)
        padded[:self.numel] = flat
        self.full[self.shard_range] = padded[self.shard_range]  # the rest is NaN until gathered
        self.grads = torch.zeros_like(self.full)                 # padding stays 0
        self.losses = torch.zeros(steps, device=self.device)

        # the model: the template's structure, every parameter a view of ``full``
        self.model = make_model().to(self.device)
        offset = 0
        for module in self.model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                view = self.full[offset:offset + param.numel()].view_as(param)
                setattr(module, name, torch.nn.Parameter(view))  # shares the memory of ``full``
                offset += param.numel()
        self.params = list(self.model.parameters())

        if self.device.type == "cuda":
            self.compute = torch.cuda.current_stream(self.device)
            self.side = torch.cuda.Stream(self.device)
        else:
            self.compute = self.side = None  # the host backend runs on its own host streams

    # -- ordering between the compute stream and the side stream ---------------------------
    def side_waits_for_compute(self) -> None:
        if self.side is not None:
            self.side.wait_stream(self.compute)

    def compute_waits_for_side(self) -> None:
        if self.side is not None:
            self.compute.wait_stream(self.side)
        else:
            # torch CPU ops run at once, so wait on the host for hoccl's host streams
            self.comm.synchronize()

    # -- the phases of a step ----------------------------------------------------------
    def gather_parameters(self) -> None:
        self.side_waits_for_compute()  # the optimizer's update of the shard is done first
        self.comm.all_gather(self.full[self.shard_range], self.full, stream=self.side)

    def forward_backward(self, step: int) -> None:
        self.compute_waits_for_side()
        x, y = global_batch(step, self.comm.world_size)
        rows = slice(self.comm.rank * LOCAL_BATCH, (self.comm.rank + 1) * LOCAL_BATCH)
        x, y = x[rows].to(self.device), y[rows].to(self.device)
        for p in self.params:
            p.grad = None
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        torch.cat([p.grad.reshape(-1) for p in self.params], out=self.grads[:self.numel])
        self.losses[step] = loss.detach()

    def reduce_gradients(self) -> None:
        self.side_waits_for_compute()
        self.comm.reduce_scatter(self.grads, self.grads[self.shard_range], "avg",
                                 stream=self.side)

    def optimizer_step(self, step: int) -> None:
        self.compute_waits_for_side()
        with torch.no_grad():
            self.full[self.shard_range].add_(self.grads[self.shard_range], alpha=-self.lr)
        loss = self.losses[step:step + 1]
        self.comm.all_reduce(loss, loss, "avg", stream=self.compute)  # None on the host backend

    def finish(self) -> list:
        self.comm.synchronize()
        if self.side is not None:
            torch.cuda.synchronize(self.device)
        return self.losses.tolist()


def reference_losses(template: torch.nn.Module, world_size: int, steps: int, lr: float,
                     device: torch.device) -> list:
    """The same training on one device over the whole global batch."""
    model = make_model().to(device)
    model.load_state_dict(template.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, world_size)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local", type=int, default=0, metavar="N",
                        help="N ranks in this one process (init_local); default: one rank per "
                             "mpirun process when launched by mpirun, else every GPU (at most "
                             "4) or 4 host ranks")
    parser.add_argument("--backend", choices=("cuda", "host"), default=None,
                        help="default: cuda when a GPU is visible")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.2)
    return parser.parse_args(argv)


def launched_by_mpirun() -> bool:
    """Open MPI, MPICH (Hydra) and PMIx launchers set one of these in every rank."""
    return any(name in os.environ for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def main(argv=None) -> int:
    args = arguments(argv)
    torch.manual_seed(0)
    template = make_model()  # the same initial parameters on every rank
    if launched_by_mpirun() and not args.local:
        from mpi4py import MPI
        comms = [hoccl.init(backend=args.backend)]
        world = MPI.COMM_WORLD
    else:
        gpus = cuda_device_count()
        backend = args.backend or ("cuda" if gpus else "host")
        ranks = args.local or (min(4, gpus) if backend == "cuda" else 4)
        comms = hoccl.init_local(list(range(ranks)) if backend == "cuda" else ranks,
                                 backend=backend)
        world = None
    leader = world is None or world.rank == 0
    if comms[0].backend == "cuda":
        torch.cuda.set_device(comms[0].device)

    reference = None
    if leader:
        reference = reference_losses(template, comms[0].world_size, args.steps, args.lr,
                                     torch.device("cpu") if comms[0].backend == "host"
                                     else torch.device(f"cuda:{comms[0].device}"))

    ranks = [Rank(comm, template, args.lr, args.steps) for comm in comms]
    for step in range(args.steps):
        for rank in ranks:
            rank.gather_parameters()
        for rank in ranks:
            rank.forward_backward(step)
        for rank in ranks:
            rank.reduce_gradients()
        for rank in ranks:
            rank.optimizer_step(step)
    losses = [rank.finish() for rank in ranks]
    for comm in comms:
        comm.close()

    if not leader:
        return 0
    n = comms[0].world_size
    print(f"hoccl FSDP-style training: {n} ranks, backend {comms[0].backend}, "
          f"{ranks[0].numel} parameters in shards of {ranks[0].shard_size}")
    print(f"{'step':>4}  {'loss (hoccl, mean of ranks)':>28}  {'loss (one device)':>18}  "
          f"{'relative difference':>20}")
    worst = 0.0
    for step, (mine, theirs) in enumerate(zip(losses[0], reference)):
        difference = abs(mine - theirs) / max(abs(theirs), 1e-12)
        worst = max(worst, difference)
        print(f"{step:>4}  {mine:>28.7f}  {theirs:>18.7f}  {difference:>20.2e}")
    agree = all(run == losses[0] for run in losses)  # every local rank saw the same mean
    ok = worst < 1e-4 and agree
    print("losses match the single-device run" if ok else
          f"MISMATCH: worst relative difference {worst:.2e}, ranks agree: {agree}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
