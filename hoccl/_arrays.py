"""Arrays hoccl allocates for its callers: ``hoccl.empty`` (on a communicator's
device, registered with it as a window, ``hoccl._windows``) and ``hoccl.host_empty``
(host memory every process of the machine can map)."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional, Tuple

from . import _validate as check
from ._api import CommunicatorApi
from ._errors import InvalidArgumentError

__all__ = ["empty", "host_empty"]


def empty(shape: Any, dtype: Any, comm: Any, *, framework: Optional[str] = None) -> Any:
    """A new array of ``shape`` and ``dtype`` on ``comm``'s device, registered with
    ``comm`` (``Communicator.register``: collective, every rank in the same order).

    ``framework``: ``"numpy"`` (the host backend's default), ``"cupy"`` (the cuda
    backend's default) or ``"torch"`` (the default for bfloat16 on GPUs, which cupy
    lacks).  ``dtype`` is a hoccl dtype name (``"bfloat16"``) or a numpy / torch dtype.
    The array is held until ``comm.deregister(array)``; its contents are undefined."""
    from . import _dtypes
    name = _dtype_name(dtype)
    if name not in _dtypes.NAMES:
        raise InvalidArgumentError(f"empty: expected a dtype of {_dtypes.NAMES}, got {dtype!r}")
    if not isinstance(comm, CommunicatorApi):
        raise InvalidArgumentError(f"empty: comm must be a hoccl communicator; got "
                                   f"{type(comm).__name__}")
    comm._usable("empty")
    dims, nbytes = check.shape("empty", shape, _dtypes.ITEMSIZE[name])
    on_gpu = comm.backend == "cuda"
    if framework is None:
        framework = ("torch" if name == "bfloat16" else "cupy") if on_gpu else "numpy"
    choices = ("cupy", "torch") if on_gpu else ("numpy", "torch")
    if framework not in choices:
        raise InvalidArgumentError(f"empty: framework must be one of {choices} on the "
                                   f"{comm.backend} backend, got {framework!r}")
    if framework == "cupy" and name == "bfloat16":
        raise InvalidArgumentError("empty: cupy has no bfloat16; pass framework='torch'")
    where = f"GPU {comm.device}" if on_gpu else "host memory"
    with _allocating("empty", nbytes, dims, name, where):
        array = _allocate(framework, dims, name, comm.device if on_gpu else None)
    comm.register(array)
    return array


def host_empty(shape: Any, dtype: Any, *, framework: str = "numpy") -> Any:
    """A new array of ``shape`` and ``dtype`` in host memory that every rank on this
    machine can map (a memfd segment; ``cudaHostAlloc``'s place for CPU ranks): hoccl's
    host backend and the staged engine across hosts reach it from the other processes
    with plain loads and stores, where memory the caller allocated is read and written
    through the kernel by cross-memory attach (a few GB/s a process).  Not collective and
    not registered: any array works in any call; this one only moves faster between
    processes.  Its memory is freed when no array uses it.

    ``framework``: ``"numpy"`` or ``"torch"`` (a CPU tensor).  ``dtype`` is a hoccl
    dtype name (``"bfloat16"``) or a numpy / torch dtype.  Its contents are zero."""
    from . import _dtypes
    from .backends._segments import shared_bytes
    name = _dtype_name(dtype)
    if name not in _dtypes.NAMES:
        raise InvalidArgumentError(f"host_empty: expected a dtype of {_dtypes.NAMES}, got "
                                   f"{dtype!r}")
    if framework not in ("numpy", "torch"):
        raise InvalidArgumentError(f"host_empty: framework must be 'numpy' or 'torch', got "
                                   f"{framework!r}")
    dims, nbytes = check.shape("host_empty", shape, _dtypes.ITEMSIZE[name])
    count = math.prod(dims)
    with _allocating("host_empty", nbytes, dims, name, "shared host memory"):
        memory = shared_bytes(nbytes)
    if framework == "numpy":
        return memory.view(_dtypes.numpy_dtype(name)).reshape(dims)
    import torch
    torch_dtype = getattr(torch, name)
    if not count:
        return torch.empty(dims, dtype=torch_dtype)
    return torch.frombuffer(memory, dtype=torch_dtype).reshape(dims)


def _allocate(framework: str, dims: Tuple[int, ...], name: str, device: Optional[int]) -> Any:
    """An uninitialised array of ``framework`` (numpy on the host; cupy or torch on GPU
    ``device``, or torch on the host when ``device`` is None)."""
    if framework == "torch":
        import torch
        return torch.empty(dims, dtype=getattr(torch, name),
                           device="cpu" if device is None else f"cuda:{device}")
    if framework == "cupy":
        import cupy
        with cupy.cuda.Device(device):
            return cupy.empty(dims, dtype=name)
    import numpy as np
    from . import _dtypes
    return np.empty(dims, dtype=_dtypes.numpy_dtype(name))


@contextlib.contextmanager
def _allocating(call: str, nbytes: int, dims: Tuple[int, ...], name: str,
                where: str) -> Iterator[None]:
    """An allocation that fails (numpy's MemoryError, torch's and cupy's out-of-memory
    errors, an mmap's ENOMEM) raises InvalidArgumentError naming ``call`` and the size."""
    try:
        yield
    except (MemoryError, OSError, RuntimeError, ValueError) as error:
        raise InvalidArgumentError(f"{call}: cannot allocate {nbytes} bytes (shape {dims} of "
                                   f"{name}) in {where}: {type(error).__name__}: "
                                   f"{error}") from error


def _dtype_name(dtype: Any) -> str:
    """The hoccl name of a dtype given by name, as a numpy dtype or type, or as a torch
    dtype (a name hoccl does not know is returned as given, for the caller's error)."""
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    if isinstance(dtype, type):  # np.float32, ml_dtypes' bfloat16
        import numpy as np
        try:
            return np.dtype(dtype).name
        except TypeError:
            return text
    return text
