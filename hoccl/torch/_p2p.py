"""send and recv as torch issues them: one at a time, to be matched as a batch.

``batch_isend_irecv`` on a Python process group calls ``isend``/``irecv`` one by one,
with nothing around them, and under mpirun a hoccl send waits on the host until its
peer makes the matching recv: issued at once, a ring (every rank sends to the next and
receives from the previous) would wait in a cycle.  So a send or recv is held, and
every held one is issued together when anything needs one of them: a ``wait()``,
``is_completed()`` or ``get_future()`` of its Work, or any other call on any hoccl
process group of this process (which keeps the calls of every group in program order).

The held calls are issued inside ``hoccl.group()``: every rank's batch is matched with
its peers' batches as a whole, whatever the order of its calls.  A batch goes out in
rounds, the k-th round holding the k-th call of each (communicator, peer, direction):
round k of every rank matches round k of its peers, and no round holds two calls of
one pair and direction (under mpirun such a group does not complete yet).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

import hoccl

from ._work import Launcher, Work

__all__ = ["HeldP2P", "issue_held"]

_HELD: List["HeldP2P"] = []


class HeldP2P(Work):
    """A send (``kind="send"``) or recv of ``tensor`` with ``peer``, held until needed.

    On cuda it keeps its place on the caller's stream: the side stream it is issued on
    waits for an event recorded on the current stream when it was called."""

    def __init__(self, launcher: Launcher, kind: str, buffer: torch.Tensor,
                 tensor: torch.Tensor, peer: int):
        super().__init__(launcher, [tensor])
        self.kind, self.buffer, self.peer = kind, buffer, peer
        self.ready: Any = (None if launcher.device is None
                           else launcher.record(torch.cuda.current_stream(launcher.device)))
        self.issued = False
        _HELD.append(self)

    def settle(self) -> None:
        if not self.issued:
            issue_held()

    def issue(self) -> None:
        launcher = self.launcher
        stream = None
        if launcher.device is not None:
            stream = launcher.side_stream()
            stream.wait_event(self.ready)
            self.buffer.record_stream(stream)  # the caller may drop it without waiting
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
    held = list(_HELD)
    _HELD.clear()
    for round_ in _rounds(held):
        with hoccl.group():
            for call in round_:
                call.issue()
    for call in held:
        call.finish()


def _rounds(held: List[HeldP2P]) -> List[List[HeldP2P]]:
    rounds: List[List[HeldP2P]] = []
    seen: Dict[Tuple[int, int, str], int] = {}
    for call in held:
        key = (id(call.launcher.comm), call.peer, call.kind)
        index = seen[key] = seen.get(key, -1) + 1
        if index == len(rounds):
            rounds.append([])
        rounds[index].append(call)
    return rounds
