"""PyTorch on hoccl, on the host backend: the torch.distributed backend under mpiexec
(-n 2 and -n 3), DDP, FSDP2 and HSDP training against gloo (HSDP also under -n 4), the
training example and the training benchmark's smoke run.  Skipped when torch is not
installed."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_mpi import MPI_ENV, _mpiexec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).parent / "torch_programs"


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(ranks, *args, timeout=600, env=None):
    """``mpiexec -n ranks python args...`` with torch's env:// rendezvous set up."""
    # one torch thread per process: the ranks share the machine's cores
    env = {**os.environ, **MPI_ENV, "HOCCL_VERIFY": "1", "OMP_NUM_THREADS": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": os.pathsep.join([str(PROGRAMS), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")]), **(env or {})}
    command = [_mpiexec(), "-n", str(ranks), sys.executable, *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_every_torch_distributed_op_on_the_hoccl_backend(ranks):
    code, output = launch(ranks, PROGRAMS / "run_backend.py")
    assert code == 0, output[-6000:]
    assert re.search(rf"torch ranks={ranks} backend=hoccl cpu: \d+ passed, 0 failed", output), \
        output[-6000:]


@pytest.mark.mpi
@pytest.mark.parametrize("jitter", [0, 0.002])
def test_every_torch_distributed_op_with_direct_kernels(jitter):
    """The same ops on a default group whose small collectives run as direct kernels
    (``pg_options`` with ``kernel_bytes``); once with the host streams jittered
    (``HOCCL_HOST_JITTER``), where a lane's completion writes landing after a later
    call's on the caller's stream once left the host waiting for ever."""
    code, output = launch(2, PROGRAMS / "run_backend.py", "--kernel-bytes", str(1 << 20),
                          env={"HOCCL_HOST_JITTER": str(jitter)})
    assert code == 0, output[-6000:]
    assert re.search(r"torch ranks=2 backend=hoccl cpu kernel_bytes=1048576: \d+ passed, "
                     r"0 failed", output), output[-6000:]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, default, flags", [
    (2, "hoccl", []), (3, "hoccl", []),
    # HSDP only (DDP and FSDP2 at 4 ranks would add a minute); the default process group
    # gloo, the hoccl groups beside it, as in a program that keeps NCCL
    (4, "gloo", ["--default-backend", "reference", "--only", "HSDP"]),
    # two simulated hosts of two ranks, UCX between them (shared memory and TCP here)
    (4, "hoccl", ["--inter-host", "ucx", "--local-size", "2"])])
def test_ddp_fsdp2_and_hsdp_on_hoccl_train_to_gloos_losses_and_parameters(ranks, default, flags):
    env = {}
    if "--local-size" in flags:
        at = flags.index("--local-size")
        env["HOCCL_LOCAL_SIZE"], flags = flags[at + 1], flags[:at] + flags[at + 2:]
    code, output = launch(ranks, PROGRAMS / "run_training.py", *flags, env=env)
    assert code == 0, output[-6000:]
    if "--inter-host" in flags:
        engine = flags[flags.index("--inter-host") + 1]
        assert f"across hosts: {engine} [" in output, output[-6000:]
    assert re.search(rf"torch training ranks={ranks} default={default}: \d+ passed, 0 failed",
                     output), output[-6000:]
    # an HSDP run for every mesh shape of the world: (1, n), (n, 1) and between
    shapes = {(int(replicas), int(shards))
              for replicas, shards in re.findall(r"^HSDP (\d+)x(\d+),", output, re.M)}
    assert shapes == {(r, ranks // r) for r in range(1, ranks + 1) if ranks % r == 0}, output


def _losses(output):
    return [float(value) for value in re.findall(r"^step \d+ loss (\S+)$", output, re.M)]


@pytest.mark.mpi
def test_the_fsdp2_example_trains_to_the_same_losses_on_gloo_and_hoccl():
    """2 ranks sum in one order only, so the losses agree exactly."""
    runs = {}
    for name, flags in (("gloo", ["--backend", "gloo"]), ("hoccl", ["--backend", "hoccl"]),
                        ("hooks", ["--backend", "gloo", "--hooks"])):
        code, output = launch(2, ROOT / "examples" / "train_fsdp2.py", *flags, "--tiny",
                              "--steps", "8", "--lr", "3e-3")
        assert code == 0, output[-4000:]
        runs[name] = _losses(output)
        if name == "hooks":  # every all-gather into registered memory, none exchanging
            found = re.search(r"(\d+) of (\d+) all-gathers", output)
            assert found and found.group(1) == found.group(2) != "0", output[-2000:]
    assert len(runs["gloo"]) == 8 and runs["gloo"][-1] < runs["gloo"][0], runs
    assert runs["hoccl"] == runs["gloo"], runs
    assert runs["hooks"] == runs["gloo"], runs


@pytest.mark.mpi
def test_the_training_benchmark_runs_on_cpus_and_writes_its_results(tmp_path):
    pulled = "hoccl-hooks+pull_bytes=1G+max_sms=4"
    code, output = launch(2, "-m", "hoccl.bench.train", "--shapes", "tiny", "--steps", "1",
                          "--trials", "2", "--warmup", "1", "--profile-steps", "1",
                          "--libraries", f"gloo,hoccl,hoccl-hooks,{pulled}",
                          "--out", tmp_path)
    assert code == 0, output[-4000:]
    import json
    result = json.loads((tmp_path / "train.json").read_text())
    assert {r["library"] for r in result["records"]} == {"gloo", "hoccl", "hoccl-hooks", pulled}
    # the variant runs on a group of its own whose reduce-scatters pull: their inputs come
    # from registered memory, so none exchanges descriptors (the plain hooks' exchange once
    # per size at most)
    (record,) = [r for r in result["records"] if r["library"] == pulled]
    done, calls = record["without_exchange"]["reduce_scatter"]
    assert calls > 0 and done == calls, record["without_exchange"]
    for record in result["records"]:
        assert record["median_step_s"] > 0 and record["tokens_per_s"] > 0, record
        assert record["profile_ms_per_step"] is None  # no device timeline on CPUs
    assert (tmp_path / "train.md").exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "train.png").stat().st_size > 0


# -- pieces that need no second process ------------------------------------------------------
def test_the_training_benchmark_parses_library_settings():
    from hoccl.bench.train import parse_library
    assert parse_library("hoccl-hooks+max_sms=32+chunk_bytes=128M", "nccl") == (
        "hoccl-hooks", {"max_sms": 32, "chunk_bytes": 128 << 20})
    assert parse_library("nccl", "nccl") == ("nccl", {})
    for bad, words in (("nccl+max_sms=4", "unknown library"), ("gloo", "unknown library"),
                       ("hoccl+sms=4", "setting of"), ("hoccl+max_sms", "setting of"),
                       ("hoccl+max_sms=many", "must be a number")):
        with pytest.raises(ValueError, match=words):
            parse_library(bad, "nccl")


def _in_threads(world_size, function):
    """Run ``function(rank)`` in one thread per rank; re-raise the first failure."""
    import threading
    results, errors = {}, []

    def body(rank):
        try:
            results[rank] = function(rank)
        except BaseException as error:  # reported to the test below
            errors.append(error)
    threads = [threading.Thread(target=body, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results


def test_store_bootstrap_gathers_in_rank_order_and_removes_its_keys():
    import torch.distributed as dist
    from hoccl.torch import StoreBootstrap
    store = dist.HashStore()

    def exchange(rank):
        bootstrap = StoreBootstrap(store, rank, 3)
        gathered = [bootstrap.allgather({"rank": rank, "payload": "x" * (rank * 1000)})
                    for _ in range(4)]
        bootstrap.barrier()
        return gathered
    results = _in_threads(3, exchange)
    want = [{"rank": rank, "payload": "x" * (rank * 1000)} for rank in range(3)]
    assert all(rounds == [want] * 4 for rounds in results.values()), results
    assert store.num_keys() == 0


def test_init_bootstraps_from_a_torch_store_instead_of_mpi():
    import numpy as np
    import torch.distributed as dist
    import hoccl
    from hoccl.torch import StoreBootstrap
    store = dist.HashStore()

    def rank_main(rank):
        with hoccl.init(backend="host", bootstrap=StoreBootstrap(store, rank, 2),
                        timeout=30) as comm:
            received = np.full(6, -1, np.int32)
            comm.all_gather(np.full(3, rank + 10, np.int32), received)
            comm.synchronize()
            return comm.rank, comm.world_size, received
    results = _in_threads(2, rank_main)
    for rank, (got_rank, size, received) in results.items():
        assert (got_rank, size) == (rank, 2)
        assert received.tolist() == [10, 10, 10, 11, 11, 11]


def test_reduction_ops_translate_and_premul_sum_carries_its_factor():
    import torch.distributed as dist
    import hoccl
    from hoccl.torch._ops import reduction
    assert reduction("all_reduce", dist.ReduceOp.SUM) == ("sum", None)
    assert reduction("all_reduce", dist.ReduceOp.AVG) == ("avg", None)
    assert reduction("all_reduce", dist.ReduceOp.PRODUCT) == ("prod", None)
    assert reduction("all_reduce", dist.ReduceOp.PREMUL_SUM(0.25)) == ("sum", 0.25)
    with pytest.raises(hoccl.InvalidArgumentError, match="reduce: hoccl has no reduction BXOR"):
        reduction("reduce", dist.ReduceOp.BXOR)


def test_torch_reduces_hoccls_dtypes_and_premultiplies_only_the_floating_ones():
    import hoccl
    from hoccl.torch._ops import REDUCIBLE, reducible
    assert REDUCIBLE == (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                         torch.int8, torch.uint8, torch.int32, torch.int64)
    for dtype in REDUCIBLE:
        reducible("all_reduce", torch.ones(2, dtype=dtype))
        if dtype.is_floating_point:
            reducible("all_reduce", torch.ones(2, dtype=dtype), 0.5)
            continue
        with pytest.raises(hoccl.InvalidArgumentError, match="PREMUL_SUM needs a floating"):
            reducible("all_reduce", torch.ones(2, dtype=dtype), 0.5)
    with pytest.raises(hoccl.InvalidArgumentError,
                       match="cannot reduce torch.int16; it reduces float16, bfloat16, float32, "
                             "float64, int8, uint8, int32, int64"):
        reducible("all_reduce", torch.ones(2, dtype=torch.int16))


def test_premultiply_hands_a_number_to_the_kernel_and_multiplies_by_anything_else():
    from hoccl._hierarchy import HierarchicalCommunicator
    from hoccl.torch._ops import premultiply
    one_host = object()  # any communicator but a HierarchicalCommunicator
    across_hosts = HierarchicalCommunicator.__new__(HierarchicalCommunicator)
    values = [1.0, -2.0, 3.0, 0.5]
    tensor = torch.tensor(values, dtype=torch.bfloat16)
    for factor, scale in ((None, None), (0.375, 0.375), (2, 2.0)):
        source, got = premultiply(one_host, tensor, factor, in_place=True)
        assert source is tensor and got == scale and type(got) is type(scale), (factor, got)
    assert tensor.tolist() == values  # the kernel multiplies; nothing did here
    for comm, factor in ((one_host, torch.tensor([0.375])), (across_hosts, 0.375)):
        source, got = premultiply(comm, tensor, factor, in_place=False)
        assert got is None and source is not tensor and source.dtype == torch.bfloat16
        assert source.tolist() == [value * 0.375 for value in values]
        assert tensor.tolist() == values
        copy = tensor.clone()
        source, got = premultiply(comm, copy, factor, in_place=True)
        assert got is None and source is copy
        assert copy.tolist() == [value * 0.375 for value in values]


@pytest.mark.parametrize("factor", [0.375, "one-element tensor"])
def test_premul_sum_scales_every_reduction_of_the_process_group(init_local, factor):
    """On a one-rank group each reduction is its input times the factor; an input that
    is not the output is left as it was (reduce_scatter_tensor, reduce_scatter)."""
    import torch.distributed as dist
    from hoccl.torch import ProcessGroupHoccl
    group = ProcessGroupHoccl(init_local(1, backend="host")[0])
    op = dist._make_nccl_premul_sum(torch.tensor([0.375]) if factor != 0.375 else 0.375)
    values = torch.randint(-8, 8, (8,), generator=torch.Generator().manual_seed(15)).float()
    want = values * 0.375  # exact: small integers times 3/8

    def options(kind, **fields):
        made = kind()
        made.reduceOp = op
        for name, value in fields.items():
            setattr(made, name, value)
        return made

    def poisoned():
        return torch.full((8,), float("nan"))
    tensor = values.clone()
    group.allreduce([tensor], options(dist.AllreduceOptions)).wait()
    assert torch.equal(tensor, want), ("all_reduce", tensor)
    tensor = values.clone()
    group.reduce([tensor], options(dist.ReduceOptions, rootRank=0)).wait()
    assert torch.equal(tensor, want), ("reduce", tensor)
    for name, call in (
            ("reduce_scatter_tensor", lambda out, inp, opts: group.reduce_scatter_single(
                out, inp, opts)),
            ("reduce_scatter", lambda out, inp, opts: group.reduce_scatter([out], [[inp]], opts))):
        source, output = values.clone(), poisoned()
        call(output, source, options(dist.ReduceScatterOptions)).wait()
        assert torch.equal(output, want), (name, output)
        assert torch.equal(source, values), (name, "changed its input", source)


def test_copies_of_dtypes_hoccl_cannot_reduce_move_their_bytes():
    from hoccl.torch._ops import movable
    flags = torch.tensor([[True, False], [False, True]])
    view = movable(flags)
    assert view.dtype == torch.uint8 and view.data_ptr() == flags.data_ptr()
    assert view.numel() == 4
    floats = torch.ones(3)
    assert movable(floats) is floats


def test_options_reject_what_init_does_not_take():
    import hoccl
    from hoccl.torch import Options
    with pytest.raises(hoccl.InvalidArgumentError, match="unknown settings"):
        Options(settings={"max_sm": 4})
    with pytest.raises(hoccl.InvalidArgumentError, match="backend must be"):
        Options(backend="nccl")


def test_exposed_communication_is_communication_time_without_compute():
    from hoccl.bench.train import exposed
    # compute 0-10 and 20-30; communication 5-25: exposed 10-20; idle 30-35
    activities = [(0, 10, False), (20, 30, False), (5, 25, True), (33, 35, True)]
    totals = exposed(activities)
    assert totals == {"span": 35, "busy": 32, "communication": 22, "exposed": 12, "idle": 3}
    assert exposed([(0, 4, True), (1, 2, True)])["communication"] == 4  # overlaps count once
    assert exposed([])["exposed"] == 0


def test_device_activities_are_sorted_into_communication_and_compute():
    from hoccl.bench.train import is_communication
    for name in ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                 "hoccl_reduce_bfloat16_sum", "hoccl_copy_16", "Memcpy PtoP (Device -> Device)"):
        assert is_communication(name), name
    for name in ("ampere_bf16_s16816gemm_bf16_128x128", "Memcpy DtoD (Device -> Device)",
                 "void at::native::vectorized_elementwise_kernel<4>"):
        assert not is_communication(name), name


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_registered_tensors_through_the_backend_go_without_an_exchange(ranks):
    """``hoccl.torch.empty`` tensors: all_reduce, all_gather_into_tensor and
    reduce_scatter_tensor exact, and (but for the first reduction's scratch) issued without
    a descriptor exchange.  (``--device cuda`` adds CUDA graph replays.)"""
    code, output = launch(ranks, PROGRAMS / "run_registered.py")
    assert code == 0, output[-6000:]
    assert "registered torch: 2 passed, 0 failed" in output, output[-6000:]
