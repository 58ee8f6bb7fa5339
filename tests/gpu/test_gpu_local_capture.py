"""CUDA graphs captured by one process driving every visible GPU (init_local): each
rank's stream is captured at once (begin every capture, make the calls on every rank,
end the captures), the graphs are replayed with fresh inputs and poisoned outputs, and
every output is compared with numpy; eager calls between replays stay exact.  The calls
alone, and in one ``hoccl.group()``."""

import contextlib

import numpy as np
import pytest

import hoccl
from hoccl.testing import assert_exact

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

COUNT = 4099  # odd: no call is a whole number of any copy width


def _buffers(comm, registered):
    n = comm.world_size

    def make(count):
        if registered:
            return hoccl.empty(count, "float32", comm, framework="torch")
        return torch.empty(count, dtype=torch.float32, device=f"cuda:{comm.device}")
    return {"gather_in": make(COUNT), "gather_out": make(n * COUNT),
            "reduce": make(n * COUNT), "scatter_in": make(n * COUNT),
            "scatter_out": make(COUNT)}


def _load(comms, buffers, rng):
    n = len(comms)
    data = {name: [rng.integers(-50, 50, size).astype(np.float32) for _ in comms]
            for name, size in (("gather", COUNT), ("reduce", n * COUNT),
                               ("scatter", n * COUNT))}
    for rank, b in enumerate(buffers):
        b["gather_in"].copy_(torch.from_numpy(data["gather"][rank]))
        b["reduce"].copy_(torch.from_numpy(data["reduce"][rank]))
        b["scatter_in"].copy_(torch.from_numpy(data["scatter"][rank]))
        b["gather_out"].fill_(float("nan"))
        b["scatter_out"].fill_(float("nan"))
    for comm in comms:
        torch.cuda.synchronize(comm.device)
    return data


def _issue(comms, buffers, streams, grouped=False):
    with hoccl.group() if grouped else contextlib.nullcontext():
        _collectives(comms, buffers, streams)


def _collectives(comms, buffers, streams):
    for call in ("all_gather", "all_reduce", "reduce_scatter"):
        for comm, b, stream in zip(comms, buffers, streams):
            if call == "all_gather":
                comm.all_gather(b["gather_in"], b["gather_out"], stream=stream)
            elif call == "all_reduce":
                comm.all_reduce(b["reduce"], b["reduce"], "sum", stream=stream)
            else:
                comm.reduce_scatter(b["scatter_in"], b["scatter_out"], "sum", stream=stream)


def _check(buffers, data, what):
    for rank, b in enumerate(buffers):
        where = f"{what}, rank {rank}"
        assert_exact(f"{where} all_gather", np.concatenate(data["gather"]),
                     b["gather_out"].cpu().numpy())
        assert_exact(f"{where} all_reduce", np.sum(data["reduce"], axis=0),
                     b["reduce"].cpu().numpy())
        assert_exact(f"{where} reduce_scatter", np.sum(data["scatter"], axis=0)[
            rank * COUNT:(rank + 1) * COUNT], b["scatter_out"].cpu().numpy())


@pytest.mark.parametrize("registered,grouped", [(False, False), (True, False), (False, True)])
def test_graphs_captured_on_every_rank_of_one_process_replay_exactly(gpu_comms, registered,
                                                                     grouped):
    comms = gpu_comms
    rng = np.random.default_rng()
    buffers = [_buffers(comm, registered) for comm in comms]
    eager = [_buffers(comm, False) for comm in comms]
    streams = [torch.cuda.Stream(device=comm.device) for comm in comms]
    graphs = [torch.cuda.CUDAGraph() for _ in comms]
    _load(comms, buffers, rng)
    for graph, stream, comm in zip(graphs, streams, comms):
        with torch.cuda.device(comm.device), torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
    try:
        _issue(comms, buffers, streams, grouped)
    finally:
        for graph, stream, comm in zip(graphs, streams, comms):
            with torch.cuda.device(comm.device), torch.cuda.stream(stream):
                graph.capture_end()
    for replay in range(30):
        data = _load(comms, buffers, rng)
        for graph in graphs:
            graph.replay()
        for comm in comms:
            torch.cuda.synchronize(comm.device)
        _check(buffers, data, f"replay {replay}")
        if replay % 10 == 3:
            data = _load(comms, eager, rng)
            _issue(comms, eager, [torch.cuda.current_stream(comm.device) for comm in comms])
            for comm in comms:
                comm.synchronize()
                torch.cuda.synchronize(comm.device)
            _check(eager, data, f"eager calls after replay {replay}")
