"""send and recv as torch issues them: one at a time, to be matched as a batch.

``batch_isend_irecv`` on a Python process group calls ``isend``/``irecv`` one by one,
with nothing around them, and under mpirun a hoccl send waits on the host until its
peer makes the matching recv: issued at once, a ring (every rank sends to the next and
receives from the previous) would wait in a cycle.  So a send or recv is held, and
every held one is issued together when anything needs one of them: a ``wait()``,
``is_completed()`` or ``get_future()`` of its Work, or any other call on any hoccl
process group of this process (which keeps the calls of every group in program order).

The held calls are issued inside ``hoccl.group()``.  Across hosts, one group: the
communicator posts every pair of it before it waits for any (``hoccl._hierarchy.pairs``),
so ranks that batch their sends and recvs differently (a pipeline schedule's) never wait
in a cycle.  Within a host a hoccl group matches its sends and recvs call by call and
issues them in call order as they match (``hoccl._groups.matching``), to the same end.

A recv from any source (``dist.recv(tensor)`` with no ``src``, host backend only) is
matched through the group's store (``SendCounts``): every send of the torch API adds
one to a counter of its (receiver, sender) pair when it is called, and the receiver
counts the recvs of the torch API it has issued from each sender.  hoccl matches the
k-th send of a pair with the k-th recv, so a sender whose count is ahead of the
receiver's has a send that no recv issued so far takes: the any-source recv becomes a
recv from it.  Until one is ahead, the recv stays held, and so does every later recv
of its group on this rank (a later recv issued first would take the sender's send
that the earlier recv must have, as MPI orders them); sends and collectives go on.
Waiting for the recv (or for a later recv of the group) polls the counters until a
sender is ahead, bounded by the communicator's timeout; an any-source recv whose wait
timed out is dropped (the recvs held behind it go on).
"""

from __future__ import annotations

import time
from typing import Any, List, Optional, Sequence

import torch

import hoccl

from .. import HocclTimeoutError, InvalidArgumentError
from .._mailbox import wait_until
from ._ops import movable
from ._work import Launcher, Work, WorkList

__all__ = ["HeldP2P", "SendCounts", "issue_held", "exchange", "even_splits"]

_HELD: List["HeldP2P"] = []


class SendCounts:
    """The counters that match a group's recvs from any source, on the host backend.

    ``store``: the group's torch store.  ``announce(peer)``: this rank called a send to
    ``peer`` (one store round trip).  ``received[peer]``: the recvs from ``peer`` this
    rank has issued.  ``source()``: a peer whose sends are ahead of the recvs issued from
    it, or None (one round trip per peer); peers are tried in turn after the last one
    chosen, so that one busy sender does not starve the others."""

    def __init__(self, store: Any, rank: int, world_size: int):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.received = [0] * world_size
        self._last = rank

    def _key(self, receiver: int, sender: int) -> str:
        return f"hoccl/sends/{receiver}/{sender}"

    def announce(self, peer: int) -> None:
        self.store.add(self._key(peer, self.rank), 1)

    def sent(self) -> List[int]:
        """How many sends to this rank each rank has called so far (0 for itself)."""
        return [0 if peer == self.rank else self.store.add(self._key(self.rank, peer), 0)
                for peer in range(self.world_size)]

    def source(self) -> Optional[int]:
        sent = self.sent()
        for step in range(1, self.world_size + 1):  # every rank, the last chosen last
            peer = (self._last + step) % self.world_size
            if peer != self.rank and sent[peer] > self.received[peer]:
                self._last = peer
                return peer
        return None


class HeldP2P(Work):
    """A send (``kind="send"``) or recv of ``tensor`` with ``peer``, held until needed.

    ``counts``: the group's ``SendCounts`` for a recv of the torch API on the host
    backend (counted when issued); ``peer=None`` with it: a recv from any source, whose
    peer is chosen when a sender is ahead (``source_rank()`` then tells it).

    On cuda it keeps its place on the caller's stream: the side stream it is issued on
    waits for an event recorded on the current stream when it was called."""

    def __init__(self, launcher: Launcher, kind: str, buffer: torch.Tensor,
                 tensor: torch.Tensor, peer: Optional[int],
                 counts: Optional[SendCounts] = None):
        super().__init__(launcher, [tensor])
        # hoccl refuses to write into a tensor autograd tracks; torch's collectives are
        # not recorded by autograd, so the call writes through a detached view
        self.kind, self.peer = kind, peer
        self.buffer = buffer.detach() if buffer.requires_grad else buffer
        self.counts = counts
        self.ready: Any = (None if launcher.device is None
                           else launcher.record(torch.cuda.current_stream(launcher.device)))
        self.issued = False
        _HELD.append(self)

    def settle(self) -> None:
        if not self.issued:
            issue_held()
        if not self.issued:
            self._wait_for_a_sender()

    def is_completed(self) -> bool:
        if not self.issued:
            issue_held()
            if not self.issued:  # a recv from any source that no sender is ahead for yet
                return False
        return super().is_completed()

    def _source_rank(self) -> int:
        """The group rank this recv received from (torch's ``recv`` asks it when no
        ``src`` was given)."""
        self.settle()
        assert self.peer is not None
        return self.peer

    def _wait_for_a_sender(self) -> None:
        """Poll the send counters until the held recv before this call (or this call, an
        any-source recv) has a sender and this call is issued."""
        comm = self.launcher.comm
        started = time.monotonic()

        def ready() -> bool:
            issue_held()
            return self.issued

        def describe() -> str:
            counts = next(call.counts for call in _HELD  # the first unmatched one
                          if call.launcher is self.launcher and call.peer is None)
            assert counts is not None
            what = ("this recv from any source" if self.peer is None else
                    f"this {self.kind} with rank {self.peer}, held behind a recv from any "
                    f"source of the same group (hoccl matches a rank's recvs in order),")
            return (f"recv: rank {comm.rank} waited {time.monotonic() - started:.1f} s for "
                    f"{what} to find a sender: no rank of the group has called a send to it "
                    f"that the recvs issued so far do not take (sends called to it, by "
                    f"rank: {counts.sent()}; recvs issued: {counts.received})")
        try:
            wait_until(ready, started + comm.timeout, describe)
        except HocclTimeoutError:
            if self.peer is None:  # dropped: a later send to this rank goes to a later recv
                _HELD.remove(self)
            raise

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
            self.mark = launcher.position()
        else:
            self.stream = launcher.side_stream()
            self.event = launcher.record(self.stream)


def issue_held() -> None:
    """Issue every held send and recv of this process that can go, as one batch: all but
    a recv from any source that no sender is ahead for yet and the recvs of its group
    after it, which stay held, in order."""
    if not _HELD:
        return
    held = list(_HELD)
    _HELD.clear()
    going: List[HeldP2P] = []
    staying: List[HeldP2P] = []
    blocked = set()  # launchers (groups) with a recv from any source still unmatched
    for call in held:
        if call.kind == "recv":
            if id(call.launcher) in blocked:
                staying.append(call)
                continue
            if call.counts is not None:
                if call.peer is None:
                    call.peer = call.counts.source()
                    if call.peer is None:
                        blocked.add(id(call.launcher))
                        staying.append(call)
                        continue
                call.counts.received[call.peer] += 1
        going.append(call)
    _HELD[:0] = staying
    with hoccl.group():
        for call in going:
            call.issue()
    for call in going:
        call.finish()


def even_splits(call: str, tensor: torch.Tensor, world_size: int) -> List[int]:
    """``tensor``'s dim 0 cut in ``world_size`` equal parts (all_to_all with no split sizes)."""
    rows = tensor.size(0) if tensor.dim() else 1
    if rows % world_size:
        raise InvalidArgumentError(f"{call}: with no split sizes, dim 0 ({rows}) must be a "
                                   f"multiple of the world size {world_size}")
    return [rows // world_size] * world_size


def exchange(launcher: Launcher, call: str, receives: Sequence[torch.Tensor],
             sends: Sequence[torch.Tensor], outputs: List[torch.Tensor],
             async_op: bool) -> Any:
    """An all_to_all whose chunks may differ in size: chunk ``p`` of ``sends`` to rank p,
    into chunk ``r`` of rank p's ``receives``; the own chunk by a local copy on the
    current stream, every other non-empty one by a send/recv pair, all issued as one
    batch (across hosts too: ``hoccl._hierarchy.pairs``)."""
    rank, world_size = launcher.comm.rank, launcher.comm.world_size
    for send, receive in zip(sends, receives):
        if send.dtype != receive.dtype:
            raise InvalidArgumentError(f"{call}: input and output must have one dtype; got "
                                       f"{send.dtype} and {receive.dtype}")
    own_send, own_receive = sends[rank], receives[rank]
    if own_send.numel() != own_receive.numel():
        raise InvalidArgumentError(f"{call}: this rank sends itself {own_send.numel()} "
                                   f"elements but receives {own_receive.numel()}")
    own_receive.copy_(own_send.view_as(own_receive))
    works: List[Any] = []
    for peer in range(world_size):
        if peer == rank:
            continue
        for kind, chunk in (("send", sends[peer]), ("recv", receives[peer])):
            if chunk.numel():
                works.append(HeldP2P(launcher, kind, movable(chunk), chunk, peer))
    issue_held()
    work = WorkList(works, outputs)
    if not async_op:
        work.wait()
    return work

