"""A call flows one way, in few frames: from the public method through matching and the
engine to the executor, and from there only to the stream manager and the device.

Host backend, every rank in this process (``init_local``): the last rank's call is the
one that issues every rank's work.  Both checks were written against the earlier
engine, which they fail (12 frames to the first copy; the engine's issue went back and
forth between the engine, the executor and the stream manager)."""

import sys

import numpy as np

import hoccl
from hoccl.backends.host import HostDevice
from hoccl.testing import assert_exact, expected, poison, random_array

N, COUNT = 3, 40
#: the most frames from the public method (its own frame the first) to the device's
#: first copy (its frame the last): the public call (the refusal's wrapper, the checks),
#: ``Communicator._run``, ``Engine.submit``, the group's matching, ``Engine.issue``, the
#: executor's ``issue`` and ``_enqueue``, the device
MOST_FRAMES = 9
#: the layers a call passes below the matching, in order; the stream manager and the
#: device are one layer: the executor drives both
LAYERS = (("hoccl._engine", "hoccl._windows"), ("hoccl.p2p",), ("hoccl.streams", "hoccl.backends"))


def _layer(module):
    """The layer of a module under the engine's issue; -1 for any other hoccl module
    (above the engine: a call back up), None for modules outside hoccl and for the plan's
    own accessors (``hoccl.sched.plan``: the data being issued, read at every layer)."""
    if not module.startswith("hoccl") or module == "hoccl.sched.plan":
        return None
    for index, prefixes in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return index
    return -1


def _all_gather(comms, rng, sends, recvs, last=None):
    """One all_gather on every rank, of fresh data into poisoned outputs, checked against
    numpy; ``last(call)`` wraps the last rank's call (the one that issues every rank's
    work)."""
    for rank in range(N):
        sends[rank][:] = random_array(rng, COUNT, "float32")
        recvs[rank][:] = poison(N * COUNT, "float32")
    for rank, comm in enumerate(comms):
        call = lambda: comm.all_gather(sends[rank], recvs[rank])  # noqa: E731
        call() if last is None or rank < N - 1 else last(call)
    for comm in comms:
        comm.synchronize()
    want = expected("all_gather", sends)
    for rank in range(N):
        assert_exact(f"all_gather: rank {rank}", want[rank], recvs[rank])


def _buffers():
    return ([np.empty(COUNT, np.float32) for _ in range(N)],
            [np.empty(N * COUNT, np.float32) for _ in range(N)])


def test_an_eager_call_reaches_the_devices_copy_within_nine_frames(init_local, monkeypatch):
    comms = init_local(N, backend="host")
    public = hoccl.Communicator.all_gather.__code__
    depths = []

    def counting(original):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1)
            if not caller.f_globals["__name__"].startswith("hoccl.backends"):
                frame, frames = caller, 1  # this frame: the device's method
                while frame is not None and frame.f_code is not public:
                    frame, frames = frame.f_back, frames + 1
                depths.append(frames if frame is not None else None)
            return original(self, *args, **kwargs)
        return wrapper
    monkeypatch.setattr(HostDevice, "copy", counting(HostDevice.copy))
    monkeypatch.setattr(HostDevice, "copy_batch", counting(HostDevice.copy_batch))
    rng = np.random.default_rng(1)
    sends, recvs = _buffers()
    for _ in range(2):  # the first call of its shape, and a repeat
        depths.clear()
        _all_gather(comms, rng, sends, recvs)
        assert depths and None not in depths, depths  # every copy came from all_gather
        assert max(depths) <= MOST_FRAMES, f"frames from all_gather to the copy: {depths}"


def test_the_engines_issue_never_calls_back_up(init_local):
    comms = init_local(N, backend="host")
    issue = comms[0]._engine.issue.__func__.__code__
    rng = np.random.default_rng(2)
    sends, recvs = _buffers()
    traces = []

    def traced(call):
        inside = []  # the frames of Engine.issue now running

        def profile(frame, event, arg):
            if event == "call":
                if frame.f_code is issue:
                    inside.append(frame)
                    traces.append([])
                elif inside:
                    layer = _layer(frame.f_globals.get("__name__", ""))
                    if layer is not None:
                        # the deepest layer among the frames between Engine.issue and this
                        # one: a call back up is made from below (a sibling after a device
                        # call, in the executor's loop, is not)
                        below, caller = 0, frame.f_back
                        while caller is not None and caller is not inside[-1]:
                            found = _layer(caller.f_globals.get("__name__", ""))
                            if found is not None:
                                below = max(below, found)
                            caller = caller.f_back
                        traces[-1].append((layer, frame.f_globals["__name__"],
                                           frame.f_code.co_name, below))
            elif event == "return" and inside and frame is inside[-1]:
                inside.pop()
        sys.setprofile(profile)
        try:
            call()
        finally:
            sys.setprofile(None)
    for round_ in range(2):  # the first call of its shape (bound now), and a repeat
        traces.clear()
        _all_gather(comms, rng, sends, recvs, last=traced)
        assert len(traces) == N  # the last rank's call issued every rank's
        for trace in traces:
            layers = [layer for layer, _, _, _ in trace]
            assert set(layers) == {0, 1, 2}, trace  # engine, executor, streams and device
            back = [entry for entry in trace if entry[0] < entry[3]]
            assert not back, f"calls back up under Engine.issue: {back}"
            if round_:  # a repeat issues the program its prepared call holds
                assert not any(name == "bind" for _, _, name, _ in trace), trace
