"""send and recv as torch issues them: one at a time, to be matched as a batch.

``batch_isend_irecv`` on a Python process group calls ``isend``/``irecv`` one by one,
with nothing around them, and under mpirun a hoccl send waits on the host until its
peer makes the matching recv: issued at once, a ring (every rank sends to the next and
receives from the previous) would wait in a cycle.  So a send or recv is held, and
every held one is issued together when anything needs one of them: a ``wait()``,
``is_completed()`` or ``get_future()`` of its Work, or any other call on any hoccl
process group of this process (which keeps the calls of every group in program order).

The held calls are issued inside ``hoccl.group()`` and in one order on every rank:
pairs of ranks in rank order, within a pair the lower rank's sends first, then the
order of the calls.  Either alone lets every rank's batch match its peers'.
"""

from __future__ import annotations

import contextlib
from typing import Any, List

import torch

import hoccl

from ._work import Work

__all__ = ["HeldP2P", "issue_held"]

_HELD: List["HeldP2P"] = []


class HeldP2P(Work):
    """A send (``kind="send"``) or recv of ``tensor`` with ``peer``, held until needed.

    On cuda it keeps its place on the caller's stream: the side stream it is issued on
    waits for an event recorded on the current stream when it was called."""

    def __init__(self, group: Any, kind: str, buffer: torch.Tensor, tensor: torch.Tensor,
                 peer: int):
        launcher = group.launcher
        super().__init__(launcher, [tensor])
        self.group, self.kind, self.buffer, self.peer = group, kind, buffer, peer
        self.ready = (None if launcher.device is None
                      else launcher.record(torch.cuda.current_stream(launcher.device)))
        self.issued = False
        _HELD.append(self)

    def settle(self) -> None:
        if not self.issued:
            issue_held()

    def order(self) -> tuple:
        rank = self.launcher.comm.rank
        low, high = min(rank, self.peer), max(rank, self.peer)
        sender = rank if self.kind == "send" else self.peer
        return (self.group.group_name, low, high, sender != low)

    def issue(self) -> None:
        launcher = self.launcher
        stream = None
        if launcher.device is not None:
            stream = launcher.side_stream()
            stream.wait_event(self.ready)
        getattr(launcher.comm, self.kind)(self.buffer, self.peer, stream=stream)

    def finish(self) -> None:
        self.issued = True
        launcher = self.launcher
        if launcher.device is None:
            self.mark = launcher.comm.calls
        else:
            self.stream = launcher.side_stream()
            self.event = launcher.record(self.stream)


def issue_held() -> None:
    """Issue every held send and recv of this process, as one batch."""
    if not _HELD:
        return
    held = sorted(_HELD, key=HeldP2P.order)  # stable: calls of one pair keep their order
    _HELD.clear()
    with _together():
        for call in held:
            call.issue()
    for call in held:
        call.finish()


def _together() -> Any:
    group = getattr(hoccl, "group", None)
    return group() if group is not None else contextlib.nullcontext()
