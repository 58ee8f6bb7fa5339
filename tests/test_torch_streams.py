"""The torch stream that hoccl's phases across hosts run torch work on (a fold, scratch,
a call of torch.distributed) for a raw stream handle: the stream hoccl enqueues its own
work on, never another.

``torch.cuda.ExternalStream(0)`` is a stream from torch's pool, not the null stream
(torch reads ``stream_ptr=0`` as "none given"): folds wrapped that way ran unordered
with hoccl's null-stream work on an H200, and results came out undivided, unfolded or
unwritten.  torch here is a stand-in that records which stream each handle became (CI
has no GPU); the real one runs in the GPU tier (``tools/gpu_checks.sh mixed``)."""

from types import SimpleNamespace

import pytest

from hoccl._hierarchy.arrays import torch_stream

SIDE = 0x7F3A_0000_1200  # a stream the caller made current


class _Stream:
    def __init__(self, handle, made_as):
        self.cuda_stream, self.made_as = handle, made_as


def _torch(current):
    wrapped = []

    def external(handle, device=None):
        wrapped.append(handle)
        return _Stream(handle, "external")
    cuda = SimpleNamespace(current_stream=lambda device=None: _Stream(current, "current"),
                           default_stream=lambda device=None: _Stream(0, "default"),
                           ExternalStream=external)
    return SimpleNamespace(cuda=cuda), wrapped


@pytest.mark.parametrize("current", [0, SIDE])
@pytest.mark.parametrize("handle, made_as", [
    (0, "default"),          # the null stream: torch's default stream
    (1, "default"),          # CU_STREAM_LEGACY: the same stream
    (SIDE, None),            # the caller's current stream: itself
    (0x7F3A_0000_4400, "external"),  # any other stream: wrapped
])
def test_a_handle_becomes_the_stream_it_names(current, handle, made_as):
    torch, wrapped = _torch(current)
    stream = torch_stream(torch, handle, "cuda:0")
    if made_as is None:  # the current stream when it is the one named, else wrapped
        made_as = "current" if current == handle else "external"
    elif handle == current:
        made_as = "current"
    assert stream.made_as == made_as
    assert stream.cuda_stream == (0 if made_as == "default" else handle)
    assert not [h for h in wrapped if h in (0, 1)], "ExternalStream of a null handle"
