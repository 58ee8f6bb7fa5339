"""A GEMM beside hoccl's calls, for ``python -m hoccl.tune --beside-compute``.

Training code overlaps its reductions with GEMMs: what a setting costs there is the
communication the GEMMs did not hide plus the GEMMs' slowdown, not the call's time
alone (a reduction on more SMs can finish sooner and slow the GEMM by more).  A
``Compute`` runs GEMMs on every local rank's device, on a stream (or thread) of its own:

* cuda backend: a bf16 ``torch.matmul`` of ``GEMM_SIDE`` × ``GEMM_SIDE`` on a torch stream
  per device (torch's streams do not wait for the legacy default stream);
* host backend: a float32 numpy matmul of ``HOST_SIDE`` × ``HOST_SIDE`` in a thread (numpy
  lets go of the GIL while it multiplies), a stand-in that makes the sweep run in CI.

``overlapped_seconds`` is the cost of one sample::

    GEMMs alone:      |== g ==|== g ==|== g ==|                       -> alone
    calls + GEMMs:    |== g ===|=== g ==|== g ===|  (calls beside)    -> together
                      |c|c|c|c|c|c|c|c|c|c|c|
    cost per call = (together - alone) / calls
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Any, Callable, List, Optional, Sequence

__all__ = ["Compute", "open_compute", "overlapped_seconds", "GEMM_SIDE", "HOST_SIDE"]

#: the cuda backend's GEMM: bf16, 4096³ (about 0.2 ms on an H200)
GEMM_SIDE = 4096
#: the host backend's stand-in: float32, 128³
HOST_SIDE = 128


class Compute(abc.ABC):
    """GEMMs on every local rank's device: ``start(count)`` begins ``count`` of them per
    device and returns at once, ``wait()`` until they are done."""
    name = ""

    @abc.abstractmethod
    def start(self, count: int) -> None:
        """Begin ``count`` GEMMs per device."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Until the GEMMs begun are done."""

    def seconds(self, count: int) -> float:
        """Seconds ``count`` GEMMs take alone."""
        begun = time.perf_counter()
        self.start(count)
        self.wait()
        return time.perf_counter() - begun


class TorchCompute(Compute):
    def __init__(self, devices: Sequence[int]):
        import torch
        self.torch = torch
        self.name = f"a bf16 torch GEMM {GEMM_SIDE}³ per GPU"
        self.work = []
        for device in devices:
            made = [torch.randn(GEMM_SIDE, GEMM_SIDE, device=f"cuda:{device}",
                                dtype=torch.bfloat16) for _ in range(3)]
            self.work.append((torch.cuda.Stream(device=device), made))
        self.seconds(2)  # the first GEMMs load cuBLAS' kernels

    def start(self, count: int) -> None:
        for stream, (left, right, out) in self.work:
            with self.torch.cuda.stream(stream):
                for _ in range(count):
                    self.torch.matmul(left, right, out=out)

    def wait(self) -> None:
        for stream, _ in self.work:
            stream.synchronize()


class NumpyCompute(Compute):
    def __init__(self) -> None:
        import numpy as np
        self.name = f"a float32 numpy matmul {HOST_SIDE}³ in a thread (the host's stand-in)"
        rng = np.random.default_rng(0)
        self.left, self.right = (rng.standard_normal((HOST_SIDE, HOST_SIDE), dtype=np.float32)
                                 for _ in range(2))
        self.out = np.empty_like(self.left)
        self.thread: Optional[threading.Thread] = None

    def start(self, count: int) -> None:
        import numpy as np

        def run() -> None:
            for _ in range(count):
                np.matmul(self.left, self.right, out=self.out)
        self.thread = threading.Thread(target=run, name="hoccl-tune-gemm", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()


def open_compute(backend: str, devices: Sequence[Optional[int]]) -> Compute:
    """The GEMMs for ``backend``'s ranks on ``devices`` (their CUDA ordinals)."""
    if backend == "host":
        return NumpyCompute()
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit("python -m hoccl.tune --beside-compute: the cuda backend's GEMM "
                         "needs torch; install it (pip install torch)") from None
    ordinals: List[int] = [device for device in devices if device is not None]
    return TorchCompute(sorted(set(ordinals)))


def overlapped_seconds(compute: Compute, calls_seconds: Callable[[], Any], calls: int,
                       call_seconds: float, barrier: Callable[[], None]) -> float:
    """Per call: how much longer ``calls`` calls (``calls_seconds`` issues them and waits
    for them) and as many GEMMs as take about as long alone took together than the GEMMs
    alone (never below 0)."""
    one = compute.seconds(1)
    count = max(1, round(calls * call_seconds / max(one, 1e-9)))
    alone = compute.seconds(count)
    barrier()
    begun = time.perf_counter()
    compute.start(count)
    calls_seconds()
    compute.wait()
    return max(0.0, time.perf_counter() - begun - alone) / calls
