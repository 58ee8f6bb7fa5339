"""Memory of another process on this machine: Linux cross-memory attach
(``process_vm_readv`` / ``process_vm_writev``, as MPI libraries move large messages
inside a node).  A buffer is "exported" as (pid, address) and "imported" as a
``RemotePtr``; ``move`` copies between any two addresses, at least one in this process,
split over ``host_threads()`` threads; ``remote_reader`` reads a peer's array block by
block for a fold (``reduce_into``).  The host backend and the staged engine's
cross-memory transport move their bytes here.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ..config import host_threads
from .._errors import HocclError
from .._threads import run_parts, split

__all__ = ["FOLD_BLOCK_BYTES", "RemotePtr", "move", "move_piece", "remote_reader"]


@dataclass(frozen=True)
class RemotePtr:
    """An address in another process on this host."""
    pid: int
    address: int

    def __add__(self, offset: int) -> "RemotePtr":
        return RemotePtr(self.pid, self.address + int(offset))


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)


def _cross_process(function_name: str, pid: int, local: int, remote: int, nbytes: int) -> None:
    function = getattr(_libc, function_name)
    done = 0
    while done < nbytes:
        local_vec = _IoVec(local + done, nbytes - done)
        remote_vec = _IoVec(remote + done, nbytes - done)
        moved = function(pid, ctypes.byref(local_vec), 1, ctypes.byref(remote_vec), 1, 0)
        if moved <= 0:
            error = ctypes.get_errno()
            hint = ("; cross-process host transfers need ptrace permission between the ranks "
                    "(same user and kernel.yama.ptrace_scope=0, or root)"
                    if error == errno.EPERM else
                    "; the peer process is gone" if error == errno.ESRCH else "")
            raise HocclError(f"{function_name}: moving {nbytes} bytes with process {pid} failed: "
                             f"{os.strerror(error)} (errno {error}){hint}")
        done += moved


#: a move of at least twice this many bytes is split into pieces of at least this many,
#: one per thread (``hoccl.config.host_threads``)
MOVE_PIECE_BYTES = 4 << 20


def move(dst: Any, src: Any, nbytes: int, piece_bytes: Optional[int] = None) -> None:
    """memmove between any two addresses, at least one in this process; a move of two
    pieces (``MOVE_PIECE_BYTES`` unless given) or more split over threads (``_threads``),
    unless its ranges overlap (a piece would read bytes another had already written)."""
    pieces = min(host_threads(), nbytes // (piece_bytes or MOVE_PIECE_BYTES))
    if pieces < 2 or _overlap(dst, src, nbytes):
        move_piece(dst, src, nbytes)
    else:
        run_parts(lambda start, stop: move_piece(dst + start, src + start, stop - start),
                  split(nbytes, pieces, 64))


def _overlap(dst: Any, src: Any, nbytes: int) -> bool:
    """Whether [dst, dst + nbytes) and [src, src + nbytes) share bytes other than exactly."""
    dst, src = (x if isinstance(x, RemotePtr) else RemotePtr(os.getpid(), x) for x in (dst, src))
    return dst.pid == src.pid and 0 < abs(dst.address - src.address) < nbytes


def move_piece(dst: Any, src: Any, nbytes: int) -> None:
    if nbytes == 0:
        return
    if isinstance(dst, RemotePtr) and isinstance(src, RemotePtr):
        bounce = np.empty(nbytes, dtype=np.uint8)
        _cross_process("process_vm_readv", src.pid, bounce.ctypes.data, src.address, nbytes)
        _cross_process("process_vm_writev", dst.pid, bounce.ctypes.data, dst.address, nbytes)
    elif isinstance(dst, RemotePtr):
        _cross_process("process_vm_writev", dst.pid, src, dst.address, nbytes)
    elif isinstance(src, RemotePtr):
        _cross_process("process_vm_readv", src.pid, dst, src.address, nbytes)
    else:
        ctypes.memmove(dst, src, nbytes)


#: the block a fold that reads a peer's memory folds at a time (``reduce_into``'s
#: ``block_bytes``): each thread's read lands in its core's cache before it is summed, and
#: a few MiB still spread over every helper thread (each takes two blocks or more)
FOLD_BLOCK_BYTES = 1 << 20


def remote_reader(address: RemotePtr, dtype: np.dtype) -> Callable[[int, int], np.ndarray]:
    """A ``reduce_into`` input in another process: elements [start, stop) from ``address``
    read into a block-sized buffer of the reading thread's own (each thread of a fold
    reads its own blocks)."""
    itemsize = dtype.itemsize
    bounces = threading.local()

    def read(start: int, stop: int) -> np.ndarray:
        bounce = getattr(bounces, "array", None)
        if bounce is None or bounce.shape[0] < stop - start:
            bounce = bounces.array = np.empty(stop - start, dtype)
        move_piece(bounce.ctypes.data, address + start * itemsize, (stop - start) * itemsize)
        return bounce[:stop - start]
    return read
