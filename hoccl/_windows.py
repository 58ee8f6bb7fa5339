"""Registered buffers (``Communicator.register``, ``hoccl.empty``): windows.

A window is a range of one rank's memory that every rank of the communicator registered
at the same point (``register`` is collective, like ``ncclCommWindowRegister``), so each
rank knows every peer's window of the same index: where it is (mapped once, at
registration) and how large.  A call whose buffers lie inside windows is then
*symmetric*: each peer's buffer is taken to be at the same offset of the peer's window
of the same index, so the call needs no descriptor exchange and no waiting on the host
for the peers' calls (``ProcessGroup.complete`` issues it at once).

What keeps that safe:

* every byte a plan touches in a peer's window is checked against the size that peer
  registered before anything is enqueued: a call on registered buffers never writes
  outside a peer's window, whatever the peers pass;
* each rank still posts its call's description; the peers check it after the fact (at
  their next call, ``synchronize``, ``deregister`` or ``close``), and a rank whose call
  differed (another size, another offset, an unregistered buffer) makes every rank raise
  ``DivergedError`` and aborts the communicator: its output is undefined, nothing beyond
  the windows was written;
* the device-side protocol is unchanged: a peer's copies into this rank's buffer wait
  for this rank's READY signal, sent when its caller's stream reached the call.

The window's array is kept alive by the registry until ``deregister``.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from typing import Any, Dict, Iterator, List, Optional, Tuple

from . import _validate as check
from ._buffers import as_buffer
from ._errors import InvalidArgumentError

__all__ = ["Window", "Windows", "WINDOW", "window_ref"]

#: the first element of a window reference ``(WINDOW, index, offset)``, the form a
#: registered buffer takes in a call's description (peers resolve it in their own table)
WINDOW = "window"


def window_ref(where: Any) -> Optional[Tuple[int, int]]:
    """(window index, offset) of a window reference, or None for any other ``where`` (an
    export descriptor, an address)."""
    if type(where) is tuple and where and where[0] == WINDOW:
        return where[1], where[2]
    return None


class Window:
    """One registered range: this rank's ``address`` and ``nbytes``, and every rank's
    window of the same index as this process addresses it (``bases``) and its size
    (``sizes``); ``bases`` is None where the peers live in this process (``init_local``:
    buffers travel by address anyway)."""

    __slots__ = ("index", "address", "nbytes", "owner", "bases", "sizes", "imports")

    def __init__(self, index: int, address: int, nbytes: int, owner: Any,
                 bases: Optional[List[Any]], sizes: Optional[List[int]]):
        #: the peers' export descriptors this rank mapped (released by deregister)
        self.imports: List[Any] = []
        self.index = index
        self.address = address
        self.nbytes = nbytes
        self.owner = owner
        self.bases = bases
        self.sizes = sizes

    def __repr__(self) -> str:
        return (f"<hoccl.Window #{self.index} at {self.address:#x}, {self.nbytes} bytes>")


class Windows:
    """A rank's windows, found by address.  Windows never overlap (``register`` refuses
    it), so the one that may hold an address is the last that starts at or below it."""

    def __init__(self) -> None:
        self._by_index: Dict[int, Window] = {}
        self._starts: List[int] = []
        self._sorted: List[Window] = []
        self.next_index = 0

    def __len__(self) -> int:
        return len(self._by_index)

    def __iter__(self):
        return iter(list(self._sorted))

    def get(self, index: int) -> Optional[Window]:
        return self._by_index.get(index)

    def overlapping(self, address: int, nbytes: int) -> Optional[Window]:
        """A window sharing a byte with ``[address, address + nbytes)``, if one does."""
        at = bisect.bisect_right(self._starts, address + nbytes - 1)
        if at and self._sorted[at - 1].address + self._sorted[at - 1].nbytes > address:
            return self._sorted[at - 1]
        return None

    def find(self, address: int, nbytes: int) -> Optional[Tuple[Window, int]]:
        """(window, offset) of the window holding all of ``[address, address + nbytes)``."""
        at = bisect.bisect_right(self._starts, address)
        if not at:
            return None
        window = self._sorted[at - 1]
        offset = address - window.address
        if offset + nbytes > window.nbytes:
            return None
        return window, offset

    def of(self, call: str, window: Any) -> Optional[Window]:
        """The registered window ``window`` names: a ``Window`` of this registry, or the
        array registered as a whole; None if it names none."""
        if isinstance(window, Window):
            return window if self._by_index.get(window.index) is window else None
        try:
            buffer = as_buffer(call, "window", window, writable=False, reduction=False)
        except InvalidArgumentError:
            return None
        found = self.find(buffer.address, max(buffer.nbytes, 1))
        if found is None or found[1] or found[0].nbytes != buffer.nbytes:
            return None
        return found[0]

    def add(self, address: int, nbytes: int, owner: Any, bases: Optional[List[Any]],
            sizes: Optional[List[int]]) -> Window:
        window = Window(self.next_index, address, nbytes, owner, bases, sizes)
        self.next_index += 1
        self._by_index[window.index] = window
        at = bisect.bisect_right(self._starts, address)
        self._starts.insert(at, address)
        self._sorted.insert(at, window)
        return window

    def remove(self, window: Window) -> None:
        del self._by_index[window.index]
        at = self._sorted.index(window)
        del self._starts[at]
        del self._sorted[at]

    def clear(self) -> None:
        self._by_index.clear()
        self._starts.clear()
        self._sorted.clear()


def empty(shape: Any, dtype: Any, comm: Any, *, framework: Optional[str] = None) -> Any:
    """A new array of ``shape`` and ``dtype`` on ``comm``'s device, registered with
    ``comm`` (``Communicator.register``: collective, every rank in the same order).

    ``framework``: ``"numpy"`` (the host backend's default), ``"cupy"`` (the cuda
    backend's default) or ``"torch"`` (the default for bfloat16 on GPUs, which cupy
    lacks).  ``dtype`` is a hoccl dtype name (``"bfloat16"``) or a numpy / torch dtype.
    The array is held until ``comm.deregister(array)``; its contents are undefined."""
    from . import _dtypes
    from ._api import CommunicatorApi
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
