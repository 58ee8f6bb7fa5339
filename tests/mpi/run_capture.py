"""Calls captured into CUDA graphs, under mpirun: ``mpiexec -n N python run_capture.py
[--backend cuda|host] [--replays 1000]``.

On the cuda backend, one graph (torch.cuda.graph) holds an in-place all_gather, an
all_reduce, a reduce_scatter and an all_to_all on registered buffers, a second graph
an all_gather on unregistered buffers (its descriptors exchanged at capture), and a
third a broadcast, a reduce, a gather, a scatter and a ring of send/recv (in a
``hoccl.group()``); each graph
is replayed ``--replays`` times with fresh inputs written before every replay, every
output checked against numpy after every replay, and an eager all_gather and all_reduce
on the same communicator between replays (checked too).  Then one rank captures while
the other calls eagerly: both must raise (``MismatchError``), none may hang.  One rank
alone (``python run_capture.py``) has no ring and no peer to diverge from: the replays
only.

On the host backend (no graphs there) ``capturing`` is forced on: every call is issued
the way a captured one is (graph slots reset after their last wait, no signal base, no
completion value, lanes of their own joined back to the caller), and the same bound
steps are issued again for each "replay": the signal protocol a replay relies on, run
with real cross-process copies and signals.

Rank 0 prints ``capture: N passed, M failed``; the exit status is non-zero on a failure.
"""

import argparse
import sys
import traceback

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import assert_exact

WORLD = MPI.COMM_WORLD


class Arrays:
    """float32 arrays for one backend: numpy (host) or torch (cuda); ``registered`` ones
    from hoccl.empty."""

    def __init__(self, comm):
        self.comm, self.cuda = comm, comm.backend == "cuda"

    def empty(self, count, registered):
        if registered:
            return hoccl.empty(count, "float32", self.comm,
                               framework="torch" if self.cuda else "numpy")
        if self.cuda:
            import torch
            return torch.empty(count, dtype=torch.float32, device=f"cuda:{self.comm.device}")
        return np.empty(count, np.float32)

    def fill(self, array, values):
        if self.cuda:
            import torch
            array.copy_(torch.from_numpy(np.ascontiguousarray(values)))
        else:
            array[...] = values

    def get(self, array):
        return array.cpu().numpy() if self.cuda else np.array(array)


class Scene:
    """The buffers and the calls of one graph, and what each call must produce."""

    def __init__(self, comm, arrays, count, registered, calls):
        n = comm.world_size
        self.comm, self.arrays, self.count, self.calls = comm, arrays, count, calls
        self.gather = arrays.empty(n * count, registered)
        self.reduce = arrays.empty(n * count, registered)
        self.scatter_in = arrays.empty(n * count, registered)
        self.scatter_out = arrays.empty(count, registered)
        self.a2a_in = arrays.empty(n * count, registered)
        self.a2a_out = arrays.empty(n * count, registered)

    def inputs(self, step):
        """Every rank's inputs for replay ``step`` (each rank draws everyone's)."""
        n, count = self.comm.world_size, self.count
        rng = np.random.default_rng([step, 7])
        # small integers: sums exact in float32 in any order
        return {name: [rng.integers(-8, 8, size=n * count).astype(np.float32)
                       for _ in range(n)] for name in ("gather", "reduce", "scatter", "a2a")}

    def load(self, data):
        n, r, count, a = self.comm.world_size, self.comm.rank, self.count, self.arrays
        gather = np.full(n * count, np.nan, np.float32)
        gather[r * count:(r + 1) * count] = data["gather"][r][:count]
        a.fill(self.gather, gather)
        a.fill(self.reduce, data["reduce"][r])
        a.fill(self.scatter_in, data["scatter"][r])
        a.fill(self.scatter_out, np.full(count, np.nan, np.float32))
        a.fill(self.a2a_in, data["a2a"][r])
        a.fill(self.a2a_out, np.full(n * count, np.nan, np.float32))

    def issue(self):
        comm, r, count = self.comm, self.comm.rank, self.count
        if "all_gather" in self.calls:
            comm.all_gather(self.gather[r * count:(r + 1) * count], self.gather)
        if "all_reduce" in self.calls:
            comm.all_reduce(self.reduce, self.reduce, "sum")
        if "reduce_scatter" in self.calls:
            comm.reduce_scatter(self.scatter_in, self.scatter_out, "sum")
        if "all_to_all" in self.calls:
            comm.all_to_all(self.a2a_in, self.a2a_out)

    def check(self, data, what):
        r, count, a = self.comm.rank, self.count, self.arrays
        if "all_gather" in self.calls:
            assert_exact(f"{what} all_gather", np.concatenate(
                [d[:count] for d in data["gather"]]), a.get(self.gather))
        if "all_reduce" in self.calls:
            assert_exact(f"{what} all_reduce", np.sum(data["reduce"], axis=0, dtype=np.float32),
                         a.get(self.reduce))
        if "reduce_scatter" in self.calls:
            assert_exact(f"{what} reduce_scatter", np.sum(data["scatter"], axis=0,
                         dtype=np.float32)[r * count:(r + 1) * count], a.get(self.scatter_out))
        if "all_to_all" in self.calls:
            assert_exact(f"{what} all_to_all", np.concatenate(
                [d[r * count:(r + 1) * count] for d in data["a2a"]]), a.get(self.a2a_out))


class Rooted:
    """broadcast (root 0), reduce (last rank), gather (root 0), scatter (last rank) and a
    ring of send/recv (inside hoccl.group()), on unregistered buffers."""

    calls = ("broadcast", "reduce", "gather", "scatter", "send_recv")

    def __init__(self, comm, arrays, count):
        n = comm.world_size
        self.comm, self.arrays, self.count = comm, arrays, count
        self.names = {"bcast": count, "red_in": count, "red_out": count, "gath_in": count,
                      "gath_out": n * count, "scat_in": n * count, "scat_out": count,
                      "send": count, "recv": count}
        self.buffers = {name: arrays.empty(size, False) for name, size in self.names.items()}

    def inputs(self, step):
        n, count = self.comm.world_size, self.count
        rng = np.random.default_rng([step, 11])
        return {name: [rng.integers(-8, 8, size=n * count).astype(np.float32)
                       for _ in range(n)] for name in ("bcast", "red", "gath", "scat", "ring")}

    def load(self, data):
        r, count, a, b = self.comm.rank, self.count, self.arrays, self.buffers
        nan = np.float32("nan")
        a.fill(b["bcast"], data["bcast"][r][:count] if r == 0 else np.full(count, nan))
        a.fill(b["red_in"], data["red"][r][:count])
        a.fill(b["red_out"], np.full(count, nan))
        a.fill(b["gath_in"], data["gath"][r][:count])
        a.fill(b["gath_out"], np.full(len(data["gath"][r]), nan))
        a.fill(b["scat_in"], data["scat"][r])
        a.fill(b["scat_out"], np.full(count, nan))
        a.fill(b["send"], data["ring"][r][:count])
        a.fill(b["recv"], np.full(count, nan))

    def issue(self):
        comm, b = self.comm, self.buffers
        n, r = comm.world_size, comm.rank
        comm.broadcast(b["bcast"], b["bcast"], 0)
        comm.reduce(b["red_in"], b["red_out"], n - 1, "sum")
        comm.gather(b["gath_in"], b["gath_out"], 0)
        comm.scatter(b["scat_in"], b["scat_out"], n - 1)
        if n > 1:  # (a world of one has no peer to send to)
            with hoccl.group():  # a ring: each rank's send and recv side by side
                comm.send(b["send"], (r + 1) % n)
                comm.recv(b["recv"], (r - 1) % n)

    def check(self, data, what):
        n, r, count, a, b = self.comm.world_size, self.comm.rank, self.count, self.arrays, \
            self.buffers
        assert_exact(f"{what} broadcast", data["bcast"][0][:count], a.get(b["bcast"]))
        if r == n - 1:
            assert_exact(f"{what} reduce", np.sum([d[:count] for d in data["red"]], axis=0,
                                                  dtype=np.float32), a.get(b["red_out"]))
        if r == 0:
            assert_exact(f"{what} gather", np.concatenate([d[:count] for d in data["gath"]]),
                         a.get(b["gath_out"]))
        assert_exact(f"{what} scatter", data["scat"][n - 1][r * count:(r + 1) * count],
                     a.get(b["scat_out"]))
        if n > 1:
            assert_exact(f"{what} recv", data["ring"][(r - 1) % n][:count], a.get(b["recv"]))


class Capture:
    """A graph of ``scene.issue()``: torch.cuda.graph on cuda; on the host backend the
    calls issued as captured ones, again at every replay."""

    def __init__(self, comm, scene):
        self.comm, self.scene = comm, scene
        if comm.backend == "cuda":
            import torch
            self.stream = torch.cuda.Stream(device=comm.device)
            self.graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(comm.device)
            with torch.cuda.graph(self.graph, stream=self.stream):
                scene.issue()
        else:
            self.device = comm._engine.device
            self.replay()  # the capture: issued as captured calls (they run at once)

    def replay(self):
        if self.comm.backend == "cuda":
            self.graph.replay()
            return
        self.device.capturing = lambda stream: True
        try:
            self.scene.issue()
        finally:
            del self.device.capturing


def synchronize(comm):
    """Wait for the caller's stream (a replay is not a call the communicator counts), then
    for the communicator's own calls."""
    if comm.backend == "cuda":
        import torch
        torch.cuda.synchronize(comm.device)
    else:
        device = comm._engine.device
        device.synchronize_stream(device.default_stream, 30)
    comm.synchronize()


def replays(comm, args):
    arrays = Arrays(comm)
    everything = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
    registered = Scene(comm, arrays, 1000, True, everything)
    unregistered = Scene(comm, arrays, 777, False, ("all_gather",))
    rooted = Rooted(comm, arrays, 555)
    eager = Scene(comm, arrays, 333, False, ("all_gather", "all_reduce"))
    graphs = [(registered, None), (unregistered, None), (rooted, None)]
    for index, (scene, _) in enumerate(graphs):
        scene.load(scene.inputs(10 ** 7 + index))
        synchronize(comm)
        graphs[index] = (scene, Capture(comm, scene))
    synchronize(comm)
    for step in range(args.replays):
        for index, (scene, graph) in enumerate(graphs):
            data = scene.inputs(3 * step + index)
            scene.load(data)
            graph.replay()
            synchronize(comm)
            scene.check(data, f"replay {step} of graph {index}: rank {comm.rank}")
        if step % 10 == 0:  # eager calls between replays, on the same communicator
            data = eager.inputs(10 ** 6 + step)
            eager.load(data)
            eager.issue()
            synchronize(comm)
            eager.check(data, f"eager call after replay {step}: rank {comm.rank}")
    return (f"{args.replays} replays of 3 graphs (11 calls), {args.replays // 10} eager "
            f"rounds")


def capture_on_one_rank(comm, args):
    """Rank 0 captures an all_gather while the others call it eagerly: every rank raises
    (the calls' signatures differ by the capture), within the timeout."""
    text = None
    try:  # the setup too: a rank that failed here and left out the gather below would
        # hang the others in it
        arrays = Arrays(comm)
        scene = Scene(comm, arrays, 64, True, ("all_gather",))
        scene.load(scene.inputs(0))
        synchronize(comm)
    except Exception as error:
        text = f"unexpected in the setup: {type(error).__name__}: {error}"
    # no rank makes the diverging calls before every rank's setup is done: rank 0's abort
    # would otherwise reach a slow rank in its setup
    WORLD.Barrier()
    if text is None:
        try:
            if comm.rank == 0:
                Capture(comm, scene)
                comm.synchronize()
            else:
                scene.issue()
                synchronize(comm)
        except (hoccl.MismatchError, hoccl.AbortedError) as error:
            text = str(error)
        except Exception as error:  # reported below, after every rank has reached the gather
            text = f"unexpected {type(error).__name__}: {error}"
    # every rank reaches this gather (an MPI collective one rank left out would hang)
    kinds = WORLD.allgather(text)
    assert not [kind for kind in kinds if kind and kind.startswith("unexpected in the setup")], \
        kinds
    assert text is not None, f"rank {comm.rank}: a capture on rank 0 only raised nothing"
    assert not text.startswith("unexpected"), text
    assert any("captured=True" in kind for kind in kinds if kind), kinds
    return "raised on every rank"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--replays", type=int, default=1000)
    parser.add_argument("--pull-bytes", type=int, default=0,
                        help="Options.pull_bytes: captured reductions read the peers' inputs")
    parser.add_argument("--kernel-bytes", type=int, default=0,
                        help="Options.kernel_bytes: captured calls run as direct kernels")
    args = parser.parse_args()
    results = []
    checks = [("replays", replays), ("capture on one rank", capture_on_one_rank)]
    if WORLD.size == 1:  # one rank of one: nothing to diverge from
        checks = checks[:1]
    for name, check in checks:
        comm = hoccl.init(backend=args.backend, timeout=30)
        if args.pull_bytes:
            comm.set_options(pull_bytes=args.pull_bytes)
        if args.kernel_bytes:
            comm.set_options(kernel_bytes=args.kernel_bytes)
        try:
            outcome, ok = check(comm, args), True
        except Exception:
            outcome, ok = None, False
            print(f"rank {comm.rank} FAILED {name}\n{traceback.format_exc()}", flush=True)
        comm.close()
        ok = WORLD.allreduce(ok, op=MPI.LAND)
        results.append(ok)
        if WORLD.rank == 0:
            print(f"{'ok    ' if ok else 'FAILED'} {name}{f': {outcome}' if outcome else ''}",
                  flush=True)
    failed = results.count(False)
    if WORLD.rank == 0:
        print(f"capture: {len(results) - failed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
