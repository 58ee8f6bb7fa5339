"""torch calls that valid programs make, on a hoccl group against a gloo group: run with
``mpiexec -n N python tests/torch_programs/run_calls.py`` (MASTER_ADDR, MASTER_PORT set).

The default group is gloo; a hoccl group of every rank runs the same calls, and each
check's result on it must be the gloo group's, bit for bit (the DDP training on more
than two ranks: within 1e-6, sums of three in another order), and what the inputs say
it must be:

* ``dist.all_gather_coalesced``, several dtypes and sizes, synchronous and not;
* writes into tensors that require grad (``all_reduce``, ``broadcast``, ``all_gather``,
  ``recv``), and DDP trained with ``loss.backward(create_graph=True)``;
* ``dist.recv`` / ``irecv`` with no ``src``: from every rank, in each sender's order,
  before a recv from a named rank (in the order posted: MPI's, which gloo keeps only
  sometimes), before this rank's own send, with a collective of the group in between,
  and ``is_completed()`` false before anyone sent.

Then hoccl alone: an any-source recv that no rank sends to times out naming the call.
Prints one line per failure and ``torch calls ranks=N: P passed, F failed`` (rank 0);
exits non-zero when any rank failed.
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import hoccl
import hoccl.torch
from common import data, expect_bits, poisoned, rank_and_world

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

RANK, WORLD = rank_and_world()
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.float64)


# -- all_gather_coalesced -------------------------------------------------------------------
def all_gather_coalesced(group, seed, dtype, async_op):
    sizes = [(3,), (1,), (4, 5)]
    inputs = [data(seed + index, RANK, size, dtype) for index, size in enumerate(sizes)]
    outputs = [[poisoned(size, dtype) for size in sizes] for _ in range(WORLD)]
    work = dist.all_gather_coalesced(outputs, inputs, group=group, async_op=async_op)
    if async_op:
        work.wait()
    for rank in range(WORLD):
        for index, size in enumerate(sizes):
            expect_bits(outputs[rank][index], data(seed + index, rank, size, dtype),
                        f"all_gather_coalesced rank {rank} tensor {index}")
    return [tensor for row in outputs for tensor in row]


# -- tensors that require grad --------------------------------------------------------------
def writes_into_tensors_that_require_grad(group, seed):
    """What gloo does to leaves that require grad: writes into them, unrecorded (not
    all_gather's list form, whose copies into the list torch refuses on gloo too)."""
    inputs = [data(seed, rank, (6,), torch.float32) for rank in range(WORLD)]
    summed = inputs[RANK].clone().requires_grad_()
    dist.all_reduce(summed, group=group)
    expect_bits(summed.detach(), sum(inputs[1:], inputs[0]), "all_reduce into a leaf")
    broadcast = inputs[RANK].clone().requires_grad_()
    dist.broadcast(broadcast, src=0, group=group)
    received = poisoned((6,), torch.float32).requires_grad_()
    if WORLD > 1:
        if RANK == 0:
            dist.send(inputs[0] + 1, dst=1, group=group)
        elif RANK == 1:
            dist.recv(received, src=0, group=group)
            expect_bits(received.detach(), inputs[0] + 1, "recv into a leaf")
    expect_bits(broadcast.detach(), inputs[0], "broadcast into a leaf")
    assert all(t.requires_grad and t.grad_fn is None for t in [summed, broadcast, received])
    return [summed.detach(), broadcast.detach(), received.detach()]


def ddp_with_create_graph(group, seed, steps=3):
    """DDP steps with ``backward(create_graph=True)``: the gradients it all-reduces
    require grad.  One parameter: with more, torch's reducer copies gradients into its
    bucket in place, which it refuses itself on every backend (torch issue 63929)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 1, bias=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    generator = torch.Generator().manual_seed(seed * 101 + RANK)
    record = []
    for _ in range(steps):
        x = torch.randn(8, 6, generator=generator)
        loss = ddp(x).pow(2).mean()
        loss.backward(create_graph=True)
        grad = model.weight.grad
        assert grad is not None and grad.requires_grad, "create_graph: the gradient lost its graph"
        with torch.no_grad():
            model.weight -= 0.125 * grad
        model.weight.grad = None
        record += [loss.detach(), grad.detach().clone(), model.weight.detach().clone()]
    return record


# -- recv from any source -------------------------------------------------------------------
def message(seed, sender, index):
    return data(seed, sender * 16 + index, (5,), torch.float32)


def recv_from_every_rank(group, seed, per_sender=3):
    """Rank 0 receives every other rank's messages with no src; each sender's arrive in
    the order it sent them (the order across senders is the network's)."""
    if RANK != 0:
        for index in range(per_sender):
            dist.send(message(seed, RANK, index), dst=0, group=group)
        return []
    got = {sender: [] for sender in range(1, WORLD)}
    for _ in range(per_sender * (WORLD - 1)):
        tensor = poisoned((5,), torch.float32)
        source = dist.recv(tensor, group=group)
        got[source].append(tensor)
    for sender, tensors in got.items():
        assert len(tensors) == per_sender, f"{len(tensors)} messages from rank {sender}"
        for index, tensor in enumerate(tensors):
            expect_bits(tensor, message(seed, sender, index), f"message {index} of {sender}")
    return [tensor for sender in sorted(got) for tensor in got[sender]]


def any_source_before_a_named_source(group, seed):
    """An irecv with no src posted before a recv from rank 1 (only rank 1 sends): the two
    take rank 1's two messages.  On hoccl the earlier-posted recv takes the first (as
    MPI orders them); gloo lets the named recv take it about half the time, so only
    the pair is compared with gloo's."""
    if RANK == 1:
        dist.send(message(seed, 1, 0), dst=0, group=group)
        dist.send(message(seed, 1, 1), dst=0, group=group)
    if RANK != 0:
        return []
    first, second = poisoned((5,), torch.float32), poisoned((5,), torch.float32)
    work = dist.irecv(first, group=group)
    dist.recv(second, src=1, group=group)
    work.wait()
    assert work._source_rank() == 1, work._source_rank()
    if dist.get_backend(group) != "hoccl" and torch.equal(first, message(seed, 1, 1)):
        first, second = second, first
    expect_bits(first, message(seed, 1, 0), "the any-source recv")
    expect_bits(second, message(seed, 1, 1), "the named recv")
    return [first, second]


def any_source_before_own_send(group, seed):
    """Rank 0 posts an irecv with no src, then sends to rank 1, which sends to rank 0
    only once it has received: the irecv must not hold rank 0's send back."""
    received = poisoned((5,), torch.float32)
    if RANK == 0:
        work = dist.irecv(received, group=group)
        dist.send(message(seed, 0, 0), dst=1, group=group)
        work.wait()
        expect_bits(received, message(seed, 1, 0), "rank 1's answer")
    elif RANK == 1:
        dist.recv(received, src=0, group=group)
        expect_bits(received, message(seed, 0, 0), "rank 0's message")
        dist.send(message(seed, 1, 0), dst=0, group=group)
    return [received]


def any_source_across_a_collective(group, seed):
    """A collective of the group between an any-source irecv and its sender's send, and
    ``is_completed()`` false while nobody has sent (rank 1 sends after the barrier of
    the default group, which rank 0 enters after asking)."""
    received = poisoned((5,), torch.float32)
    summed = torch.full((4,), float(RANK))
    work = dist.irecv(received, group=group) if RANK == 0 else None
    if work is not None:
        assert not work.is_completed(), "an any-source recv completed before any send"
    dist.barrier()
    dist.all_reduce(summed, group=group)
    expect_bits(summed, torch.full((4,), float(sum(range(WORLD)))), "the collective between")
    if RANK == 1:
        dist.send(message(seed, 1, 2), dst=0, group=group)
    if work is not None:
        work.wait()
        expect_bits(received, message(seed, 1, 2), "the any-source recv")
    return [received, summed]


def any_source_recv_times_out_naming_the_call(seed):
    """hoccl alone: nobody sends (rank 1 waits at the default group's barrier), the wait
    ends after the group's timeout with an error saying what it waited for; the recv is
    dropped, and the next one takes rank 1's send."""
    group = dist.new_group(backend="hoccl", timeout=timedelta(seconds=2))
    if RANK == 0:
        work = dist.irecv(poisoned((5,), torch.float32), group=group)
        try:
            work.wait()
        except hoccl.HocclTimeoutError as error:
            text = str(error)
            for words in ("recv", "any source", "sends called to it"):
                assert words in text, f"the timeout's message {text!r} lacks {words!r}"
        else:
            raise AssertionError("an any-source recv that nobody sent to completed")
    dist.barrier()  # rank 1 sends only now
    received = poisoned((5,), torch.float32)
    if RANK == 1:
        dist.send(message(seed, 1, 3), dst=0, group=group)
    elif RANK == 0:
        source = dist.recv(received, group=group)
        assert source == 1, source
        expect_bits(received, message(seed, 1, 3), "the recv after the dropped one")
    dist.destroy_process_group(group)


def compared(name, function, exact=True):
    """Run ``function(group)`` on the gloo group, then on the hoccl group, and compare."""
    def check():
        want = function(REFERENCE)
        got = function(HOCCL)
        assert len(got) == len(want), f"{name}: {len(got)} results, gloo {len(want)}"
        for index, (mine, theirs) in enumerate(zip(got, want)):
            if exact:
                expect_bits(mine, theirs, f"{name} result {index} against gloo's")
            else:
                torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    return name, check


def cases():
    for dtype in DTYPES:
        for async_op in (False, True):
            yield compared(f"all_gather_coalesced {dtype} async={async_op}",
                           lambda g, d=dtype, a=async_op: all_gather_coalesced(g, 10, d, a))
    yield compared("writes into tensors that require grad",
                   lambda g: writes_into_tensors_that_require_grad(g, 20))
    yield compared("DDP with backward(create_graph=True)",
                   lambda g: ddp_with_create_graph(g, 30), exact=WORLD <= 2)
    if WORLD > 1:
        yield compared("recv with no src from every rank", lambda g: recv_from_every_rank(g, 40))
        yield compared("irecv with no src before a recv from rank 1",
                       lambda g: any_source_before_a_named_source(g, 50))
        yield compared("irecv with no src before this rank's send",
                       lambda g: any_source_before_own_send(g, 60))
        yield compared("irecv with no src across a collective",
                       lambda g: any_source_across_a_collective(g, 70))
        yield ("an any-source recv times out naming the call",
               lambda: any_source_recv_times_out_naming_the_call(80))


def main():
    global REFERENCE, HOCCL
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="run the checks whose name holds this")
    args = parser.parse_args()
    dist.init_process_group("gloo", rank=RANK, world_size=WORLD, timeout=timedelta(seconds=60))
    REFERENCE = dist.group.WORLD
    HOCCL = dist.new_group(backend="hoccl")
    passed = failed = 0
    for name, case in cases():
        if args.only not in name:
            continue
        try:
            case()
            passed += 1
        except Exception:
            failed += 1
            print(f"rank {RANK} FAILED {name}\n{traceback.format_exc()}", flush=True)
        dist.barrier()
    totals = torch.tensor([passed, failed])
    dist.all_reduce(totals)
    if RANK == 0:
        print(f"torch calls ranks={WORLD}: {totals[0]} passed, {totals[1]} failed", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if totals[1] else 0)


REFERENCE = HOCCL = None

if __name__ == "__main__":
    main()
