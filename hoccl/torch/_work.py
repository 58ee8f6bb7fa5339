"""Where a torch-level call runs, and the Work it returns.

On the cuda backend a call is ordered on a stream like NCCL's: a synchronous call runs
on torch's current stream; an asynchronous one on the communicator's side stream, after
the work already on the current stream, and its Work's ``wait()`` makes the current
stream wait for it without blocking the host::

    current ──record──────────────────────────────── wait(done) ── (after work.wait())
    side          wait ── hoccl call (fences) ── record(done)

On the host backend hoccl's calls run on the rank's worker thread and torch reads CPU
tensors on the main thread, so a synchronous call returns only once its output is
written, and ``wait()`` blocks until then.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import HocclError

__all__ = ["Launcher", "Mark", "Work", "WorkList"]


class Launcher:
    """Runs calls of one communicator on the right stream and makes their Work."""

    def __init__(self, comm: Any):
        from .._hierarchy import HierarchicalCommunicator
        self.comm = comm
        self.device = None if comm.backend == "host" else torch.device("cuda", comm.device)
        self._side: Optional[torch.cuda.Stream] = None
        self.across_hosts = isinstance(comm, HierarchicalCommunicator)
        # across hosts on the host backend a call returns once its phases are done
        self._done_on_return = comm.backend == "host" and self.across_hosts

    def position(self) -> int:
        """Host backend: the communicator's calls so far (what ``finished`` takes)."""
        return 0 if self._done_on_return else self.comm.calls

    def finished(self, mark: int) -> bool:
        """Host backend: whether the calls up to ``mark`` have finished."""
        return self._done_on_return or self.comm.finished(mark)

    def wait_host(self, mark: int) -> None:
        """Block until the calls up to ``mark`` have finished (bounded by the timeout)."""
        if not self.finished(mark):
            self.comm.synchronize()

    def side_stream(self) -> "torch.cuda.Stream":
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        return self._side

    def run(self, issue: Callable[[Any], Optional[Callable[[], None]]],
            outputs: List[torch.Tensor], tensors: Sequence[torch.Tensor], async_op: bool, *,
            blocking: bool = False, mark: bool = False) -> Any:
        """``issue(stream)`` makes the hoccl calls, and the torch ops they need first, on
        ``stream`` (None on the host backend); it may return torch work on the outputs
        that must follow them.  ``tensors`` are every tensor the call touches.
        ``blocking`` Works make ``wait()`` block the host too (barrier).  ``mark``: a
        synchronous call whose caller needs no Work gets a ``Mark`` instead (no event).

        Temporaries are made inside ``issue``, on the stream that uses them.  On the host
        backend a synchronous or blocking call, or one with work to follow, waits for
        its output before it returns (that work is torch work on the host)."""
        if self.device is None:
            post = issue(None)
            work = Work(self, outputs, mark=self.position())
            if post is not None or blocking or not async_op:
                work.wait()
                if post is not None:
                    post()
            return work
        current = torch.cuda.current_stream(self.device)
        stream = current
        on_stream: Any = contextlib.nullcontext()  # the stream is current already
        if async_op:
            stream = self.side_stream()
            stream.wait_stream(current)
            for tensor in tensors:  # the caching allocator must not reuse them before the call ends
                tensor.record_stream(stream)
            on_stream = torch.cuda.stream(stream)
        with on_stream:
            post = issue(stream)
            if post is not None:
                post()
        if mark and not async_op:
            return Mark(self, self.position())
        return Work(self, outputs, event=self.record(stream), stream=stream, blocking=blocking)

    def record(self, stream: "torch.cuda.Stream") -> "torch.cuda.Event":
        event = torch.cuda.Event()
        event.record(stream)
        return event


class Mark:
    """A synchronous call's place among its communicator's calls (``Communicator.calls``
    after it), for what must order later work after the call but needs no Work (the
    FSDP2 hooks' pool): ``block_current_stream()`` and ``is_completed()``, through the
    communicator's completion word rather than an event."""

    __slots__ = ("launcher", "value")

    def __init__(self, launcher: Launcher, value: int):
        self.launcher = launcher
        self.value = value

    def block_current_stream(self) -> None:
        launcher = self.launcher
        if launcher.device is None:
            launcher.wait_host(self.value)
        else:
            launcher.comm.order_after(self.value,
                                      stream=torch.cuda.current_stream(launcher.device))

    def is_completed(self) -> bool:
        """Whether the call has finished (False after an abort: whatever the call's memory
        is, it stays held)."""
        try:
            return self.launcher.finished(self.value)
        except HocclError:
            return False


class Work(dist.Work):
    """One call's handle: ``wait()``, ``is_completed()``, ``get_future()``, ``result()``."""

    def __init__(self, launcher: Launcher, outputs: List[torch.Tensor], *, mark: int = 0,
                 event: Any = None, stream: Any = None, blocking: bool = False):
        super().__init__()
        self.launcher = launcher
        self.outputs = outputs
        self.mark = mark        # host backend: the communicator's call count after the call
        self.event = event      # cuda: a torch.cuda.Event recorded on ``stream`` after it
        self.stream = stream
        self.blocking = blocking

    def settle(self) -> None:
        """Make sure the call has been issued (held send/recv are issued here)."""

    def wait(self, timeout: Any = None) -> bool:
        self.settle()
        if self.launcher.device is None:
            self.launcher.wait_host(self.mark)
            return True
        torch.cuda.current_stream(self.launcher.device).wait_event(self.event)
        if self.blocking:
            self.event.synchronize()
        return True

    def block_current_stream(self) -> None:
        self.settle()
        if self.launcher.device is None:
            self.launcher.wait_host(self.mark)
        else:
            torch.cuda.current_stream(self.launcher.device).wait_event(self.event)

    def is_completed(self) -> bool:
        self.settle()
        if self.launcher.device is None:
            return self.launcher.finished(self.mark)
        return self.event.query()

    def get_future(self) -> torch.futures.Future:
        """A future holding the outputs.  On cuda it is complete at once and carries the
        call's stream position (a consumer's ``wait()``/``then()`` orders its current
        stream after the call); on the host backend it is returned once the call has
        finished."""
        self.settle()
        if self.launcher.device is None:
            self.wait()
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(self.outputs)
            return future
        future = torch.futures.Future(devices=[self.launcher.device])
        with torch.cuda.stream(self.stream):
            future.set_result(self.outputs)
        return future

    def result(self) -> List[torch.Tensor]:
        return self.outputs

    def exception(self) -> Any:
        return None


class WorkList(dist.Work):
    """Several calls as one Work (a coalesced batch)."""

    def __init__(self, works: List[dist.Work], outputs: List[torch.Tensor]):
        super().__init__()
        self.works = works
        self.outputs = outputs

    def wait(self, timeout: Any = None) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def get_future(self) -> torch.futures.Future:
        futures = [work.get_future() for work in self.works]
        return torch.futures.collect_all(futures).then(lambda _: self.outputs)

    def result(self) -> List[torch.Tensor]:
        return self.outputs

    def exception(self) -> Any:
        return None
