"""UCX between hosts (``inter_host="ucx"``, ``hoccl._hierarchy.ucx``) on CPUs, over
shared memory and TCP: the transport's collectives written once over pairwise messages
(``PairTransport``) checked member by member in one process; a peer that dies is reported
as PeerDeadError within the timeout.  The collectives, sends and receives, DDP, FSDP2,
HSDP and the pipelining schedules across simulated hosts with UCX run in
test_hierarchical_mpi.py, test_hierarchical_pairs.py, test_torch.py and
test_torch_pipeline.py.  Skipped where ucxx is not installed."""

import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from hoccl._hierarchy.transports import PairTransport

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = Path(__file__).parent / "mpi" / "run_ucx_peer_death.py"


class Wire(PairTransport):
    """A PairTransport between threads of this process: a message is copied into the
    receive whose (sender, receiver, sequence) it matches, whichever is posted first."""

    def __init__(self, hub, size, member):
        self.hub, self.size, self.member, self.label = hub, size, member, "wire"
        self.sent, self.received = [0] * size, [0] * size

    def _post(self, sends, recvs):
        request = []
        with self.hub["lock"]:
            for peer, buf in recvs:
                key = (peer, self.member, self.received[peer])
                self.received[peer] += 1
                box = self.hub.setdefault(key, {})
                box["recv"] = buf
                request.append(key)
            for peer, buf in sends:
                key = (self.member, peer, self.sent[peer])
                self.sent[peer] += 1
                self.hub.setdefault(key, {})["send"] = buf.copy()
        return request

    def test(self, request):
        with self.hub["lock"]:
            for key in list(request):
                box = self.hub[key]
                if "send" in box and "recv" in box:
                    box["recv"][...] = box["send"]
                    request.remove(key)
        return not request


def _run_members(size, step):
    """``step(transport)`` on ``size`` members, one thread each; their results."""
    hub = {"lock": threading.Lock()}
    results, errors = [None] * size, []

    def member(index):
        transport = Wire(hub, size, index)
        try:
            request, keep = step(transport)
            while not transport.test(request):
                pass
            results[index] = keep
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
    threads = [threading.Thread(target=member, args=(index,)) for index in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return results


def _bytes(rng, size, width):
    return [rng.integers(0, 256, width, dtype=np.uint8) for _ in range(size)]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_pairwise_steps_move_what_each_collective_moves(size):
    rng = np.random.default_rng(size)
    width = 13
    mine = _bytes(rng, size, width)
    blocks = [_bytes(rng, size, width) for _ in range(size)]  # blocks[sender][receiver]

    def poisoned(n):
        return np.full(n, 0xAB, np.uint8)

    gathered = _run_members(size, lambda t: (lambda out: (t.all_gather(mine[t.member], out), out))(
        poisoned(size * width)))
    for out in gathered:
        assert np.array_equal(out, np.concatenate(mine))
    exchanged = _run_members(size, lambda t: (lambda out: (t.all_to_all(
        np.concatenate(blocks[t.member]), out), out))(poisoned(size * width)))
    for receiver, out in enumerate(exchanged):
        assert np.array_equal(out, np.concatenate([blocks[s][receiver] for s in range(size)]))
    for root in range(size):
        def broadcast(t):
            buf = mine[root].copy() if t.member == root else poisoned(width)
            return t.broadcast(buf, root), buf
        assert all(np.array_equal(out, mine[root]) for out in _run_members(size, broadcast))

        def gather(t):
            out = poisoned(size * width) if t.member == root else None
            return t.gather(mine[t.member], out, root), out
        assert np.array_equal(_run_members(size, gather)[root], np.concatenate(mine))

        def scatter(t):
            out = poisoned(width)
            source = np.concatenate(blocks[root]) if t.member == root else None
            return t.scatter(source, out, root), out
        for receiver, out in enumerate(_run_members(size, scatter)):
            assert np.array_equal(out, blocks[root][receiver])
    # a send and a receive along a ring, then a barrier
    def ring(t):
        out = poisoned(width)
        request = t.send(mine[t.member], (t.member + 1) % size)
        request += t.recv(out, (t.member - 1) % size)
        return request, out
    for member, out in enumerate(_run_members(size, ring)):
        assert np.array_equal(out, mine[(member - 1) % size])
    assert _run_members(size, lambda t: (t.barrier(), True)) == [True] * size


@pytest.mark.parametrize("mode", ["watched", "all"])
@pytest.mark.parametrize("how", ["exit", "kill", "mid"])
def test_a_peer_that_dies_is_reported_as_peer_dead_within_the_timeout(how, mode):
    """Both ways of seeing a peer die: its process watched (a peer on this machine, whose
    endpoint uses shared memory) and UCX's peer-failure mode (HOCCL_UCX_PEER_FAILURE=all,
    as between machines)."""
    pytest.importorskip("ucxx")
    dist = pytest.importorskip("torch.distributed")
    # the store binds a free port itself (a port probed, then closed, may be taken
    # before the store binds it)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    port = store.port
    workers = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "HOCCL_UCX_PEER_FAILURE": "all" if mode == "all" else "",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        workers.append(subprocess.Popen([sys.executable, str(PROGRAM), "--how", how,
                                         "--timeout", "60"], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env))
    try:
        output = workers[0].communicate(timeout=120)[0]
        workers[1].wait(timeout=30)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    del store
    assert "peer death: rank 0 OK" in output, output[-4000:]
    assert "PeerDeadError after" in output and "rank 1" in output, output[-4000:]
    # the way asked for is the way taken (a CUDA build of UCX as well)
    assert f"rank 0: peers watched: {1 if mode == 'watched' else 0}" in output, output[-4000:]


def test_left_to_hoccl_ucx_joins_hosts_of_different_kinds_only_where_every_rank_loads_it():
    from hoccl._hierarchy.communicator import _default_engine
    from hoccl._hierarchy.hosts import HostReport
    gpu = HostReport("a", "cuda", "cuda", "cuda", "hoccl (cuda)")
    cpu = HostReport("b", "cpu", "host", "host", "hoccl (host)")
    asked = []

    def everywhere(answer):
        def ask():
            asked.append(answer)
            return answer
        return ask
    assert _default_engine([gpu, cpu], False, everywhere(True)) == "ucx"
    assert _default_engine([gpu, cpu], False, everywhere(False)) == "mpi"
    # simulated CPU hosts keep hoccl's own engine, and the ranks are not asked
    assert _default_engine([cpu, cpu], True, everywhere(True)) == "hoccl"
    assert asked == [True, False]


def test_only_peers_whose_processes_can_be_watched_do_without_the_failure_mode(monkeypatch):
    from hoccl._hierarchy.ucx import _boot_id, _watchable
    from hoccl._mailbox import _Process
    process, boot = me = (_Process.this(), _boot_id())
    monkeypatch.delenv("HOCCL_UCX_PEER_FAILURE", raising=False)
    if process.namespace is None or process.start is None or boot is None:
        pytest.skip("this machine shows no pid namespace, start time or boot id")
    assert _watchable(me, (process._replace(pid=process.pid + 1), boot), False)
    assert not _watchable(me, (process._replace(host=process.host + "-other"), boot), False)
    assert not _watchable(me, (process, boot + "-other"), False)  # another machine, same name
    assert not _watchable(me, (process._replace(namespace="pid:[1]"), boot), False)
    assert not _watchable(me, (process._replace(start=None), boot), False)
    assert not _watchable(me, me, True)  # UCX_TLS chose the transports: cma may be among them
    monkeypatch.setenv("HOCCL_UCX_PEER_FAILURE", "all")
    assert not _watchable(me, me, False)


def _stand_in_contexts(monkeypatch, cuda=(False,)):
    """Every ``_Worker`` made from here on gets a stand-in UCX context (``cuda[0]``: whether
    it has CUDA transports), UCX_TLS and HOCCL_UCX_TLS unset; returns the configurations
    the contexts were made with, in order."""
    from hoccl._hierarchy import ucx_worker
    made = []

    class Context:
        def __init__(self, config_dict, feature_flags):
            made.append(config_dict)
            self.features = feature_flags
            self.cuda_support = cuda[0]

    class Worker:
        def __init__(self, context):
            self.address = np.zeros(1, np.uint8)
            self.context, self.progress_thread = context, None

        def start_progress_thread(self, polling_mode, epoll_timeout):
            self.progress_thread = (polling_mode, epoll_timeout)

        def stop_progress_thread(self):
            self.progress_thread = None

    api = type("api", (), {"UCXContext": Context, "UCXWorker": Worker,
                           "Feature": ucx_worker._api()[0].Feature})
    monkeypatch.setattr(ucx_worker, "_api", lambda: (api, None))
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("HOCCL_UCX_TLS", raising=False)
    return made


def test_the_ucx_context_leaves_cross_memory_attach_off_unless_ucx_tls_chooses(monkeypatch):
    pytest.importorskip("ucxx")
    from hoccl._hierarchy import ucx
    monkeypatch.setattr(ucx._Worker, "_one", None)
    made = _stand_in_contexts(monkeypatch)
    assert not ucx._Worker().cma and made[-1] == {"TLS": "^cma"}
    monkeypatch.setenv("HOCCL_UCX_TLS", "^cuda_ipc")  # narrowed by hoccl: still no cma
    assert not ucx._Worker().cma and made[-1] == {"TLS": "^cuda_ipc,cma"}
    monkeypatch.setenv("HOCCL_UCX_TLS", "posix,cma,self,tcp")
    assert not ucx._Worker().cma and made[-1] == {"TLS": "posix,self,tcp"}
    monkeypatch.setenv("UCX_TLS", "sm,self")
    assert ucx._Worker().cma and made[-1] == {}
    assert ucx._Worker().failure_mode_only  # UCX_TLS chose: every endpoint in the mode


def test_a_context_with_cuda_transports_still_reaches_peers_on_the_machine_by_shared_memory(
        monkeypatch):
    """UCX built with CUDA (ucxx-cu13, whether or not a GPU is there) has CUDA transports in
    every context: peers on the machine are still watched, their endpoints out of UCX's
    peer-failure mode, which would leave them TCP (sendrecv 0.7 GB/s against 6.4 over
    shared memory, 64 MiB on a 2-core CPU machine)."""
    pytest.importorskip("ucxx")
    from hoccl._hierarchy import ucx
    made = _stand_in_contexts(monkeypatch, [True])
    worker = ucx._Worker()
    assert worker.cuda and not worker.failure_mode_only and made[-1] == {"TLS": "^cma"}
    me = (ucx._Process.this(), "boot")
    assert ucx._watchable(me, me, worker.failure_mode_only)


def test_ucx_is_progressed_by_its_own_thread_where_cores_allow(monkeypatch):
    """By default UCX's own thread progresses the worker where the process may run on 8
    cores or more, woken by the transports' events (the context asks for them) and at
    least every millisecond, and hoccl's waits do on fewer cores; ``caller`` and
    ``thread`` say which; ``polling`` spins the thread; another value is refused, naming
    the variable."""
    pytest.importorskip("ucxx")
    from hoccl._hierarchy import ucx_worker
    from hoccl._errors import InvalidArgumentError
    _stand_in_contexts(monkeypatch)
    feature = ucx_worker._api()[0].Feature
    monkeypatch.delenv("HOCCL_UCX_PROGRESS", raising=False)
    for cores, threaded in ((2, False), (7, False), (8, True), (64, True)):
        monkeypatch.setattr(ucx_worker, "_cores", lambda: cores)
        worker = ucx_worker._Worker()
        assert worker.threaded is threaded, cores
        assert (feature.WAKEUP in worker.context.features) is threaded
        worker._stop()
    assert ucx_worker._cores() >= 1
    monkeypatch.setattr(ucx_worker, "_cores", lambda: 64)
    monkeypatch.setenv("HOCCL_UCX_PROGRESS", "caller")
    worker = ucx_worker._Worker()
    assert not worker.threaded and worker.worker.progress_thread is None
    assert feature.WAKEUP not in worker.context.features
    monkeypatch.setenv("HOCCL_UCX_PROGRESS", "thread")
    worker = ucx_worker._Worker()
    assert worker.threaded and worker.worker.progress_thread == (False, 1)
    assert feature.WAKEUP in worker.context.features
    worker._stop()
    assert not worker.threaded and worker.worker.progress_thread is None
    monkeypatch.setenv("HOCCL_UCX_PROGRESS", "polling")
    worker = ucx_worker._Worker()
    assert worker.worker.progress_thread == (True, 1)
    assert feature.WAKEUP not in worker.context.features
    monkeypatch.setenv("HOCCL_UCX_PROGRESS", "sometimes")
    with pytest.raises(InvalidArgumentError, match="HOCCL_UCX_PROGRESS: expected caller, "
                                                   "thread or polling; got 'sometimes'"):
        ucx_worker._Worker()


#: the staged engine's chunk in the all_reduce checks: float32 chunks of 512 elements
_STAGE_BYTES = 4096
_COUNTS = (1, 7, 511, 513, 5003, 40_001)


def _all_reduce_cases():
    """(dtype, op, in place, count) of every check, the same on both members."""
    kinds = [("float32", op) for op in ("sum", "max", "prod", "avg", "min")]
    kinds += [("bfloat16", "sum"), ("bfloat16", "max"), ("int32", "sum"), ("int32", "prod")]
    return [(dtype, op, in_place, count) for dtype, op in kinds for in_place in (False, True)
            for count in _COUNTS]


def _member_input(case, member, dtype, count):
    """Member ``member``'s input of check ``case`` (any member can make every member's)."""
    from hoccl._dtypes import numpy_dtype
    rng = np.random.default_rng([case, member])
    if dtype == "int32":
        return rng.integers(-1000, 1000, count, dtype=np.int32)
    values = rng.uniform(-2, 2, count).astype(np.float32)
    return values if dtype == "float32" else values.astype(numpy_dtype("bfloat16"))


@pytest.mark.parametrize("peer,progress", [("folds as exchanged", "caller"),
                                           ("folds as exchanged", "thread"),
                                           ("gathers then folds", "caller"),
                                           ("gathers then folds", "polling"),
                                           ("device memory", "caller")])
def test_two_hosts_all_reduce_over_ucx_folds_each_chunk_exact(peer, progress):
    """The rail engine's all_reduce between two simulated hosts in host memory, many chunks
    (``stage_bytes`` 4 KiB) each folded in pieces of 1000 bytes: exact against
    ``reduce_arrays`` in place and out of place, for every dtype and op.  ``gathers then
    folds``: member 0 posts the messages of the staged engine's all_gather, as a GPU member
    does, and member 1 folds as they come; ``device memory``: member 0 hands its arrays to
    UCX as ``HOCCL_UCX_DEVICE_MEMORY=1`` hands CUDA arrays (CPU tensors stand in for them
    here), and its messages must still be a staged member's.  ``progress``: who progresses
    UCX's worker (``HOCCL_UCX_PROGRESS``), checked in each member."""
    pytest.importorskip("ucxx")
    dist = pytest.importorskip("torch.distributed")
    # the store binds a free port itself (a port probed, then closed, may be taken
    # before the store binds it)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    port = store.port
    workers = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "HOCCL_UCX_PEER_FAILURE": "",
               "HOCCL_UCX_PROGRESS": progress,
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        workers.append(subprocess.Popen([sys.executable, __file__, peer], env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        outputs = [worker.communicate(timeout=240)[0] for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    del store
    for rank, output in enumerate(outputs):
        assert f"all_reduce: rank {rank} OK" in output, output[-4000:]


def _all_reduce_member(peer):
    """One member of ``test_two_hosts_all_reduce_over_ucx_folds_each_chunk_exact``."""
    import torch
    import torch.distributed as dist

    import hoccl
    from hoccl._dtypes import reduce_arrays
    from hoccl._hierarchy import ucx
    from hoccl._hierarchy.staged import StagedEngine
    from hoccl.torch import StoreBootstrap
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2,
                          is_master=False, timeout=timedelta(seconds=60))
    comm = hoccl.init(backend="host", bootstrap=StoreBootstrap(store, rank, 2), local_size=1,
                      inter_host="ucx", timeout=60, stage_bytes=_STAGE_BYTES)
    engine = comm._levels["rail"]
    assert isinstance(engine, ucx.UcxStagedEngine) and engine.size == 2
    worker = engine.transport._worker
    threaded = os.environ["HOCCL_UCX_PROGRESS"] != "caller"
    assert worker.threaded == threaded
    ucx._FOLD_PIECE_BYTES = 1000
    device_memory = peer == "device memory" and rank == 0
    if peer != "folds as exchanged":
        engine.direct = False  # both cut as beside a member that stages
        if rank == 0:
            engine.all_reduce = lambda send, recv, op: StagedEngine.all_reduce(engine, send,
                                                                               recv, op)
    if device_memory:  # its arrays taken for device arrays, its stream always reached
        engine.device_memory, engine._on_host = True, lambda arrays: False
        engine.device = type("Device", (), {"resolve_stream": lambda self, stream, arrays: 0,
                                            "synchronize_stream": lambda self, s, t: None})()
        # UCX takes a CUDA tensor as it is, a CPU tensor through numpy
        ucx._byte_view = lambda array: None if array is None else \
            array.view(torch.uint8).numpy()
    problems = []
    for case, (dtype, op, in_place, count) in enumerate(_all_reduce_cases()):
        inputs = [_member_input(case, member, dtype, count) for member in range(2)]
        want = reduce_arrays(inputs, op, inputs[0].dtype)
        mine = inputs[rank].copy()
        if dtype == "bfloat16":  # a torch CPU tensor
            send = torch.from_numpy(mine.view(np.int16)).view(torch.bfloat16)
            recv = send if in_place else torch.full((count,), float("nan"), dtype=torch.bfloat16)
            got = lambda: recv.view(torch.int16).numpy().view(np.uint16)  # noqa: E731
        else:
            send = mine
            recv = send if in_place else np.full(count, -7, mine.dtype)
            if dtype == "float32" and not in_place:
                recv[:] = np.nan
            got = lambda: recv.view(np.uint32)  # noqa: E731
        if device_memory and isinstance(send, np.ndarray):
            engine.all_reduce(torch.from_numpy(send), torch.from_numpy(recv), op)
        else:
            engine.all_reduce(send, recv, op)
        if not np.array_equal(got(), want.view(got().dtype)):
            problems.append(f"{dtype} {op} {'in place' if in_place else 'out of place'} "
                            f"{count}: {np.count_nonzero(got() != want.view(got().dtype))} "
                            f"elements differ")
        if not in_place and not np.array_equal(mine, inputs[rank]):
            problems.append(f"{dtype} {op} {count}: the send buffer changed")
    comm.close()
    for problem in problems:
        print(f"rank {rank} FAILED: {problem}", flush=True)
    print(f"all_reduce: rank {rank} {'FAILED' if problems else 'OK'}", flush=True)
    os._exit(1 if problems else 0)


if __name__ == "__main__":
    _all_reduce_member(sys.argv[1])


def test_a_wait_for_a_stage_copy_progresses_ucx():
    """A GPU member waits for each chunk's copy out before it posts the chunk: meanwhile
    the chunks it posted before move only if the wait progresses the worker, which it
    does (the default progress mode)."""
    from hoccl._hierarchy.ucx import UcxStagedEngine

    class Worker:
        progressed = 0

        def progress(self):
            self.progressed += 1

    class Transport:
        size, member, label = 2, 0, "ucx"
        _worker = Worker()

    class Copy:
        polls = 0

        def done(self, event):
            self.polls += 1
            return self.polls > 3

    engine = UcxStagedEngine(Transport(), None, 5.0, 4096)
    copy = Copy()
    engine._copied(copy, object(), "all_gather (copy out)")
    assert copy.polls == 4 and Transport._worker.progressed == 4
