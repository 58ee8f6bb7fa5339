"""Host memory that members on one machine map into each other's address space.

The staged engine's own host memory (a GPU member's pinned slots, a host member's slots
and offered copies) lives in memfd segments (``shared_bytes``).  An offer of a piece
inside one names the segment (``segment_words``); the peer maps the segment once
(``PeerSegments``: ``/proc/<pid>/fd/<fd>``, which needs the same permission as
cross-memory attach) and reads the piece with plain loads, where ``process_vm_readv``
moves 4.5–6.6 GB/s a process on the H200 machine.  A piece outside every segment (a
caller's own array) is read with cross-memory attach, and so is any piece whose
segment cannot be mapped.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import Dict, Optional, Tuple

import numpy as np

__all__ = ["PeerSegments", "shared_bytes", "segment_words", "NO_SEGMENT"]

#: an offer's segment words where the piece lies in no segment
NO_SEGMENT = (0, 0, 0, 0)
#: this process's segments: base address -> (end, fd, inode)
_OWNED: Dict[int, Tuple[int, int, int]] = {}
_LOCK = threading.Lock()


def shared_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` of host memory in a segment of its own that peers may map; freed (its
    file closed) once no array uses it.  Where the system makes no such segments, plain
    anonymous memory (peers then read it by cross-memory attach, or MPI moves it)."""
    try:
        fd = os.memfd_create("hoccl-stage", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # not Linux, or a kernel before 3.17
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
    weakref.finalize(area, _release, base, fd)
    return memory[:nbytes]


def _release(base: int, fd: int) -> None:
    with _LOCK:
        _OWNED.pop(base, None)
    os.close(fd)


def segment_words(piece: np.ndarray) -> Tuple[int, int, int, int]:
    """(fd, inode, base, length) of the segment of this process that holds ``piece``, or
    ``NO_SEGMENT``."""
    start, end = piece.ctypes.data, piece.ctypes.data + piece.nbytes
    with _LOCK:
        for base, (stop, fd, inode) in _OWNED.items():
            if base <= start and end <= stop:
                return fd, inode, base, stop - base
    return NO_SEGMENT


class PeerSegments:
    """The segments of peers mapped into this process, by (pid, inode): a segment is
    mapped at its first offer and kept (its owner reuses its slots), the oldest dropped
    past ``KEEP``."""

    KEEP = 16

    def __init__(self) -> None:
        self._maps: Dict[Tuple[int, int], Tuple[int, np.ndarray]] = {}

    def view(self, pid: int, words: Tuple[int, int, int, int], address: int,
             nbytes: int) -> Optional[np.ndarray]:
        """The peer's ``nbytes`` at ``address`` as a read-only array of this process, or
        None (no segment, or it cannot be mapped: read it with cross-memory attach)."""
        fd, inode, base, length = words
        if not inode or not (base <= address and address + nbytes <= base + length):
            return None
        mapped = self._maps.get((pid, inode))
        if mapped is None or mapped[0] != base or mapped[1].nbytes < length:
            mapped = self._map(pid, fd, inode, base, length)
            if mapped is None:
                return None
        offset = address - base
        return mapped[1][offset:offset + nbytes]

    def _map(self, pid: int, fd: int, inode: int, base: int,
             length: int) -> Optional[Tuple[int, np.ndarray]]:
        try:
            handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
        except OSError:
            return None
        try:
            if os.fstat(handle).st_ino != inode:  # the peer closed it since its offer
                return None
            area = mmap.mmap(handle, length, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(handle)
        if len(self._maps) >= self.KEEP:
            self._maps.pop(next(iter(self._maps)))
        mapped = (base, np.frombuffer(area, np.uint8))
        self._maps[pid, inode] = mapped
        return mapped
