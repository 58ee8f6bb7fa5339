"""Registered memory handed out as torch tensors at the same offsets on every rank.

FSDP2 asks its collectives for memory (``AllGather.allocate``) before every all-gather.
A ``RegisteredPool`` answers from slabs registered with the communicator once
(``Communicator.register``), so the all-gather that follows is a call on registered
buffers at symmetric offsets: issued at once, with no descriptor exchange and no host
wait for the peers (see "Registered buffers" in docs/guide.md).

Offsets are the same on every rank because the pool's choices depend only on the
sequence of allocations and releases, which every rank of an FSDP program makes in the
same order: a request takes the first released slot of its size, in the order the slots
were made, else a new slot carved from the first slab with room, else a new slab
(registered: collective, at the same request on every rank).  A tensor's slot is
released when torch frees the tensor's storage (all its views gone), as the caching
allocator would; hoccl's calls hold shadows (``shadow``), so when a call ends, which
differs between ranks, never keeps a slot.  The next tensor in a slot is ordered after
the slot's last call and after the stream the last tensor was allocated on, as the
caching allocator orders reuse.  If a rank's requests ever differed, the calls' descriptions, which are still checked
after the fact, raise ``DivergedError`` on every rank.

Slabs stay registered until ``close`` (collective) and in memory while any tensor in
them lives.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["RegisteredPool"]

_ALIGN = 512  # bytes: slot offsets and sizes (every dtype's alignment, and DMA-friendly)
_SLAB_BYTES = 64 << 20  # the smallest slab a pool registers
_SHADOWS = 8  # shadows a slot keeps (FSDP2 makes two views of each: output, own block)


def _usable() -> bool:
    """Whether this torch can make a storage over memory it does not own."""
    return hasattr(torch._C, "_construct_storage_from_data_pointer")


def _contiguous(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _weak(storage: Any) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(storage)


@dataclass
class _Slot:
    slab: "_Slab"
    offset: int
    nbytes: int
    storage: Any = None    # weak reference to the storage of the tensor in it; None: never used
    stream: Any = None     # the CUDA stream it was last handed out on
    work: Any = None       # the last hoccl call on it (a hoccl.torch Work or Mark)
    #: the shadows made of it (``RegisteredPool.shadow``), by view: a repeated call on the
    #: same view reuses its shadow (they hold nothing of the slot: no storage of its user's)
    shadows: Dict[tuple, torch.Tensor] = field(default_factory=dict)

    def tensor(self, dtype: torch.dtype, device: torch.device, offset: int,
               size: Sequence[int], stride: Sequence[int]) -> Tuple[torch.Tensor, Any]:
        """A view of this slot's memory through a storage of its own (torch does not own
        the memory: no deleter), and that storage."""
        storage = torch._C._construct_storage_from_data_pointer(
            self.slab.tensor.data_ptr() + self.offset, device, self.nbytes)
        tensor = torch.empty((0,), dtype=dtype, device=device)
        tensor.set_(storage, offset, size, stride)
        return tensor, storage

    def free(self) -> bool:
        """Its tensor is gone (what its user holds; hoccl's own calls hold shadows)."""
        return self.storage is None or self.storage.expired()

    def idle(self) -> bool:
        """Free, and no hoccl call on it still running: its memory may go."""
        return self.free() and (self.work is None or self.work.is_completed())


@dataclass
class _Slab:
    tensor: torch.Tensor   # uint8, registered with the communicator
    window: Any
    used: int = 0
    slots: List[_Slot] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def in_use(self) -> bool:
        return any(not slot.idle() for slot in self.slots)


def _keep_until_free(slabs: List[_Slab]) -> None:
    """A closed or dropped pool's slabs that tensors still point into: their memory stays
    until those tensors are gone (checked whenever a pool hands out memory)."""
    _KEPT.extend(slab for slab in slabs if slab.in_use())


_KEPT: List[_Slab] = []


def _prune_kept() -> None:
    if _KEPT:
        _KEPT[:] = [slab for slab in _KEPT if slab.in_use()]


class RegisteredPool:
    """Torch tensors carved from memory registered with ``comm``, at the same offsets on
    every rank when every rank makes the same requests in the same order.

    ``allocate(size, dtype=, device=)`` is FSDP2's ``Comm.allocate``.  Requests this
    pool cannot serve from registered memory (another device; a communicator that does
    not register, such as a ``HierarchicalCommunicator``; a torch without
    ``_construct_storage_from_data_pointer``) get plain ``torch.empty`` tensors: their
    calls exchange descriptors as before.  ``stats`` counts what it did."""

    def __init__(self, comm: Any, *, slab_bytes: int = _SLAB_BYTES):
        self.comm = comm
        self.slab_bytes = slab_bytes
        self._slabs: List[_Slab] = []
        self._by_size: Dict[int, List[_Slot]] = {}
        self._at: Dict[int, _Slot] = {}  # slots by address
        self._device = (torch.device("cuda", comm.device) if comm.backend == "cuda"
                        else torch.device("cpu"))
        from .._hierarchy import HierarchicalCommunicator
        self.enabled = not isinstance(comm, HierarchicalCommunicator) and _usable()
        self.closed = False
        self.stats = {"registered": 0, "reused": 0, "carved": 0, "slabs": 0,
                      "slab_bytes": 0, "plain": 0}
        weakref.finalize(self, _keep_until_free, self._slabs)

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        shape = tuple(int(s) for s in size)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not self.enabled or self.closed or device != self._device:
            self.stats["plain"] += 1
            return torch.empty(shape, dtype=dtype, device=device)
        _prune_kept()
        nbytes = max(_ALIGN, -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN)
        slot = next((s for s in self._by_size.get(nbytes, ()) if s.free()), None)
        if slot is None:
            slot = self._carve(nbytes)
        else:
            self.stats["reused"] += 1
        if slot.work is not None:  # the last call on it has ended before this tensor's use
            slot.work.block_current_stream()
            slot.work = None
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            if slot.stream is not None and slot.stream != stream:
                stream.wait_stream(slot.stream)  # what the last tensor here was ordered by
            slot.stream = stream
        tensor, storage = slot.tensor(dtype, device, 0, shape, _contiguous(shape))
        slot.storage = _weak(storage)
        self._at[slot.slab.tensor.data_ptr() + slot.offset] = slot
        self.stats["registered"] += 1
        return tensor

    def shadow(self, tensor: torch.Tensor) -> Optional[Tuple[torch.Tensor, _Slot]]:
        """For a tensor this pool handed out (or a view of one): the same view of the same
        memory through a storage of its own, and its slot; else None.  A call is given
        the shadow, so that what hoccl holds while the call runs does not keep the slot
        taken (when the user frees it is the same on every rank; when a call ends is not),
        and the slot remembers the call (``used``) to order its next tensor after it."""
        if not self._at:
            return None
        slot = self._at.get(tensor.untyped_storage().data_ptr())
        if slot is None or slot.free():
            return None
        view = (tensor.dtype, int(tensor.storage_offset()), tensor.size(), tensor.stride())
        shadow = slot.shadows.get(view)
        if shadow is None:
            if len(slot.shadows) >= _SHADOWS:
                slot.shadows.clear()
            shadow = slot.shadows[view] = slot.tensor(tensor.dtype, tensor.device, view[1],
                                                      view[2], view[3])[0]
        return shadow, slot

    def used(self, slot: _Slot, work: Any) -> None:
        """``work`` (a hoccl.torch Work, or a synchronous call's Mark) is the latest call on
        ``slot``'s memory."""
        slot.work = work

    def _carve(self, nbytes: int) -> _Slot:
        slab = next((slab for slab in self._slabs if slab.nbytes - slab.used >= nbytes), None)
        if slab is None:
            slab = self._grow(nbytes)
        slot = _Slot(slab, slab.used, nbytes)
        slab.used += nbytes
        slab.slots.append(slot)
        self._by_size.setdefault(nbytes, []).append(slot)
        self.stats["carved"] += 1
        return slot

    def _grow(self, nbytes: int) -> _Slab:
        """A new slab, registered (collective: every rank reaches this at the same
        request): ``slab_bytes``, or one slot of ``nbytes`` if that is larger."""
        size = max(self.slab_bytes, nbytes)
        size = -(-size // _ALIGN) * _ALIGN
        tensor = torch.empty((size,), dtype=torch.uint8, device=self._device)
        slab = _Slab(tensor, self.comm.register(tensor))
        self._slabs.append(slab)
        self.stats["slabs"] += 1
        self.stats["slab_bytes"] += size
        return slab

    def in_use(self) -> int:
        """How many tensors handed out are still alive (hoccl's own calls aside)."""
        return sum(not slot.free() for slab in self._slabs for slot in slab.slots)

    def close(self) -> None:
        """Deregister every slab (collective, every rank).  Tensors still alive keep their
        memory, no longer registered; later requests get plain tensors."""
        if self.closed:
            return
        self.closed = True
        for slab in self._slabs:
            self.comm.deregister(slab.window)
        _keep_until_free(self._slabs)
        self._slabs.clear()
        self._by_size.clear()
        self._at.clear()

