"""Host memory that processes on one machine map into each other's address space.

Memory made by ``shared_bytes`` lives in a memfd segment: the staged engine's own host
memory (a GPU member's pinned slots, a host member's slots and offered copies), the host
backend's scratch, and the arrays of ``hoccl.host_empty``.  A piece inside one is named
by its segment (``segment_words``, ``segment_of``); a peer maps the segment once
(``PeerSegments``: ``/proc/<pid>/fd/<fd>``, which needs the same permission as
cross-memory attach) and reaches the piece with plain loads and stores, where
``process_vm_readv`` moves 4.5–6.6 GB/s a process on the H200 machine.  A piece outside
every segment (memory the caller allocated) is moved with cross-memory attach, and so
is any piece whose segment cannot be mapped.

A segment a peer must be able to write into for as long as it holds it (a host signal
pad) is mapped with ``HeldSegments``: the mapping holds a shared lock on the file
(an open-file-description lock, released by the kernel when the mapping's descriptor is
closed or its process ends), and its owner asks ``held_elsewhere`` before it gives the
memory to anything else.  A peer's write always lands in its own mapping, never in
memory the owner has freed, and the owner reuses the segment only once nobody maps it.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import mmap
import os
import struct
import threading
import weakref
from typing import Dict, List, Optional, Tuple

import numpy as np

__all__ = ["PeerSegments", "HeldSegments", "shared_bytes", "segment_of", "segment_words",
           "held_elsewhere", "NO_SEGMENT"]

#: an offer's segment words where the piece lies in no segment
NO_SEGMENT = (0, 0, 0, 0)
#: this process's segments: base address -> (end, fd, inode), and their bases in order
_OWNED: Dict[int, Tuple[int, int, int]] = {}
_BASES: List[int] = []
_LOCK = threading.Lock()


def shared_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` of host memory in a segment of its own that peers may map; freed (its
    file closed) once no array uses it.  Where the system makes no such segments, plain
    anonymous memory (peers then reach it by cross-memory attach, or MPI moves it)."""
    try:
        fd = os.memfd_create("hoccl-stage", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # not Linux, a kernel before 3.17, or out of files
        return np.frombuffer(mmap.mmap(-1, max(1, nbytes)), np.uint8)[:nbytes]
    try:
        os.ftruncate(fd, max(1, nbytes))
        area = mmap.mmap(fd, max(1, nbytes))
    except OSError:
        os.close(fd)
        raise
    memory = np.frombuffer(area, np.uint8)
    base = memory.ctypes.data
    with _LOCK:
        _OWNED[base] = (base + area.size(), fd, os.fstat(fd).st_ino)
        bisect.insort(_BASES, base)
    weakref.finalize(area, _release, base, fd)
    return memory[:nbytes]


def _release(base: int, fd: int) -> None:
    with _LOCK:
        if _OWNED.pop(base, None) is not None:
            del _BASES[bisect.bisect_left(_BASES, base)]
    os.close(fd)


def segment_of(address: int, nbytes: int) -> Tuple[int, int, int, int]:
    """(fd, inode, base, length) of the segment of this process that holds the
    ``nbytes`` at ``address`` whole, or ``NO_SEGMENT``."""
    start, end = int(address), int(address) + max(0, int(nbytes))
    with _LOCK:
        index = bisect.bisect_right(_BASES, start) - 1  # the last segment starting at or before
        if index >= 0:
            base = _BASES[index]
            stop, fd, inode = _OWNED[base]
            if end <= stop:
                return fd, inode, base, stop - base
    return NO_SEGMENT


def segment_words(piece: np.ndarray) -> Tuple[int, int, int, int]:
    """``segment_of`` the bytes of ``piece``."""
    return segment_of(piece.ctypes.data, piece.nbytes)


def _lock_request(kind: int) -> bytes:
    """A ``struct flock`` of the whole file for ``F_OFD_*`` (``l_pid`` must be 0)."""
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 0, 0)


def held_elsewhere(piece: np.ndarray) -> bool:
    """Whether a ``HeldSegments`` mapping (of any process, this one included) holds the
    segment of ``piece``: its owner must not give that memory to anything else yet."""
    fd, inode, _, _ = segment_words(piece)
    if not inode:
        return False
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _lock_request(fcntl.F_WRLCK))
    return struct.unpack_from("h", answer)[0] != fcntl.F_UNLCK


class _Held:
    """One peer segment mapped for reading and writing, its file locked shared."""

    def __init__(self, pid: int, fd: int, inode: int, base: int, length: int) -> None:
        handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        try:
            if os.fstat(handle).st_ino != inode:
                raise OSError(f"/proc/{pid}/fd/{fd} is another file now")
            fcntl.fcntl(handle, fcntl.F_OFD_SETLK, _lock_request(fcntl.F_RDLCK))
            area = mmap.mmap(handle, length)
        except BaseException:
            os.close(handle)
            raise
        self._handle, self._area = handle, area
        self._pin = ctypes.c_char.from_buffer(area)  # the mapping's address, held
        self.shift = ctypes.addressof(self._pin) - base
        self.users = 0

    def close(self) -> None:
        """Unmap, then let go of the lock (so the owner never sees it free while mapped)."""
        del self._pin
        self._area.close()
        os.close(self._handle)


class HeldSegments:
    """Peers' segments this process writes into by address (a host signal pad), each
    mapped once and held, with a shared lock on its file, until its last user drops it
    (``drop``) or ``clear``: while any mapping holds it, the owner does not reuse the
    memory (``held_elsewhere``), and after the owner has let go or exited, this
    process's writes still land in its own mapping."""

    def __init__(self) -> None:
        self._held: Dict[Tuple[int, int], _Held] = {}
        self._lock = threading.Lock()

    def hold(self, pid: int, words: Tuple[int, int, int, int], address: int) -> int:
        """This process's address of the peer's ``address`` inside the segment ``words``
        name, mapped (once) and held; raises OSError if it cannot be mapped."""
        fd, inode, base, length = words
        if not inode or not base <= address < base + length:
            raise OSError(f"address {address:#x} of process {pid} lies in no shared segment")
        with self._lock:
            held = self._held.get((pid, inode))
            if held is None:
                held = self._held[(pid, inode)] = _Held(pid, fd, inode, base, length)
            held.users += 1
            return address + held.shift

    def drop(self, pid: int, words: Tuple[int, int, int, int]) -> None:
        """One user of the peer's segment is done (its writers have stopped)."""
        key = (pid, words[1])
        with self._lock:
            held = self._held.get(key)
            if held is None:
                return
            held.users -= 1
            if held.users <= 0:
                del self._held[key]
                held.close()

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for one in held:
            one.close()


class PeerSegments:
    """The segments of peers mapped into this process, by (pid, inode): a segment is
    mapped at its first use and kept (its owner reuses it).

    ``writable``: mapped for stores too (the host backend writes into its peers' buffers).
    ``hold_live``: a segment its owner still has is never unmapped (the host backend hands
    out plain addresses inside the mappings, which hold no reference to them); whenever
    another is mapped, those whose owner closed its file (or exited) are dropped, so a
    freed segment's memory is held here at most until the next mapping (or ``clear``).
    Without it the oldest is dropped past ``KEEP`` (the views handed out hold their
    mapping)."""

    KEEP = 16

    def __init__(self, writable: bool = False, hold_live: bool = False) -> None:
        self._maps: Dict[Tuple[int, int], Tuple[int, int, np.ndarray]] = {}
        self._writable, self._hold_live = writable, hold_live
        self._lock = threading.Lock()

    def view(self, pid: int, words: Tuple[int, int, int, int], address: int,
             nbytes: int) -> Optional[np.ndarray]:
        """The peer's ``nbytes`` at ``address`` as an array of this process, or None (no
        segment, or it cannot be mapped: reach it with cross-memory attach)."""
        fd, inode, base, length = words
        if not inode or not (base <= address and address + nbytes <= base + length):
            return None
        key = (pid, inode)
        with self._lock:
            mapped = self._maps.get(key)
            if mapped is None or mapped[0] != base or mapped[2].nbytes < length:
                mapped = self._map(pid, fd, inode, base, length)
                if mapped is None:
                    return None
                self._make_room()
                self._maps[key] = mapped
        offset = address - base
        return mapped[2][offset:offset + nbytes]

    def address(self, pid: int, words: Tuple[int, int, int, int], address: int) -> Optional[int]:
        """This process's address of the peer's byte at ``address`` (inside the segment
        ``words`` name), or None."""
        found = self.view(pid, words, address, 1)
        return None if found is None else found.ctypes.data

    def __len__(self) -> int:
        return len(self._maps)

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()

    def _map(self, pid: int, fd: int, inode: int, base: int,
             length: int) -> Optional[Tuple[int, int, np.ndarray]]:
        flags, prot = ((os.O_RDWR, mmap.PROT_READ | mmap.PROT_WRITE) if self._writable
                       else (os.O_RDONLY, mmap.PROT_READ))
        try:
            handle = os.open(f"/proc/{pid}/fd/{fd}", flags)
        except OSError:
            return None
        try:
            if os.fstat(handle).st_ino != inode:  # the peer closed it since its offer
                return None
            area = mmap.mmap(handle, length, prot=prot)
        except (OSError, ValueError):
            return None
        finally:
            os.close(handle)
        return base, fd, np.frombuffer(area, np.uint8)

    def _make_room(self) -> None:
        """Before a new mapping: past ``KEEP`` mappings drop the oldest, or (``hold_live``)
        drop every one whose owner has closed it."""
        if not self._hold_live:
            if len(self._maps) >= self.KEEP:
                self._maps.pop(next(iter(self._maps)))
            return
        for key, (_, fd, _) in list(self._maps.items()):
            pid, inode = key
            try:
                alive = os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode
            except OSError:
                alive = False
            if not alive:
                del self._maps[key]
