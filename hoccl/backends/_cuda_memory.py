"""The cuda backend's memory: allocations, signal pads, pinned host words, and IPC
export and import of device buffers (``CudaDevice`` takes these methods from ``_Memory``)."""

from __future__ import annotations

import collections
import ctypes
import logging
from typing import Any, Callable, Dict, Set, Tuple

from cuda.bindings import driver

from .._errors import DriverError, InvalidArgumentError
from ._base import HostWord
from ._cuda_driver import _ALREADY_MAPPED, _BUFFER_ID, _call, _check, _error

log = logging.getLogger("hoccl")


class _PinnedWord(HostWord):
    """A 64-bit counter in pinned, device-mapped host memory."""

    def __init__(self, host_address: int, device_address: int):
        self._host_address = host_address
        self.address = device_address

    @property
    def value(self) -> int:
        if not self._host_address:
            raise InvalidArgumentError("HostWord.value: the device that owned this word is closed")
        return ctypes.c_uint64.from_address(self._host_address).value

    def __repr__(self) -> str:
        return f"<cuda HostWord at {self.address:#x}>"


_IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE


def _handle_bytes(handle: Any) -> bytes:
    """The 64 bytes of a ``CUipcMemHandle`` (cuda-bindings 13.3 has a ``reserved``
    field; 13.5 only ``getPtr``)."""
    reserved = getattr(handle, "reserved", None)
    if reserved is not None:
        return bytes(reserved)
    return ctypes.string_at(handle.getPtr(), _IPC_HANDLE_BYTES)


def _handle_from(data: bytes) -> Any:
    """A ``CUipcMemHandle`` holding ``data`` (see ``_handle_bytes``)."""
    handle = driver.CUipcMemHandle()
    if hasattr(handle, "reserved"):
        handle.reserved = data
    else:
        ctypes.memmove(handle.getPtr(), data, _IPC_HANDLE_BYTES)
    return handle


#: what ``export`` returns; a plain tuple on the wire (it pickles as a namedtuple).
CudaIpcDescriptor = collections.namedtuple(
    "CudaIpcDescriptor", ["kind", "handle", "base", "size", "buffer_id", "offset"])


class _Memory:
    """``CudaDevice``'s memory methods (the state they use is the device's)."""

    _owned: Any
    _setup_stream: Any
    _exports: Dict[Tuple[int, int], Tuple[bytes, int]]
    _descriptors: Dict[Tuple[int, int], Any]
    _called: Set[tuple]
    _holds: Dict[tuple, int]
    _make_current: Callable[[], None]

    def alloc(self, nbytes: int) -> int:
        self._make_current()
        address = int(_call(driver.cuMemAlloc, nbytes))
        self._owned.allocations.add(address)
        return address

    def free(self, address: int) -> None:
        address = int(address)
        owner = next((pool for pool in (self._owned.allocations, self._owned.pads)
                      if address in pool), None)
        if owner is None:
            raise InvalidArgumentError(
                "free: expected an address from this device's alloc or alloc_pad, "
                f"got {address:#x}")
        self._make_current()
        owner.discard(address)
        _call(driver.cuMemFree, address)

    def alloc_pad(self, slots: int) -> int:
        self._make_current()
        address = int(_call(driver.cuMemAlloc, slots * 8))
        self._owned.pads.add(address)
        # A small memset runs without SMs; on a private stream so that no caller's work waits.
        _call(driver.cuMemsetD32Async, address, 0, slots * 2, self._setup_stream)
        _call(driver.cuStreamSynchronize, self._setup_stream)
        return address

    def pin_host(self, address: int, nbytes: int) -> None:
        """Page-lock ``nbytes`` of ordinary host memory at ``address`` for the copy
        engines (``cuMemHostRegister``, every context): the pages stay the process's own,
        so a process on this machine can still read them (``process_vm_readv``)."""
        self._make_current()
        _call(driver.cuMemHostRegister, address, nbytes, driver.CU_MEMHOSTREGISTER_PORTABLE)

    def unpin_host(self, address: int) -> None:
        """Undo ``pin_host`` (after every copy that reads or writes the memory)."""
        self._make_current()
        _call(driver.cuMemHostUnregister, address)

    def alloc_host_word(self) -> HostWord:
        self._make_current()
        flags = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
        host_address = int(_call(driver.cuMemHostAlloc, 8, flags))
        ctypes.c_uint64.from_address(host_address).value = 0
        try:
            device_address = int(_call(driver.cuMemHostGetDevicePointer, host_address, 0))
        except DriverError:
            _call(driver.cuMemFreeHost, host_address)
            raise
        word = _PinnedWord(host_address, device_address)
        self._owned.host_words.append(word)
        return word

    def free_host_word(self, word: HostWord) -> None:
        if isinstance(word, _PinnedWord) and word in self._owned.host_words:
            self._make_current()
            self._owned.host_words.remove(word)
            _call(driver.cuMemFreeHost, word._host_address)
            word._host_address = 0

    def export(self, address: int, nbytes: int = 0) -> CudaIpcDescriptor:
        """``("cuda-ipc", handle, base, size, buffer_id, offset)`` for the allocation
        holding ``address``; the handle of an allocation is made once and cached.

        A repeat costs one driver call: the allocation's buffer id, unique for the life
        of the process, tells a freed-and-reallocated address from the same allocation."""
        self._make_current()
        address = int(address)
        result = driver.cuPointerGetAttribute(_BUFFER_ID, address)
        if result[0]:
            raise InvalidArgumentError(
                "export: expected an address inside a CUDA device allocation, "
                f"got {address:#x} ({_error('cuPointerGetAttribute', result[0])})")
        buffer_id = int(result[1])
        descriptor = self._descriptors.get((address, buffer_id))
        if descriptor is not None:
            return descriptor
        base, size = _call(driver.cuMemGetAddressRange, address)
        base = int(base)
        entry = self._exports.get((base, buffer_id))
        if entry is None:
            capable = _call(
                driver.cuPointerGetAttribute,
                driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, address)
            if not int(capable):
                raise InvalidArgumentError(
                    f"export: the buffer at {address:#x} (allocation {base:#x}, {int(size)} bytes) "
                    "cannot be shared with cuIpcGetMemHandle; it must come from a cudaMalloc-style "
                    "allocation (cupy's default memory pool, torch's caching allocator without "
                    "expandable_segments, or hoccl's alloc), not from cuMemCreate/VMM or "
                    "expandable segments")
            handle = _call(driver.cuIpcGetMemHandle, base)
            entry = (_handle_bytes(handle), int(size))
            self._exports[(base, buffer_id)] = entry
        descriptor = CudaIpcDescriptor("cuda-ipc", entry[0], base, entry[1], buffer_id,
                                       address - base)
        if len(self._descriptors) > 4096:
            self._descriptors.clear()
        self._descriptors[(address, buffer_id)] = descriptor
        return descriptor

    def import_(self, descriptor: Any) -> int:
        key, address = self._map(descriptor)
        self._called.add(key)
        return address

    def hold_import(self, descriptor: Any) -> int:
        key, address = self._map(descriptor)
        self._holds[key] = self._holds.get(key, 0) + 1
        return address

    def drop_import(self, descriptor: Any) -> None:
        """Unmapped once no window holds it, unless a call mapped it too: calls' bound
        programs may still address it, so it stays until ``close``."""
        key, _ = self._key(descriptor)
        holds = self._holds.pop(key, 0) - 1
        if holds > 0:
            self._holds[key] = holds
        elif key not in self._called:
            self._close_import(key)

    @staticmethod
    def _key(descriptor: Any) -> Tuple[tuple, int]:
        if not (isinstance(descriptor, tuple) and len(descriptor) == 6
                and descriptor[0] == "cuda-ipc"):
            raise InvalidArgumentError(
                "import_: expected a ('cuda-ipc', handle, base, size, buffer_id, offset) "
                f"descriptor from CudaDevice.export, got {type(descriptor).__name__}")
        _, handle, base, size, buffer_id, offset = descriptor
        return (handle, base, buffer_id, int(size)), offset

    def _map(self, descriptor: Any) -> Tuple[tuple, int]:
        """(cache key, local address) of a peer's exported buffer, mapped on first use.

        A key is (handle, allocation base, buffer id, allocation size).  When the
        exporter frees an allocation and makes a new one over the same addresses, opening
        the new one's handle fails with CUDA_ERROR_ALREADY_MAPPED while this process still
        maps the old one (seen with two ranks on one GPU, and under split): a cached
        mapping of an exporter range that overlaps the new one, under another buffer id,
        is of freed memory (the exporter's calls on it, and so this rank's, have
        finished), so it is closed and the handle opened again."""
        key, offset = self._key(descriptor)
        imports = self._owned.imports
        mapped = imports.get(key)
        if mapped is None:
            self._make_current()
            ipc_handle = _handle_from(key[0])
            flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            result = driver.cuIpcOpenMemHandle(ipc_handle, flags)
            if result[0] == _ALREADY_MAPPED:
                _, base, _, size = key
                stale = [other for other in imports if other != key
                         and other[1] < base + size and base < other[1] + other[3]]
                for other in stale:
                    self._close_import(other)
                log.debug("import: closed %d stale mapping(s) over %#x (+%d) and retried",
                          len(stale), base, size)
                result = driver.cuIpcOpenMemHandle(ipc_handle, flags)
            mapped = int(_check(result, "cuIpcOpenMemHandle"))
            imports[key] = mapped
        return key, mapped + offset

    def _close_import(self, key: tuple) -> None:
        mapped = self._owned.imports.pop(key, None)
        self._called.discard(key)
        self._holds.pop(key, None)
        if mapped is not None:
            self._make_current()
            _call(driver.cuIpcCloseMemHandle, mapped)
