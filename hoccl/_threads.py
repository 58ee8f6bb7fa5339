"""Helper threads for the host's large folds and copies: a range cut into contiguous parts
that run at once, one on the calling thread and the others on a shared pool.

numpy's ufuncs and copies, ``ctypes.memmove`` and the cross-memory-attach calls
(``process_vm_readv``/``_writev``) release the GIL, so a fold or a copy of hundreds of MiB
split over a few threads runs on a few cores' share of the memory's bandwidth instead of
one.  The parts are elementwise work on disjoint ranges: a split changes no bit of the
result.  How many threads a caller asks for is ``hoccl.config.host_threads()``
(``HOCCL_HOST_THREADS``); this module imports nothing of hoccl, so ``hoccl._dtypes`` may use
it while the scheduler, which imports ``hoccl._dtypes``, stays free of it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, List, Optional, Sequence, Tuple

__all__ = ["split", "run_parts"]

_LOCK = threading.Lock()
_POOL: Optional[ThreadPoolExecutor] = None
_POOL_WORKERS = 0
_ON_POOL = threading.local()  # ``worker`` is set on the pool's own threads
#: the pool's threads at most: it starts one only when none is idle, so it holds as many
#: as the parts that run at once (two levels of a pipelined call fold and read beside
#: each other: a part never waits behind another caller's)
POOL_THREADS = 32


def split(total: int, parts: int, align: int = 1) -> List[Tuple[int, int]]:
    """``[start, stop)`` of at most ``parts`` contiguous pieces that cover ``range(total)``
    in order, as equal as starts on multiples of ``align`` allow (a cache line's elements,
    so that no two threads write one line)."""
    step = -(-total // max(1, parts))
    step = max(align, -(-step // align) * align)
    return [(start, min(total, start + step)) for start in range(0, total, step)]


def run_parts(task: Callable[[int, int], None], bounds: Sequence[Tuple[int, int]]) -> None:
    """``task(start, stop)`` for every bound: the first on this thread, the others on the
    pool at the same time.  Every part has finished when it returns or raises; the first
    error, in ``bounds``' order, is raised (this thread's own part first).  On a pool thread
    (a part whose work splits again) every part runs here, in turn: a pool thread waiting
    for the pool could wait for ever."""
    if len(bounds) < 2 or getattr(_ON_POOL, "worker", False):
        for start, stop in bounds:
            task(start, stop)
        return
    with _LOCK:  # no pool is replaced between taking it and handing it the parts
        pool = _pool(len(bounds) - 1)
        futures: List[Future] = [pool.submit(task, start, stop) for start, stop in bounds[1:]]
    try:
        task(*bounds[0])
    finally:
        wait(futures)
    for future in futures:
        future.result()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The shared pool, for at least ``workers`` threads (made on first use; it grows
    to ``POOL_THREADS`` as callers run at once); under ``_LOCK``.  A smaller pool is
    replaced: what it was handed still runs."""
    global _POOL, _POOL_WORKERS
    if _POOL is None or _POOL_WORKERS < workers:
        if _POOL is not None:
            _POOL.shutdown(wait=False)
        _POOL_WORKERS = max(workers, POOL_THREADS)
        _POOL = ThreadPoolExecutor(_POOL_WORKERS, thread_name_prefix="hoccl-host-part",
                                   initializer=_mark_worker)
    return _POOL


def _mark_worker() -> None:
    _ON_POOL.worker = True


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist there."""
    global _LOCK, _POOL, _POOL_WORKERS
    _LOCK, _POOL, _POOL_WORKERS = threading.Lock(), None, 0


os.register_at_fork(after_in_child=_forget_pool)
