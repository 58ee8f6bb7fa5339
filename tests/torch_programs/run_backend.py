"""torch.distributed on the hoccl backend, one rank per process: run with
``mpiexec -n N python tests/torch_programs/run_backend.py [--device cuda]`` (MASTER_ADDR and
MASTER_PORT set; ``--device cuda``: one GPU per rank, NCCL standing in for gloo).

Every op torch.distributed has, synchronous and asynchronous, in every dtype torch
sends, at odd sizes, with outputs poisoned first.  Copies are compared bit for bit;
reductions against numpy computed the way hoccl accumulates, on small integers (exact
in every dtype and every summation order).  Then sub-groups, a DeviceMesh with a gloo
dimension, and errors for what hoccl cannot do.  On a job whose hosts differ
(``--devices``, ``--intra-host``, ``--local-size``: see common.place) the collectives only,
each rank's tensors on its own device.  Prints one line per failure and
``torch ranks=N: P passed, F failed`` (rank 0); exits non-zero when any rank failed.
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
import common
from common import (COPY_ONLY, REDUCIBLE, data, expect_bits, poisoned, rank_and_world,
                    reference, torch_op)

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

RANK, WORLD = rank_and_world()
COUNTS = (1, 17, 1000)
OPS = ("sum", "avg", "max", "min", "prod", "premul")
FACTOR = 0.375  # exact in every float dtype on the small integers of ``data``


def run(function, *args, async_op, **kwargs):
    """Call ``function`` synchronously, or asynchronously and then wait for its Work."""
    work = function(*args, async_op=async_op, **kwargs)
    if async_op:
        assert work is not None, f"{function.__name__}(async_op=True) returned no Work"
        work.wait()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # as with NCCL, wait() only orders the current stream after the call
            torch.cuda.current_stream().synchronize()
        assert work.is_completed(), f"{function.__name__}: Work not completed after wait()"
    return work


def torch_reduce_op(name):
    # torch 2.11 and 2.13 both build a premultiplied sum with this helper
    return dist._make_nccl_premul_sum(FACTOR) if name == "premul" else torch_op(name)


def ops_for(dtype):
    return [op for op in OPS if op != "premul" or dtype.is_floating_point]


# -- collectives ------------------------------------------------------------------------------
def all_gather_into_tensor(seed, dtype, count, async_op, in_place):
    inputs = [data(seed, rank, (count,), dtype) for rank in range(WORLD)]
    output = poisoned((WORLD * count,), dtype)
    mine = output[RANK * count:(RANK + 1) * count] if in_place else inputs[RANK].clone()
    mine.copy_(inputs[RANK])
    run(dist.all_gather_into_tensor, output, mine, async_op=async_op)
    expect_bits(output, torch.cat(inputs), "all_gather_into_tensor")


def all_gather_list(seed, dtype, count, async_op):
    inputs = [data(seed, rank, (count, 2), dtype) for rank in range(WORLD)]
    outputs = [poisoned((count, 2), dtype) for _ in range(WORLD)]
    run(dist.all_gather, outputs, inputs[RANK], async_op=async_op)
    for rank in range(WORLD):
        expect_bits(outputs[rank], inputs[rank], f"all_gather block {rank}")


def reduce_scatter_tensor(seed, dtype, count, async_op, op, in_place):
    inputs = [data(seed, rank, (WORLD * count,), dtype) for rank in range(WORLD)]
    source = inputs[RANK].clone()
    output = (source[RANK * count:(RANK + 1) * count] if in_place
              else poisoned((count,), dtype))
    run(dist.reduce_scatter_tensor, output, source, op=torch_reduce_op(op), async_op=async_op)
    want = reference([x[RANK * count:(RANK + 1) * count] for x in inputs], op, FACTOR)
    expect_bits(output, want, f"reduce_scatter_tensor {op}")


def reduce_scatter_list(seed, dtype, count, async_op, op):
    inputs = [data(seed, rank, (WORLD * count,), dtype) for rank in range(WORLD)]
    output = poisoned((count,), dtype)
    run(dist.reduce_scatter, output, list(inputs[RANK].clone().chunk(WORLD)),
        op=torch_reduce_op(op), async_op=async_op)
    want = reference([x[RANK * count:(RANK + 1) * count] for x in inputs], op, FACTOR)
    expect_bits(output, want, f"reduce_scatter {op}")


def all_reduce(seed, dtype, count, async_op, op):
    inputs = [data(seed, rank, (count,), dtype) for rank in range(WORLD)]
    tensor = inputs[RANK].clone()
    run(dist.all_reduce, tensor, op=torch_reduce_op(op), async_op=async_op)
    expect_bits(tensor, reference(inputs, op, FACTOR), f"all_reduce {op}")


def splits(seed, sender):
    """Rows rank ``sender`` sends to each rank: uneven, some empty."""
    generator = torch.Generator().manual_seed(seed * 31 + sender)
    return torch.randint(0, 4, (WORLD,), generator=generator).tolist()


def all_to_all_single(seed, dtype, count, async_op, uneven):
    if not uneven:
        inputs = [data(seed, rank, (WORLD * count,), dtype) for rank in range(WORLD)]
        output = poisoned((WORLD * count,), dtype)
        run(dist.all_to_all_single, output, inputs[RANK].clone(), async_op=async_op)
        want = torch.cat([x[RANK * count:(RANK + 1) * count] for x in inputs])
        expect_bits(output, want, "all_to_all_single")
        return
    sent = [splits(seed, rank) for rank in range(WORLD)]
    inputs = [data(seed, rank, (sum(sent[rank]), 3), dtype) for rank in range(WORLD)]
    received = [sent[rank][RANK] for rank in range(WORLD)]
    output = poisoned((sum(received), 3), dtype)
    run(dist.all_to_all_single, output, inputs[RANK].clone(), output_split_sizes=received,
        input_split_sizes=sent[RANK], async_op=async_op)
    want = torch.cat([inputs[rank].split(sent[rank])[RANK] for rank in range(WORLD)])
    expect_bits(output, want, f"all_to_all_single splits {sent}")


def all_to_all_list(seed, dtype, count, async_op):
    sent = [splits(seed, rank) for rank in range(WORLD)]
    inputs = [[data(seed + peer, rank, (sent[rank][peer] * count,), dtype)
               for peer in range(WORLD)] for rank in range(WORLD)]
    outputs = [poisoned((sent[rank][RANK] * count,), dtype) for rank in range(WORLD)]
    run(dist.all_to_all, outputs, [x.clone() for x in inputs[RANK]], async_op=async_op)
    for rank in range(WORLD):
        expect_bits(outputs[rank], inputs[rank][RANK], f"all_to_all from {rank}")


def broadcast(seed, dtype, count, async_op, root):
    want = data(seed, root, (count,), dtype)
    tensor = want.clone() if RANK == root else poisoned((count,), dtype)
    run(dist.broadcast, tensor, root, async_op=async_op)
    expect_bits(tensor, want, f"broadcast from {root}")


def reduce(seed, dtype, count, async_op, op, root):
    inputs = [data(seed, rank, (count,), dtype) for rank in range(WORLD)]
    tensor = inputs[RANK].clone()
    run(dist.reduce, tensor, root, op=torch_reduce_op(op), async_op=async_op)
    want = reference(inputs, op, FACTOR) if RANK == root else inputs[RANK]
    expect_bits(tensor, want, f"reduce {op} to {root}")


def gather(seed, dtype, count, async_op, root):
    inputs = [data(seed, rank, (count,), dtype) for rank in range(WORLD)]
    outputs = [poisoned((count,), dtype) for _ in range(WORLD)] if RANK == root else None
    run(dist.gather, inputs[RANK].clone(), outputs, root, async_op=async_op)
    if RANK == root:
        for rank in range(WORLD):
            expect_bits(outputs[rank], inputs[rank], f"gather block {rank}")


def scatter(seed, dtype, count, async_op, root):
    blocks = [data(seed, rank, (count,), dtype) for rank in range(WORLD)]
    output = poisoned((count,), dtype)
    run(dist.scatter, output, [x.clone() for x in blocks] if RANK == root else None, root,
        async_op=async_op)
    expect_bits(output, blocks[RANK], f"scatter from {root}")


def cases():
    """(name, thunk) for every case, the same on every rank."""
    seed = 0
    every = REDUCIBLE + COPY_ONLY
    for dtype in every:
        for count in COUNTS:
            for async_op in (False, True):
                seed += 1
                tag = f"{str(dtype).split('.')[-1]} x{count} {'async' if async_op else 'sync'}"
                args = (seed, dtype, count, async_op)
                for in_place in (False, True):
                    yield f"all_gather_into_tensor {tag} in_place={in_place}", \
                        lambda a=args, i=in_place: all_gather_into_tensor(*a, i)
                yield f"all_gather {tag}", lambda a=args: all_gather_list(*a)
                for uneven in (False, True):
                    yield f"all_to_all_single {tag} uneven={uneven}", \
                        lambda a=args, u=uneven: all_to_all_single(*a, u)
                yield f"all_to_all {tag}", lambda a=args: all_to_all_list(*a)
                for root in sorted({0, WORLD - 1}):
                    yield f"broadcast {tag} root={root}", lambda a=args, r=root: broadcast(*a, r)
                    yield f"gather {tag} root={root}", lambda a=args, r=root: gather(*a, r)
                    yield f"scatter {tag} root={root}", lambda a=args, r=root: scatter(*a, r)
                if dtype in COPY_ONLY:
                    continue
                for op in ops_for(dtype):
                    yield f"all_reduce {op} {tag}", lambda a=args, o=op: all_reduce(*a, o)
                    yield f"reduce_scatter {op} {tag}", lambda a=args, o=op: reduce_scatter_list(*a, o)
                    for in_place in (False, True):
                        yield f"reduce_scatter_tensor {op} {tag} in_place={in_place}", \
                            lambda a=args, o=op, i=in_place: reduce_scatter_tensor(*a, o, i)
                    yield f"reduce {op} {tag} root={WORLD - 1}", \
                        lambda a=args, o=op: reduce(*a, o, WORLD - 1)


# -- point to point, barrier, Work ------------------------------------------------------------
def batch_ring(seed, dtype, rounds):
    """Every rank sends to the next and receives from the previous, and the other way
    round, ``rounds`` messages per direction in one batch: a cycle that only batching
    keeps from waiting for ever."""
    after, before = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    sent = [data(seed + k, RANK, (5 + k,), dtype) for k in range(rounds)]
    from_before = [poisoned((5 + k,), dtype) for k in range(rounds)]
    from_after = [poisoned((5 + k,), dtype) for k in range(rounds)]
    operations = []
    for k in range(rounds):
        operations += [dist.P2POp(dist.isend, sent[k], after),
                       dist.P2POp(dist.irecv, from_before[k], before),
                       dist.P2POp(dist.irecv, from_after[k], after),
                       dist.P2POp(dist.isend, sent[k], before)]
    for work in dist.batch_isend_irecv(operations):
        work.wait()
    for k in range(rounds):
        expect_bits(from_before[k], data(seed + k, before, (5 + k,), dtype), f"ring {k} fwd")
        expect_bits(from_after[k], data(seed + k, after, (5 + k,), dtype), f"ring {k} back")


def send_recv_pairs(seed, async_op):
    """Even ranks send to the odd rank after them, which sends back."""
    partner = RANK + 1 if RANK % 2 == 0 else RANK - 1
    if partner >= WORLD:
        return
    mine, theirs = data(seed, RANK, (33,), torch.float32), poisoned((33,), torch.float32)
    for first in (RANK % 2 == 0, RANK % 2 == 1):
        if first:
            work = (dist.isend(mine, partner) if async_op else dist.send(mine, partner))
        else:
            work = (dist.irecv(theirs, partner) if async_op else dist.recv(theirs, partner))
        if async_op:
            work.wait()
    expect_bits(theirs, data(seed, partner, (33,), torch.float32), "send/recv")


def isend_then_collective(seed):
    """A send whose Work is never waited for goes out with the next call on the group."""
    after, before = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    received = poisoned((9,), torch.int64)
    dist.isend(data(seed, RANK, (9,), torch.int64), after)
    receive = dist.irecv(received, before)
    total = torch.ones(1, device=common.DEVICE)
    dist.all_reduce(total)
    receive.wait()
    expect_bits(received, data(seed, before, (9,), torch.int64), "isend then all_reduce")
    assert total.item() == WORLD


def barrier_orders_ranks():
    for async_op in (False, True):
        work = dist.barrier(async_op=async_op)
        if async_op:
            work.wait()


def futures_carry_outputs(seed):
    tensor = data(seed, RANK, (11,), torch.float32)
    inputs = [data(seed, rank, (11,), torch.float32) for rank in range(WORLD)]
    work = dist.all_reduce(tensor, async_op=True)
    value = work.get_future().wait()
    expect_bits(value[0], reference(inputs, "sum", FACTOR), "future value")
    expect_bits(work.result()[0], reference(inputs, "sum", FACTOR), "work result")
    chained = dist.all_reduce(torch.ones(3, device=common.DEVICE), async_op=True).get_future()
    doubled = chained.then(lambda future: future.value()[0] * 2)
    expect_bits(doubled.wait(), torch.full((3,), 2.0 * WORLD), "future then")


def coalesced_calls(seed):
    """torch's coalescing manager: several all_reduces as one Work."""
    from torch.distributed.distributed_c10d import _coalescing_manager
    inputs = [[data(seed + k, rank, (7,), torch.float32) for rank in range(WORLD)]
              for k in range(3)]
    tensors = [inputs[k][RANK].clone() for k in range(3)]
    with _coalescing_manager(async_ops=True) as manager:
        for tensor in tensors:
            dist.all_reduce(tensor)
    manager.wait()
    for k, tensor in enumerate(tensors):
        expect_bits(tensor, reference(inputs[k], "sum", FACTOR), f"coalesced all_reduce {k}")


def objects_travel():
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, {"rank": RANK, "text": "x" * RANK})
    assert gathered == [{"rank": rank, "text": "x" * rank} for rank in range(WORLD)], gathered
    box = [{"from": 0}] if RANK == 0 else [None]
    dist.broadcast_object_list(box, 0)
    assert box == [{"from": 0}], box


# -- groups ------------------------------------------------------------------------------------
def sub_groups(seed):
    """new_group: each group is a communicator of its own, with group ranks."""
    members = [rank for rank in range(WORLD) if rank != 0] or [0]
    group = dist.new_group(members)
    everyone_but_last = dist.new_group(list(range(max(1, WORLD - 1))))
    for ranks, sub in ((members, group), (list(range(max(1, WORLD - 1))), everyone_but_last)):
        if RANK not in ranks:
            continue
        assert isinstance(sub, hoccl.torch.ProcessGroupHoccl), type(sub)
        assert hoccl.torch.communicator(sub).world_size == len(ranks)
        inputs = [data(seed, rank, (13,), torch.int32) for rank in ranks]
        tensor = inputs[ranks.index(RANK)].clone()
        dist.all_reduce(tensor, group=sub)
        expect_bits(tensor, reference(inputs, "sum", FACTOR), f"all_reduce in group {ranks}")
        output = poisoned((13 * len(ranks),), torch.int32)
        dist.all_gather_into_tensor(output, inputs[ranks.index(RANK)], group=sub)
        expect_bits(output, torch.cat(inputs), f"all_gather in group {ranks}")


def device_mesh_with_another_backend(seed):
    """A 2-D mesh whose first dimension is the hoccl default group and whose second
    runs on NCCL (gloo on CPUs)."""
    from torch.distributed.device_mesh import init_device_mesh
    other = "nccl" if common.DEVICE.type == "cuda" else "gloo"
    mesh = init_device_mesh(common.DEVICE.type, (WORLD, 1), mesh_dim_names=("dp", "tp"),
                            backend_override={"tp": other})
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    assert isinstance(dp, hoccl.torch.ProcessGroupHoccl), type(dp)
    assert dist.get_backend(tp) == other, dist.get_backend(tp)
    inputs = [data(seed, rank, (6,), torch.float32) for rank in range(WORLD)]
    tensor = inputs[RANK].clone()
    dist.all_reduce(tensor, group=dp)
    expect_bits(tensor, reference(inputs, "sum", FACTOR), "all_reduce over the mesh's dp")
    alone = inputs[RANK].clone()
    dist.all_reduce(alone, group=tp)
    expect_bits(alone, inputs[RANK], f"all_reduce over a one-rank {other} dimension")


# -- what hoccl refuses -----------------------------------------------------------------------
def refuses(what, call, *words):
    try:
        call()
    except hoccl.InvalidArgumentError as error:
        text = str(error)
        assert all(word in text for word in words), f"{what}: message {text!r} lacks {words}"
        return
    raise AssertionError(f"{what}: no error")


def unsupported_requests_raise():
    def ones(dtype):
        return torch.ones(3, dtype=dtype, device=common.DEVICE)
    refuses("int16 sum", lambda: dist.all_reduce(ones(torch.int16)), "all_reduce", "int16",
            "float16")
    refuses("bool sum", lambda: dist.all_reduce(ones(torch.bool)), "all_reduce", "bool")
    refuses("bitwise and", lambda: dist.all_reduce(ones(torch.int32), op=dist.ReduceOp.BAND),
            "all_reduce", "BAND")
    refuses("premul on ints", lambda: dist.all_reduce(
        ones(torch.int32), op=dist._make_nccl_premul_sum(2.0)), "all_reduce", "PREMUL_SUM")
    refuses("wrong list", lambda: dist.all_gather([ones(torch.float32)] * (WORLD + 1),
                                                  ones(torch.float32)),
            "all_gather", "world_size")


def cpu_tensors(seed):
    """CPU tensors: hoccl's own on the host backend, gloo's beside a GPU communicator."""
    inputs = [data(seed, rank, (5,), torch.float32).cpu() for rank in range(WORLD)]
    tensor = inputs[RANK].clone()
    dist.all_reduce(tensor)
    expect_bits(tensor, reference(inputs, "sum", None), "all_reduce of CPU tensors")


def complex_sums_are_float_sums(seed):
    """torch hands a complex all_reduce to the backend as its real view."""
    inputs = [data(seed, rank, (9,), torch.complex64) for rank in range(WORLD)]
    tensor = inputs[RANK].clone()
    dist.all_reduce(tensor)
    want = torch.view_as_complex(reference([torch.view_as_real(x) for x in inputs], "sum", None))
    expect_bits(tensor, want, "complex all_reduce")


def checker_catches_a_flipped_bit():
    tensor = data(5, RANK, (8,), torch.bfloat16)
    flipped = tensor.clone()
    flipped.view(torch.int16)[3] ^= 1
    try:
        expect_bits(flipped, tensor, "planted fault")
    except AssertionError:
        return
    raise AssertionError("expect_bits accepted a flipped bit")


def other_cases():
    yield "checker catches a flipped bit", checker_catches_a_flipped_bit
    for dtype in (torch.float32, torch.bfloat16, torch.bool):
        for rounds in (1, 3):
            yield f"batch_isend_irecv ring {dtype} x{rounds}", \
                lambda d=dtype, r=rounds: batch_ring(900, d, r)
    for async_op in (False, True):
        yield f"send/recv pairs async={async_op}", lambda a=async_op: send_recv_pairs(910, a)
    yield "isend then a collective", lambda: isend_then_collective(920)
    yield "barrier", barrier_orders_ranks
    yield "futures", lambda: futures_carry_outputs(930)
    yield "coalescing manager", lambda: coalesced_calls(940)
    yield "objects", objects_travel
    yield "sub-groups", lambda: sub_groups(950)
    yield "device mesh with another backend", lambda: device_mesh_with_another_backend(960)
    yield "cpu tensors", lambda: cpu_tensors(980)
    yield "complex sums", lambda: complex_sums_are_float_sums(970)
    yield "unsupported requests raise", unsupported_requests_raise


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--kernel-bytes", type=int, default=0,
                        help="the group's kernel_bytes: small collectives as direct kernels")
    parser.add_argument("--inter-host", default=None, choices=("mpi", "gloo", "ucx", "hoccl"),
                        help="the engine between simulated hosts (--local-size)")
    common.add_placement(parser)
    args = parser.parse_args()
    if args.device == "cuda":
        common.use_device(torch.device("cuda", RANK % torch.cuda.device_count()))
    mixed = common.place(args, RANK, WORLD)
    settings = {"kernel_bytes": args.kernel_bytes} if args.kernel_bytes else {}
    options = (hoccl.torch.Options(settings=settings, inter_host=args.inter_host)
               if settings or args.inter_host else None)
    dist.init_process_group("hoccl", rank=RANK, world_size=WORLD, timeout=timedelta(seconds=60),
                            pg_options=options)
    assert dist.get_backend() == "hoccl"
    passed = failed = 0
    # a job whose hosts differ: the collectives (sub-groups, meshes and objects are a
    # job of one kind's)
    for name, case in [*cases(), *([] if mixed else other_cases())]:
        try:
            case()
            passed += 1
        except Exception:
            failed += 1
            print(f"rank {RANK} FAILED {name}\n{traceback.format_exc()}", flush=True)
    totals = torch.tensor([passed, failed], device=common.DEVICE)
    dist.all_reduce(totals)
    if RANK == 0:
        label = f" kernel_bytes={args.kernel_bytes}" if args.kernel_bytes else ""
        label += " mixed" if mixed else ""
        print(f"torch ranks={WORLD} backend=hoccl {args.device}{label}: {totals[0]} passed, "
              f"{totals[1]} failed",
              flush=True)
    dist.destroy_process_group()
    sys.exit(1 if totals[1] else 0)


if __name__ == "__main__":
    main()
