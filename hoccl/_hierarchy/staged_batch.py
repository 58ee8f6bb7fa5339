"""The staged engine's batches of sends and receives (``StagedEngine.batch``, what
``hoccl.group()`` hands a level across hosts).

Every pair of a batch is posted to the transport before any is waited for, so no order
of the pairs waits in a cycle; each is cut into the chunks a single send or receive
takes (one message where no member of the level stages, else ``stage_bytes``), so a
pair matches its peer's whether the peer batched it or not::

    device member:  copy every send out (copy engines) | post every chunk | wait all |
                    copy every receive in | wait for the copies
    host member:    post every chunk of its own arrays | wait all

A device member's copies do not overlap the wire here (a single send's chunk pipeline
does); its pinned memory, one array a pair, is kept for the next batch.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from .._errors import InvalidArgumentError
from .arrays import address
from .engine import Pair
from .folding import _to_numpy

__all__ = ["BatchStage", "run_batch"]


class BatchStage:
    """A staged engine's memory for batches: pinned host arrays (``pinned(nbytes)``,
    freed by ``unpinned``), one a pair, and the event a batch's copies are waited on."""

    def __init__(self, pinned: Callable[[int], np.ndarray],
                 unpinned: Callable[[np.ndarray], None]):
        self._pinned, self._unpinned = pinned, unpinned
        self._memory: List[np.ndarray] = []
        self._event: Any = None

    def memory(self, sizes: List[int]) -> List[np.ndarray]:
        """Pinned bytes of each size, in order (grown where a pair needs more)."""
        for index, nbytes in enumerate(sizes):
            if index == len(self._memory):
                self._memory.append(self._pinned(nbytes))
            elif self._memory[index].nbytes < nbytes:
                self._unpinned(self._memory[index])
                self._memory[index] = self._pinned(nbytes)
        return [self._memory[index][:nbytes] for index, nbytes in enumerate(sizes)]

    def event(self, device: Any) -> Any:
        if self._event is None:
            self._event = device.create_event()
        return self._event

    def close(self, device: Optional[Any]) -> None:
        """Free the memory and the event (after the copies that used them).  Idempotent."""
        if self._event is not None and device is not None:
            device.destroy_event(self._event)
        self._event = None
        for memory in self._memory:
            self._unpinned(memory)
        self._memory.clear()


def run_batch(engine: Any, stage: BatchStage, pairs: Sequence[Pair], stream: Any) -> None:
    """``pairs`` on the staged ``engine`` (the module docstring); ``stream``: the phase's
    stream (None on the host backend)."""
    what = "send/recv batch"
    engine._refuse_if_broken(what)
    pairs = [pair for pair in pairs if pair[1].shape[0]]
    if not pairs:
        return
    arrays = [array for _, array, _ in pairs]
    on_host = engine.direct or engine._on_host(arrays)
    device = engine.device
    if not on_host and device is None:
        raise InvalidArgumentError(f"{what} across hosts ({engine.label}): device arrays on a "
                                   f"rank without hoccl's cuda backend")

    def copied(work: Any, what_copies: str) -> None:
        event = stage.event(device)
        device.record(work, event)
        engine._copied(device, event, f"{what} ({what_copies})")
    if on_host:
        hosts = [_to_numpy(array).view(np.uint8) for array in arrays]
    else:
        device.activate()
        hosts = stage.memory([address(array)[1] for array in arrays])
        work = device.resolve_stream(stream, [])
        for (kind, array, _), host in zip(pairs, hosts):
            if kind == "send":
                device.copy(work, host.ctypes.data, address(array)[0], host.nbytes)
        copied(work, "copy out")
    requests = []
    for (kind, array, peer), host in zip(pairs, hosts):
        item = array.element_size() if hasattr(array, "element_size") else array.dtype.itemsize
        width = host.nbytes if engine.direct else max(1, engine.stage_bytes // item) * item
        post = engine.transport.send if kind == "send" else engine.transport.recv
        requests += [post(host[a:a + width], peer) for a in range(0, host.nbytes, width)]
    for request in requests:
        engine._transferred(request, what)
    if not on_host:
        for (kind, array, _), host in zip(pairs, hosts):
            if kind == "recv":
                device.copy(work, address(array)[0], host.ctypes.data, host.nbytes)
        copied(work, "copy in")

