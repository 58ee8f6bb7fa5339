"""``dist.shrink_group`` on the hoccl backend (host), one worker of a job started through
torch's env:// rendezvous on a store no worker hosts (torchrun's agent store:
``TORCHELASTIC_USE_AGENT_STORE=True``): ``python run_shrink.py --victims R[,R2] --how
exit|kill [--abort] [--subgroup] --stamps DIR``, with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set; ``--device cuda``: hoccl's cuda backend, tensors and models on the
rank's GPU (every rank on ``cuda:LOCAL_RANK % devices``; ranks may share one).

After three exact all_reduces, the first victim goes: ``exit`` between two calls
(os._exit), or ``kill``: SIGKILL while a 32 MiB all_reduce of every rank is in flight.
The others' next call raises; they call ``dist.shrink_group([victim])`` (SHRINK_ABORT
with ``--abort``) on the default group, or on a group of every rank (``--subgroup``),
then check 20 all_reduces against numpy (fresh random data, outputs poisoned first),
and three SGD steps of DDP and of FSDP2 (``fully_shard`` on a mesh of the shrunk group)
against the same steps taken in this process alone: each step's loss and the final
parameters (float64).  Under ``HOCCL_LOCAL_SIZE`` the group spans simulated hosts.  A
second victim (a rank of the original job) then exits, and the survivors shrink the
shrunk group again and check it again.  A victim writes the time it goes into
``DIR/victim-R``; each survivor prints ``rank R: OK detect D s shrink S s first T s ...``
per failure (seconds from the victim's going to the error, to shrink_group's return, and
to the first exact all_reduce), or ``rank R: FAILED ...``.
"""

import argparse
import os
import signal
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import hoccl
import hoccl.torch

BIG = 8 << 20  # int32 elements: 32 MiB
STEPS = 3  # SGD steps of DDP and of FSDP2 on a shrunk group
DEVICE = torch.device("cpu")  # where tensors and models live (``--device``)


def exact_all_reduce(group, seed):
    """An all_reduce of fresh random int64 data on ``group``, checked; True if exact."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    draw = [torch.randint(-1 << 40, 1 << 40, (3001,), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(seed * 1000 + peer))
            for peer in range(size)]
    tensor = draw[rank].clone().to(DEVICE)
    dist.all_reduce(tensor, group=group)
    return bool(torch.equal(tensor.cpu(), sum(draw)))


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 3)).double()


def batch(seed, peer):
    generator = torch.Generator().manual_seed(seed * 100 + peer)
    return (torch.randn(6, 13, generator=generator, dtype=torch.float64),
            torch.randn(6, 3, generator=generator, dtype=torch.float64))


def loss_of(model, inputs, targets):
    return (model(inputs) - targets).pow(2).mean()


def reference(seed, size):
    """The steps every configuration takes, in this process alone: SGD on the mean of the
    ranks' losses (DDP and FSDP2 average the ranks' gradients); each step's loss per rank
    and the final parameters."""
    model = make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        each = [loss_of(model, *batch(seed + step, peer)) for peer in range(size)]
        (sum(each) / size).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in each])
    return losses, [p.detach().clone() for p in model.parameters()]


def training_is_right(group, seed):
    """DDP and FSDP2 (``fully_shard`` on a mesh of ``group``) take STEPS SGD steps on
    ``group``: each step's loss and the final parameters equal ``reference``'s (float64;
    the sums differ from the reference's only in their order).  The names of the
    configurations that differ."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    want_losses, want_parameters = reference(seed, size)
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(seed).to(DEVICE),
                                                    process_group=group)
    sharded = make_model(seed).to(DEVICE)
    mesh = DeviceMesh.from_group(group, DEVICE.type)
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    wrong = []
    for name, model in (("DDP", ddp), ("FSDP2", sharded)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(STEPS):
            loss = loss_of(model, *(t.to(DEVICE) for t in batch(seed + step, rank)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        parameters = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
                      for p in model.parameters()]
        close = all(abs(got - want[rank]) <= 1e-12 * max(1.0, abs(want[rank]))
                    for got, want in zip(losses, want_losses))
        close = close and all(torch.allclose(got, want, rtol=1e-12, atol=1e-14)
                              for got, want in zip(parameters, want_parameters))
        if not close:
            wrong.append(name)
    return wrong


def go(how, group, stamps, rank):
    stamp = Path(stamps) / f"victim-{rank}"
    if how == "kill":
        big = torch.ones(BIG, dtype=torch.int32, device=DEVICE)
        dist.all_reduce(big, group=group, async_op=True)  # in flight when the process dies
        time.sleep(0.05)
        stamp.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    stamp.write_text(repr(time.time()))
    os._exit(3)


def survive(how, group, stamps, victim, named, flags, seed):
    """The victim's loss seen from a survivor; (shrunk group, report)."""
    error = None
    try:
        if how == "kill":
            big = torch.ones(BIG, dtype=torch.int32, device=DEVICE)
            dist.all_reduce(big, group=group)
        for index in range(100):  # the victim goes between two of these
            exact_all_reduce(group, seed + index)
    except Exception as caught:  # torch wraps nothing: hoccl's error itself
        error = caught
    detected = time.time()
    if not isinstance(error, (hoccl.PeerDeadError, hoccl.AbortedError)):
        return None, f"FAILED expected the loss to raise; got {error!r}"
    shrunk_group = dist.shrink_group([victim], group=group, shrink_flags=flags)
    shrunk = time.time()
    first, wrong = None, 0
    for index in range(20):
        good = exact_all_reduce(shrunk_group, seed + 500 + index)
        wrong += not good
        if good and first is None:
            first = time.time()
    training = training_is_right(shrunk_group, seed)
    went = float((Path(stamps) / f"victim-{named}").read_text())
    if wrong or first is None or training:
        return shrunk_group, (f"FAILED {wrong} of 20 all_reduces wrong on the shrunk group; "
                              f"training differs from the reference: {training}")
    return shrunk_group, (f"OK detect {detected - went:.3f} s shrink {shrunk - went:.3f} s "
                          f"first {first - went:.3f} s ({type(error).__name__}; rank "
                          f"{dist.get_rank(shrunk_group)} of "
                          f"{dist.get_world_size(shrunk_group)})")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--victims", required=True)
    parser.add_argument("--how", choices=["exit", "kill"], default="exit")
    parser.add_argument("--abort", action="store_true")
    parser.add_argument("--subgroup", action="store_true")
    parser.add_argument("--stamps", required=True)
    parser.add_argument("--inter-host", default=None, choices=["ucx", "hoccl"],
                        help="the engine between simulated hosts (HOCCL_LOCAL_SIZE)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    global DEVICE
    if args.device == "cuda":
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))
                              % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
    victims = [int(rank) for rank in args.victims.split(",")]
    flags = c10d.SHRINK_ABORT if args.abort else c10d.SHRINK_DEFAULT
    dist.init_process_group("hoccl", pg_options=hoccl.torch.Options(
        backend="cuda" if args.device == "cuda" else "host", inter_host=args.inter_host))
    rank, size = dist.get_rank(), dist.get_world_size()
    if args.inter_host:
        engine = hoccl.torch.communicator(dist.group.WORLD).describe()["inter_host"]
        if not engine.startswith(args.inter_host):
            print(f"rank {rank}: FAILED the hosts are joined by {engine}", flush=True)
    group = dist.new_group(list(range(size))) if args.subgroup else dist.group.WORLD
    try:
        if not all(exact_all_reduce(group, seed) for seed in range(3)):
            print(f"rank {rank}: FAILED the first all_reduces", flush=True)
        if rank == victims[0]:
            go(args.how, group, args.stamps, rank)
        shrunk, report = survive(args.how, group, args.stamps, victims[0], victims[0],
                                 flags, 1000)
        print(f"rank {rank}: {report}", flush=True)
        if len(victims) > 1 and shrunk is not None:
            second = [r for r in range(size) if r != victims[0]].index(victims[1])
            if rank == victims[1]:
                go("exit", shrunk, args.stamps, rank)
            shrunk, report = survive("exit", shrunk, args.stamps, second, victims[1], flags,
                                     3000)
            print(f"rank {rank}: second {report}", flush=True)
        if shrunk is not None:
            dist.barrier(group=shrunk)  # every survivor has printed before any ends
    except Exception:
        print(f"rank {rank}: FAILED {traceback.format_exc()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
