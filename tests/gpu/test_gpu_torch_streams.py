"""Folds across hosts on torch CUDA tensors run on the stream hoccl was handed: with the
caller on torch's default stream (the handle 0), a fold must come after the work before
it on that stream.  ``torch.cuda.ExternalStream(0)`` is a stream from torch's pool, so a
fold wrapped that way could read its inputs before they were written
(``hoccl._hierarchy.arrays.torch_stream``)."""

import numpy as np
import pytest

from hoccl._hierarchy.arrays import torch_stream
from hoccl._hierarchy.folding import fold

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def test_the_null_handle_is_torchs_default_stream():
    device = torch.device("cuda", 0)
    assert torch_stream(torch, 0, device) == torch.cuda.default_stream(device)
    side = torch.cuda.Stream(device=device)
    with torch.cuda.stream(side):
        assert torch_stream(torch, side.cuda_stream, device) == side
        assert torch_stream(torch, 0, device) == torch.cuda.default_stream(device)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_fold_on_the_null_handle_comes_after_the_work_before_it(dtype):
    device = torch.device("cuda", 0)
    kind = getattr(torch, dtype)
    rng = np.random.default_rng(7)
    a = torch.from_numpy(rng.standard_normal((2048, 2048), np.float32)).to(device)
    for trial in range(5):
        with torch.cuda.stream(torch.cuda.default_stream(device)):
            # a long matmul, then its result scaled to zero: the parts are written late
            parts = [(a @ a).mul_(0).add_(k + trial).reshape(-1)[:4096].to(kind)
                     for k in range(3)]
            out = torch.full((4096,), float("nan"), dtype=kind, device=device)
            fold(parts, out, "sum", stream=0)
            got = out.float().cpu().numpy()
        assert (got == 3 * trial + 3).all(), (dtype, trial, got[:4])
