"""The staged engine between hosts, on CPU: its device pipeline (copy out on one lane,
transfer, copy in on another, two pinned slots, chunks of ``stage_bytes``) through a
device whose copies run only when the engine waits for an event recorded after them
(``LazyDevice``: a copy the engine forgot to wait for is missing, not early), and a
transport of two members in one process (``Wire``); every copy and the reductions by
hoccl's rule (``FoldingEngine``) bit for bit against numpy, outputs poisoned first.
The fold of a reduction is enqueued on the caller's stream, as on a GPU.  Batches of
sends and receives (``BatchingStagedEngine``) both ways at once, staged, mixed and
direct, in chunks."""

from __future__ import annotations

import ctypes
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hoccl._dtypes import reduce_arrays
from hoccl._errors import AbortedError, HocclError
from hoccl._hierarchy.folding import fold
from hoccl._hierarchy.staged import BatchingStagedEngine, StagedEngine, Transport
from hoccl.testing import poison, random_array

SIZE = 2


class LazyStream:
    handles = itertools.count(100)  # raw handles of the streams a LazyDevice makes

    def __init__(self):
        self.work, self.ran = [], 0
        self.handle = next(self.handles)

    def __int__(self):
        return self.handle

    def run_until(self, upto):
        while self.ran < upto:
            self.ran += 1
            self.work[self.ran - 1]()


class LazyDevice:
    """hoccl's device interface as the staged engine uses it; work runs when waited for."""

    def __init__(self):
        self.caller = LazyStream()
        self.streams = {7: self.caller}  # the caller's stream is 7

    def activate(self):
        pass

    def resolve_stream(self, stream, arrays):
        assert stream in self.streams, "the engine passes a raw handle of a known stream"
        return self.streams[stream]

    def create_stream(self):
        stream = LazyStream()
        self.streams[stream.handle] = stream
        return stream

    def destroy_stream(self, stream):
        pass

    def create_event(self):
        return {}

    def destroy_event(self, event):
        pass

    def record(self, stream, event):
        event.update(stream=stream, upto=len(stream.work))

    def wait_event(self, stream, event):
        target, upto = event["stream"], event["upto"]
        stream.work.append(lambda: target.run_until(upto))

    def done(self, event):
        event["stream"].run_until(event["upto"])
        return True

    def copy(self, stream, dst, src, nbytes):
        stream.work.append(lambda: ctypes.memmove(dst, src, nbytes))

    def synchronize_stream(self, stream, timeout):
        stream.run_until(len(stream.work))


class Wire:
    """The members' steps, matched by their sequence numbers; a step runs when every
    member has started it."""

    def __init__(self):
        self.lock, self.posted, self.done = threading.Lock(), {}, set()

    def post(self, seq, member, kind, args):
        with self.lock:
            self.posted.setdefault(seq, {})[member] = (kind, args)
            if len(self.posted[seq]) == SIZE:
                self._run(self.posted.pop(seq))
                self.done.add(seq)

    @staticmethod
    def _run(steps):
        kind = steps[0][0]
        args = [steps[m][1] for m in range(SIZE)]
        # (a member that says own=False fills its own block itself: the wire leaves it)
        if kind == "all_gather":
            for m, (_, recv, own) in enumerate(args):
                for i, (piece, (send, _, _)) in enumerate(zip(_pieces(recv), args)):
                    if own or i != m:
                        piece[...] = send
        elif kind == "all_to_all":
            for i in range(SIZE):
                for j in range(SIZE):
                    if args[j][2] or i != j:
                        _pieces(args[j][1])[i][...] = _pieces(args[i][0])[j]
        elif kind == "broadcast":
            root = args[0][1]
            for buf, _ in args:
                if buf is not args[root][0]:
                    buf[...] = args[root][0]
        elif kind == "gather":
            root = args[0][2]
            args[root][1][...] = np.concatenate([a[0] for a in args])
        elif kind == "scatter":
            root = args[0][2]
            width = args[0][1].size
            for m in range(SIZE):
                args[m][1][...] = args[root][0][m * width:(m + 1) * width]
        elif kind == "pair":
            sender = next(m for m in range(SIZE) if args[m][1] == "send")
            args[1 - sender][0][...] = args[sender][0]


def _pieces(array):
    """A member's pieces of a step: a list of one byte array per member (a transport
    that takes ``blocks``), or a block-major array's equal parts."""
    if isinstance(array, list):
        return array
    width = array.size // SIZE
    return [array[i * width:(i + 1) * width] for i in range(SIZE)]


class WireTransport(Transport):
    def __init__(self, wire, member, blocks=()):
        self.wire, self.member, self.size, self.label, self.seq = wire, member, SIZE, "wire", 0
        self.blocks = blocks

    def _post(self, kind, *args):
        self.seq += 1
        self.wire.post(self.seq, self.member, kind, args)
        return self.seq

    def all_gather(self, send, recv, own=True):
        return self._post("all_gather", send, recv, own)

    def all_to_all(self, send, recv, own=True):
        return self._post("all_to_all", send, recv, own)

    def broadcast(self, buf, root):
        return self._post("broadcast", buf, root)

    def gather(self, send, recv, root):
        return self._post("gather", send, recv, root)

    def scatter(self, send, recv, root):
        return self._post("scatter", send, recv, root)

    def send(self, buf, peer):
        return self._post("pair", buf, "send")

    def recv(self, buf, peer):
        return self._post("pair", buf, "recv")

    def barrier(self):
        return self._post("barrier")

    def test(self, request):
        return request in self.wire.done


class StagedOnLazyDevice(StagedEngine):
    """Every array counts as device memory; folds are enqueued on the caller's stream."""

    name = "lazy"
    handle = 7  #: the caller's stream

    @classmethod
    def transports(cls, setup):
        raise NotImplementedError

    @staticmethod
    def _on_host(arrays):
        return False

    @staticmethod
    def pinned(nbytes):
        return np.empty(nbytes, np.uint8)

    @staticmethod
    def unpinned(memory):
        pass

    def folding(self, parts, out, op, stream):
        if stream is None:  # a member on the host folds at once
            fold(parts, out, op)
            return
        self.device.resolve_stream(stream, []).work.append(lambda: fold(parts, out, op))


class StagedOnHost(StagedOnLazyDevice):
    """A member whose arrays are in host memory (hoccl's host backend): no stage, but
    the same chunks as its peer's."""

    handle = None  # the host backend takes no stream

    @staticmethod
    def _on_host(arrays):
        return True


def _engines(stage_bytes, members):
    """``members``: "device" (both staged), "mixed" (member 0 in host memory, copied
    through slots), "mixed, lists" (the same over a transport that takes a member's
    blocks as a list, as MPI's does: member 0 moves its own arrays) or "direct" (both on
    the host backend: the transport moves the arrays themselves)."""
    wire = Wire()
    kinds = [StagedOnHost if members == "direct" or (members.startswith("mixed") and m == 0)
             else StagedOnLazyDevice for m in range(SIZE)]
    blocks = ("all_gather", "all_to_all") if members.endswith("lists") else ()
    return [kind(WireTransport(wire, m, blocks), LazyDevice(), 10.0, stage_bytes,
                 members == "direct") for m, kind in enumerate(kinds)]


def _both(engines, step):
    """``step(member, engine)`` on both members at once; then each caller's stream runs."""
    with ThreadPoolExecutor(SIZE) as pool:
        for future in [pool.submit(step, m, e) for m, e in enumerate(engines)]:
            future.result()
    for engine in engines:
        engine.device.synchronize_stream(engine.device.caller, 1.0)


def _same(what, want, got):
    assert np.array_equal(want.view(np.uint8), got.view(np.uint8)), f"{what}: {got} != {want}"


@pytest.mark.parametrize("stage_bytes", [6, 64, 1 << 20])
@pytest.mark.parametrize("dtype,members", [("bfloat16", "device"), ("float16", "mixed"),
                                           ("int32", "device"), ("int32", "mixed"),
                                           ("bfloat16", "mixed, lists"),
                                           ("int32", "mixed, lists"), ("bfloat16", "direct")])
def test_every_step_of_the_staged_pipeline_matches_numpy(stage_bytes, dtype, members):
    """``members`` (``_engines``): both staged, one in host memory, or both direct."""
    rng = np.random.default_rng()
    engines = _engines(stage_bytes, members)
    count = 13
    data = [random_array(rng, SIZE * count, dtype) for _ in range(SIZE)]

    def outputs(n):
        return [poison(n, dtype) for _ in range(SIZE)]

    recv = outputs(SIZE * count)
    _both(engines, lambda m, e: e.all_gather(data[m][:count], recv[m], stream=e.handle))
    for m in range(SIZE):
        _same("all_gather", np.concatenate([d[:count] for d in data]), recv[m])

    recv = outputs(SIZE * count)
    _both(engines, lambda m, e: e.all_to_all(data[m], recv[m], stream=e.handle))
    for m in range(SIZE):
        _same("all_to_all", np.concatenate([d[m * count:(m + 1) * count] for d in data]),
              recv[m])

    for root in range(SIZE):
        recv = outputs(count)
        _both(engines, lambda m, e: e.broadcast(data[m][:count], recv[m], root, stream=e.handle))
        for m in range(SIZE):
            _same("broadcast", data[root][:count], recv[m])
        recv = outputs(SIZE * count)
        _both(engines, lambda m, e: e.gather(data[m][:count], recv[m] if m == root else None,
                                             root, stream=e.handle))
        _same("gather", np.concatenate([d[:count] for d in data]), recv[root])
        recv = outputs(count)
        _both(engines, lambda m, e: e.scatter(data[m] if m == root else None, recv[m], root,
                                              stream=e.handle))
        for m in range(SIZE):
            _same("scatter", data[root][m * count:(m + 1) * count], recv[m])

    recv = outputs(count)
    _both(engines, lambda m, e: (e.send(data[m][:count], 1, stream=e.handle) if m == 0
                                 else e.recv(recv[m], 0, stream=e.handle)))
    _same("send/recv", data[0][:count], recv[1])

    for op in ("sum", "prod", "max"):
        recv = outputs(count)
        _both(engines, lambda m, e: e.reduce_scatter(data[m], recv[m], op, stream=e.handle))
        for m in range(SIZE):
            want = reduce_arrays([d[m * count:(m + 1) * count] for d in data], op, data[0].dtype)
            _same(f"reduce_scatter {op}", want, recv[m])
        recv = outputs(count)  # 13 elements: a shard of 6 per member and a remainder of 1
        _both(engines, lambda m, e: e.all_reduce(data[m][:count], recv[m], op, stream=e.handle))
        want = reduce_arrays([d[:count] for d in data], op, data[0].dtype)
        for m in range(SIZE):
            _same(f"all_reduce {op}", want, recv[m])
        in_place = [d[:count].copy() for d in data]
        _both(engines, lambda m, e: e.all_reduce(in_place[m], in_place[m], op, stream=e.handle))
        for m in range(SIZE):
            _same(f"all_reduce {op} in place", want, in_place[m])
        recv = outputs(count)
        _both(engines, lambda m, e: e.reduce(data[m][:count], recv[m] if m == 1 else None, 1,
                                             op, stream=e.handle))
        _same(f"reduce {op}", want, recv[1])


class FailingTransport(WireTransport):
    """A transport whose steps fail when tested, as a cross-memory read of a peer that
    is gone does (``HocclError``)."""

    def test(self, request):
        raise HocclError("process_vm_readv: moving 8 bytes with process 1 failed: No such "
                         "process (errno 3); the peer process is gone")


@pytest.mark.parametrize("members", ["device", "direct"])
def test_a_step_whose_transport_fails_refuses_the_calls_after_it(members):
    """The failure reaches the caller, and the engine takes no more calls: its transport
    was left in the middle of a step."""
    engine = _engines(64, members)[0]
    engine.transport = FailingTransport(Wire(), 0)
    data, out = np.arange(8, dtype=np.int32), poison(8 * SIZE, "int32")
    with pytest.raises(HocclError, match="peer process is gone"):
        engine.all_gather(data, out, stream=engine.handle)
    with pytest.raises(AbortedError, match="takes no more calls: all_gather failed"):
        engine.all_gather(data, out, stream=engine.handle)


def test_a_copy_the_engine_did_not_wait_for_is_missing_on_the_lazy_device():
    """The checker's model holds: a copy enqueued and never waited for does not happen."""
    device = LazyDevice()
    lane = device.create_stream()
    source, target = np.arange(4, dtype=np.int32), np.zeros(4, np.int32)
    device.copy(lane, target.ctypes.data, source.ctypes.data, source.nbytes)
    assert not target.any()
    event = device.create_event()
    device.record(lane, event)
    assert device.done(event) and np.array_equal(target, source)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8", "uint8",
                                   "int32", "int64"])
def test_the_device_fold_in_torch_computes_the_rules_bits(dtype):
    """The torch operations a device runs for ``fold`` (float32 accumulator for 16-bit
    floats, member order, one rounding), run here on CPU tensors, give numpy's
    ``reduce_arrays`` bit for bit."""
    torch = pytest.importorskip("torch")
    from hoccl._hierarchy.folding import _fold_on_device, _to_numpy
    rng = np.random.default_rng()
    parts = [random_array(rng, 257, dtype) for _ in range(5)]

    def tensor(array):
        if dtype == "bfloat16":
            return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(array.copy())
    for op in ("sum", "prod", "max", "min"):
        out = tensor(poison(257, dtype))
        _fold_on_device("torch", [tensor(part) for part in parts], out, op)
        _same(f"fold {op}", reduce_arrays(parts, op, parts[0].dtype), _to_numpy(out))


@pytest.mark.parametrize("ready_given, done_given", [(False, False), (True, False),
                                                    (False, True), (True, True)])
def test_a_phase_on_the_engines_own_stream_between_two_on_the_callers(ready_given,
                                                                       done_given):
    """As a pipelined call runs it: the phase before writes the input on the caller's
    stream (lazily), the staged engine's phase runs on a stream of its own after the
    event ``ready`` (else after the caller's work so far), and the phase after reads
    the output on the caller's stream after the event ``done`` (else the engine orders
    the caller's stream after its work).  On the lazy device a wait left out leaves
    work undone: the result is only right when every hand-off is there."""
    from hoccl._hierarchy.engine import caller_begin, caller_end
    rng = np.random.default_rng()
    engines = _engines(5, "device")
    count = 11
    data = [random_array(rng, count, "float32") for _ in range(SIZE)]
    inputs = [poison(count, "float32") for _ in range(SIZE)]
    outputs = [poison(count, "float32") for _ in range(SIZE)]
    final = [poison(count, "float32") for _ in range(SIZE)]

    def phases(m, engine):
        device = engine.device
        ready = device.create_event() if ready_given else None
        done = device.create_event() if done_given else None
        # the phase before: its output lands when the caller's stream runs
        device.caller.work.append(lambda: inputs[m].__setitem__(Ellipsis, data[m]))
        caller_end(device, 7, 7, ready)
        work = engine.begin(device, 7, ready)
        assert work != 7
        engine.all_reduce(inputs[m], outputs[m], "sum", stream=work)
        engine.end(device, 7, work, done)
        # the phase after, on the caller's stream
        caller_begin(device, 7, done)
        device.caller.work.append(lambda: final[m].__setitem__(Ellipsis, outputs[m]))
    _both(engines, phases)
    want = reduce_arrays(data, "sum", data[0].dtype)
    for m in range(SIZE):
        _same("all_reduce between phases", want, final[m])


def test_a_copy_in_never_overtakes_the_work_before_it():
    """No chunk is copied in before the work already on the step's stream has run: that
    work may still read what the copies overwrite (a fold's inputs, scratch that the
    caching allocator hands out again on that stream).  Lane out waits for it, and the
    host copies a chunk in only after seeing its copy out done.  Here the caller's stream
    still has to read the old contents of the buffer the all_gather writes."""
    rng = np.random.default_rng()
    engines = _engines(4, "device")
    count = 6
    data = [random_array(rng, count, "int32") for _ in range(SIZE)]
    old = [random_array(rng, SIZE * count, "int32") for _ in range(SIZE)]
    recv = [o.copy() for o in old]
    seen = [None] * SIZE

    def step(m, engine):
        def read(m=m):
            seen[m] = recv[m].copy()
        engine.device.caller.work.append(read)  # enqueued before the all_gather
        engine.all_gather(data[m], recv[m], stream=engine.handle)
    _both(engines, step)
    for m in range(SIZE):
        _same("what the caller read", old[m], seen[m])
        _same("all_gather", np.concatenate(data), recv[m])


class BatchingOnLazyDevice(BatchingStagedEngine, StagedOnLazyDevice):
    """A staged member that takes batches of sends and receives."""


class BatchingOnHost(BatchingStagedEngine, StagedOnHost):
    """A member in host memory that takes batches of sends and receives."""


@pytest.mark.parametrize("stage_bytes", [6, 64, 1 << 20])
@pytest.mark.parametrize("members", ["device", "mixed", "direct"])
def test_a_batch_of_sends_and_receives_both_ways_matches_numpy(stage_bytes, members):
    """Each member sends the other two arrays (13 int32, 5 bfloat16) and receives two, in
    one batch each, in orders of their own: every receive holds the peer's bytes, the
    staged member's copies out and in ordered by their events (``LazyDevice``)."""
    rng = np.random.default_rng()
    wire = Wire()
    kinds = [BatchingOnHost if members == "direct" or (members == "mixed" and m == 0)
             else BatchingOnLazyDevice for m in range(SIZE)]
    engines = [kind(WireTransport(wire, m), LazyDevice(), 10.0, stage_bytes,
                    members == "direct") for m, kind in enumerate(kinds)]
    shapes = [(13, "int32"), (5, "bfloat16"), (0, "int32")]
    sent = [[random_array(rng, count, dtype) for count, dtype in shapes] for _ in range(SIZE)]
    got = [[poison(count, dtype) for count, dtype in shapes] for _ in range(SIZE)]
    # member 0 sends first, member 1 receives first: the k-th post of one matches the k-th
    # of the other
    pairs = [[step for k in range(len(shapes)) for step in
              (("send", sent[0][k], 1), ("recv", got[0][k], 1))],
             [step for k in range(len(shapes)) for step in
              (("recv", got[1][k], 0), ("send", sent[1][k], 0))]]
    _both(engines, lambda m, engine: engine.batch(pairs[m], stream=engine.handle))
    for m in range(SIZE):
        for k in range(len(shapes)):
            _same(f"member {m} receive {k}", sent[1 - m][k], got[m][k])
    for engine in engines:
        engine.close()
