"""UCX between hosts (``inter_host="ucx"``): the staged engine's steps as UCX tag messages,
through ``ucxx`` (``pip install 'hoccl[ucx]'``).

UCX picks the wire per pair of processes: shared memory or cross-memory attach on one
machine, TCP, InfiniBand or RoCE between machines (``UCX_TLS`` narrows the choice;
``describe()`` names those found).  One context and worker serve a process's communicators,
with an endpoint to every member of each level (this local rank's rail, and the world).  A
step is the ``PairTransport``'s pairwise messages (``transports.py``), all posted before any
is waited for; a tag names the channel, the sender and the message's place in the sender's
stream to that receiver, so no two steps' messages match.  Device arrays are staged through
pinned host memory; host arrays go as they are (two members' all_reduce folds as it moves).

A peer on another machine is reached in UCX's peer-failure mode: UCX's error handling (or
keepalive) sees its death.  The mode rules out the shared-memory transports (no failure
handler: TCP would be left), so a peer on this machine (host name, boot id, pid namespace)
gets an endpoint without it and its process is watched (``_Process.alive``, every 50 ms while
a request waits on it); cross-memory attach (``cma``) is then off: a cma read from a peer
that died ends the reader when no handler is installed.  Where ``UCX_TLS`` chooses the
transports (cma may be among them), or ``HOCCL_UCX_PEER_FAILURE=all``, every endpoint is in
the mode (``results/host/2026-12-06-ucx-wire``: sendrecv 0.45 GB/s, 3.9 over shared memory).
Either way a step raises ``PeerDeadError`` naming the member; a live peer that never makes
the matching call ends in the timeout.

MPI may bring its own UCX (the MPICH wheel does): whichever loads first is the one both use,
and ucxx's cannot load after an older one: ``hoccl.init(inter_host="ucx")`` loads it before
MPI where MPI is not loaded yet (``preload``); importing ``mpi4py.MPI`` first is an error
that says so.  With ``inter_host`` left to hoccl, UCX is chosen only where it loads on
every rank (always under torch's rendezvous: no MPI).
"""

from __future__ import annotations

import logging
import pickle
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import reduce_into
from .._errors import (AbortedError, HocclError, InvalidArgumentError, PeerClosedError,
                       PeerDeadError)
from .._mailbox import _Process, wait_until
from ..config import environ, host_threads
from .arrays import address
from .engine import Setup
from .staged import (SLOTS, BatchingStagedEngine, _itemsize, _overlap, _to_numpy,
                     block_parts)
from .transports import PairTransport, Transport
from .ucx_worker import _boot_id, _watchable, _Worker, available, preload, usable

__all__ = ["UcxBootstrap", "UcxStagedEngine", "UcxTransport", "available", "preload",
           "ucx_transports", "usable"]

log = logging.getLogger("hoccl")

#: bits of a tag: the communicator's channel, the sender's member index, the message's
#: place in the sender's stream to its receiver
_CHANNEL_BITS, _MEMBER_BITS, _SEQUENCE_BITS = 16, 16, 32
#: the member field's top bit: a receipt of a point-to-point receive, not data
_RECEIPT = 1 << (_MEMBER_BITS - 1)
#: the next bit: a peer's abort notice (``UcxTransport.notify``), its reason's bytes
_NOTICE = 1 << (_MEMBER_BITS - 2)
_NOTICE_BYTES = 512
#: the notice of a member that closed its communicator
_CLOSED = "closed"
#: seconds between two looks at the processes of the peers on this machine (``_done``)
_LIVENESS_PERIOD = 0.05
#: ``UcxStagedEngine.all_reduce``'s fold between two progresses, its chunk where none stages
_FOLD_PIECE_BYTES = _DIRECT_CHUNK_BYTES = 1 << 20


class UcxTransport(PairTransport):
    """Tag sends and receives between the members of one level, on the process's UCX
    worker (``PairTransport``: the collectives written once over them)."""

    def __init__(self, worker: _Worker, endpoints: Dict[int, Any], member: int, size: int,
                 channel: int, ranks: Sequence[int],
                 peer_lost: Callable[[str], None] = lambda gone: None,
                 watched: Optional[Dict[int, _Process]] = None):
        self._worker, self._endpoints = worker, endpoints
        #: the peers whose endpoints have no failure handling (on this machine), by
        #: member: their processes are watched instead
        self._watched = dict(watched or {})
        self._looked = time.monotonic()
        #: told of a peer found gone (the bootstrap's: under MPI the job is then aborted at
        #: exit, as MPI_Finalize would wait for the lost process)
        self.peer_lost = peer_lost
        self.size, self.member, self.channel = size, member, channel
        self.ranks = list(ranks)  # each member's world rank, for messages
        self.label = "ucx"
        self._sent = [0] * size      # messages posted to each member so far
        self._received = [0] * size  # receives posted from each member so far
        self._acks_sent = [0] * size      # receipts (``send``) sent to each member
        self._acks_received = [0] * size  # receipts posted for from each member
        #: receives whose receipt is not sent yet: sent as soon as they are done, whichever
        #: request is tested (a batch waits for its sends' receipts before its receives)
        self._unreceipted: List["_Receipted"] = []
        #: each peer's abort notice, awaited from connect on (``notify``)
        self._notices = {peer: np.zeros(_NOTICE_BYTES, np.uint8) for peer in endpoints}
        self._notice_requests = {
            peer: endpoint.tag_recv(worker.Array(self._notices[peer]), self._tag(peer | _NOTICE, 0))
            for peer, endpoint in endpoints.items()}
        self._told: List[Any] = []  # notices sent, with their bytes
        self._closed = False

    def send(self, buf: np.ndarray, peer: int) -> Any:
        """A send that is done once the peer has received it (its receipt came back), as
        MPI's synchronous send: UCX completes a small send at once, buffered, and a send
        whose receive never comes must end in the engine's timeout."""
        request = self._post([(peer, buf)], [])
        sequence = self._acks_received[peer]
        self._acks_received[peer] += 1
        receipt = np.zeros(1, np.uint8)
        request.append((peer, self._endpoints[peer].tag_recv(
            self._worker.Array(receipt), self._tag(peer | _RECEIPT, sequence)), receipt))
        return request

    def recv(self, buf: np.ndarray, peer: int) -> Any:
        """A receive that sends its receipt back once done (``send``)."""
        request = _Receipted(self._post([], [(peer, buf)]), peer)
        self._unreceipted.append(request)
        return request

    def _receipt(self, peer: int) -> Any:
        sequence = self._acks_sent[peer]
        self._acks_sent[peer] += 1
        receipt = np.zeros(1, np.uint8)
        return (peer, self._endpoints[peer].tag_send(
            self._worker.Array(receipt), self._tag(self.member | _RECEIPT, sequence)),
            receipt)

    def _tag(self, sender: int, sequence: int) -> Any:
        value = ((self.channel << (_MEMBER_BITS + _SEQUENCE_BITS)) | (sender << _SEQUENCE_BITS)
                 | (sequence & ((1 << _SEQUENCE_BITS) - 1)))
        return self._worker.api.UCXXTag(value)

    def _post(self, sends: Sequence[Tuple[int, np.ndarray]],
              recvs: Sequence[Tuple[int, np.ndarray]]) -> Any:
        Array, requests = self._worker.Array, []
        for peer, buf in recvs:
            sequence = self._received[peer]
            self._received[peer] += 1
            if buf.nbytes:
                requests.append((peer, self._endpoints[peer].tag_recv(
                    Array(buf), self._tag(peer, sequence)), buf))
        for peer, buf in sends:
            sequence = self._sent[peer]
            self._sent[peer] += 1
            if buf.nbytes:
                requests.append((peer, self._endpoints[peer].tag_send(
                    Array(buf), self._tag(self.member, sequence)), buf))
        return requests

    def notify(self, reason: str) -> None:
        """Tell every peer that this member aborted, with ``reason``: a peer waiting in a
        step with it stops with AbortedError instead of waiting out its timeout (as
        after a shrink that leaves it waiting for this member).  Once only; not waited."""
        if self._told or self._closed or not self._notice_requests:
            return
        text = np.frombuffer(reason.encode()[:_NOTICE_BYTES - 1], np.uint8)
        for peer, endpoint in self._endpoints.items():
            if not endpoint.alive:
                continue
            notice = np.zeros(_NOTICE_BYTES, np.uint8)
            notice[:text.nbytes] = text
            self._told.append((endpoint.tag_send(self._worker.Array(notice),
                                                 self._tag(self.member | _NOTICE, 0)), notice))
        self._worker.progress()

    def _noticed(self, peers: set) -> None:
        """Raise where a peer in ``peers`` (those a step still waits on) told it aborted
        (AbortedError) or closed (PeerClosedError): a peer that did its part of the step
        before it went fails nothing."""
        for peer, request in self._notice_requests.items():
            if peer in peers and request.completed and self._endpoints[peer].alive:
                try:
                    request.check_error()
                except Exception:  # noqa: BLE001 - cancelled at close: no notice
                    continue
                reason = self._notices[peer].tobytes().split(b"\0", 1)[0].decode(errors="replace")
                if reason == _CLOSED:
                    raise PeerClosedError(f"ucx: rank {self.ranks[peer]} closed the "
                                          f"communicator: the step will never be finished")
                raise AbortedError(f"ucx: rank {self.ranks[peer]} aborted: {reason}")

    def test(self, request: Any) -> bool:
        """Whether ``request`` is done; where it is not, a peer's abort or close notice
        (``notify``) raises.  A notice comes after the member's messages of every step it
        finished, so a step it finished is seen done first."""
        for _ in range(2):  # what came before the notice is taken first
            self._worker.progress()
            if self._unreceipted:
                self._send_receipts()
            if isinstance(request, _Receipted):
                if request.receipt is not None and self._done(request.receipt):
                    return True
            elif self._done(request):
                return True
        waiting = request.posted + (request.receipt or []) if isinstance(request, _Receipted) \
            else request
        if isinstance(request, _Receipted) and request.receipt is None:
            waiting = waiting + [(request.peer, None, None)]
        self._noticed({peer for peer, _, _ in waiting})
        return False

    def _send_receipts(self) -> None:
        """A receipt back for every receive now done."""
        waiting = []
        for request in self._unreceipted:
            if self._done(request.posted):
                request.receipt = [self._receipt(request.peer)]
            else:
                waiting.append(request)
        self._unreceipted = waiting

    def _done(self, request: List[Tuple[int, Any, np.ndarray]]) -> bool:
        """Whether every posted request of ``request`` is done (those done are dropped
        from it); a failed one, or a peer's closed endpoint, raises PeerDeadError.  Each
        holds its bytes: UCX reads or writes them until it is done."""
        pending = []
        for peer, posted, held in request:
            if not posted.completed:
                pending.append((peer, posted, held))
                continue
            try:
                posted.check_error()
            except Exception as error:  # noqa: BLE001 - ucxx's errors have no common base
                raise self._failed(peer, error) from None
        for peer, _, _ in pending:
            endpoint = self._endpoints[peer]
            if not endpoint.alive:
                raise self._failed(peer, "its endpoint closed")
        if pending and self._watched and time.monotonic() - self._looked > _LIVENESS_PERIOD:
            self._looked = time.monotonic()
            for peer in {peer for peer, _, _ in pending}:
                process = self._watched.get(peer)
                if process is not None and not process.alive():
                    raise self._failed(peer, f"its process (pid {process.pid} on host "
                                             f"{process.host}) has exited")
        request[:] = pending
        return not pending

    def _failed(self, peer: int, why: Any) -> HocclError:
        gone = f"rank {self.ranks[peer]}, whose UCX endpoint failed ({why}),"
        self.peer_lost(gone)
        return PeerDeadError(f"ucx: member {peer} (rank {self.ranks[peer]}) of this level is "
                             f"gone: {why}")

    def close(self) -> None:
        if self._closed:
            return
        # the peers still waiting in a step with this member stop (``_noticed``)
        self.notify(_CLOSED)
        self._closed = True
        deadline = time.monotonic() + 1.0
        while any(not request.completed for request, _ in self._told) \
                and time.monotonic() < deadline:
            self._worker.progress()
        # closing an endpoint cancels its requests in flight (an aborted step's, the abort
        # notices awaited): UCX then writes into no memory freed after
        for endpoint in self._endpoints.values():
            if not endpoint.alive:  # failed (its peer gone): UCX closed it already, and
                continue            # closing it again crashes ucxx
            try:
                endpoint.close()
            except Exception:  # noqa: BLE001 - a peer gone meanwhile leaves nothing to close
                pass
        self._endpoints.clear()
        self._worker.release()


class UcxBootstrap:
    """A ``Bootstrap`` of some members of a world ``UcxTransport`` (``members``: their
    member indices, in the new rank order; this one among them), over the world's own
    endpoints: pairwise messages between the members alone, so that it never waits for a
    rank left out (``shrink``: the survivors meet through it).  Its messages carry a
    channel of their own (``channel``, the same on every member): whatever the world's
    aborted steps left unmatched never matches them."""

    def __init__(self, world: UcxTransport, members: Sequence[int], channel: int,
                 timeout: float, call: str):
        self._world, self._members = world, list(members)
        self.rank, self.world_size = self._members.index(world.member), len(self._members)
        self._timeout, self._call = timeout, call
        self._wire = UcxTransport(world._worker, world._endpoints, world.member, world.size,
                                  channel % (1 << _CHANNEL_BITS), world.ranks, world.peer_lost,
                                  world._watched)
        self.peer_lost = world.peer_lost
        self._wire._closed = True  # the endpoints stay the world transport's

    def _exchange(self, sends: List[Tuple[int, np.ndarray]],
                  recvs: List[Tuple[int, np.ndarray]], what: str) -> None:
        request = self._wire._post(sends, recvs)
        deadline = time.monotonic() + self._timeout
        wait_until(lambda: self._wire.test(request), deadline,
                   lambda: f"{self._call}: rank {self.rank} waited {self._timeout:g} s for "
                           f"the other ranks that go on to {what}; they never did")

    def allgather(self, value: Any) -> List[Any]:
        """Every member's ``value`` (picklable), in member order: the sizes, then the
        bytes."""
        mine = np.frombuffer(pickle.dumps(value), np.uint8)
        others = [member for member in self._members if member != self._world.member]
        sizes = {member: np.zeros(1, np.int64) for member in others}
        self._exchange([(member, np.array([mine.nbytes], np.int64).view(np.uint8))
                        for member in others],
                       [(member, sizes[member].view(np.uint8)) for member in others],
                       "swap their sizes")
        payloads = {member: np.empty(int(sizes[member][0]), np.uint8) for member in others}
        self._exchange([(member, mine) for member in others],
                       [(member, payloads[member]) for member in others], "swap their values")
        return [value if member == self._world.member else
                pickle.loads(payloads[member].tobytes()) for member in self._members]

    def barrier(self) -> None:
        self.allgather(None)

    def close(self) -> None:
        """Nothing to release: the endpoints belong to the world transport."""


def _byte_view(array: Any) -> Any:
    """A flat device array (torch or cupy) as its bytes, or None."""
    if array is None:
        return None
    if hasattr(array, "data_ptr"):  # torch
        import torch
        return array.view(torch.uint8)
    import cupy
    return array.view(cupy.uint8)


class _Receipted:
    """A point-to-point receive in flight (``UcxTransport.recv``): its posted requests,
    then its receipt's."""

    __slots__ = ("posted", "peer", "receipt")

    def __init__(self, posted: List[Tuple[int, Any, np.ndarray]], peer: int):
        self.posted, self.peer = posted, peer
        self.receipt: Optional[List[Tuple[int, Any, np.ndarray]]] = None


def ucx_transports(call: str, bootstrap: Any, groups: Sequence[Sequence[int]]
                   ) -> List[Optional[UcxTransport]]:
    """A transport over each group of world ranks that this rank is in (None for the
    others), every rank of ``bootstrap`` calling at once: one allgather swaps the worker
    addresses and agrees the channels."""
    try:
        worker = _Worker.take()
    except Exception as error:  # noqa: BLE001 - ImportError, or a UCX that cannot load
        loaded = "mpi4py.MPI" in sys.modules
        bootstrap.allgather(None)  # the others wait for this rank's address
        raise InvalidArgumentError(
            f"{call}: inter_host='ucx' needs ucxx (pip install 'hoccl[ucx]'), loaded before "
            f"MPI's own UCX" + (" (import ucxx before mpi4py.MPI)" if loaded else "")
            + f"; it failed: {error}"
        ) from None
    me = (_Process.this(), _boot_id())
    everyone = bootstrap.allgather((worker.address, worker.next_channel, me))
    missing = [rank for rank, item in enumerate(everyone) if item is None]
    if missing:
        worker.release()
        raise InvalidArgumentError(f"{call}: inter_host='ucx': ranks {missing} could not load "
                                   f"UCX (each says why)")
    channel = max(item[1] for item in everyone)
    worker.next_channel = channel + len(groups)
    rank = bootstrap.rank
    made: List[Optional[UcxTransport]] = []
    for index, group in enumerate(groups):
        if rank not in group:
            made.append(None)
            continue
        if index:
            worker.users += 1  # each transport releases the worker once
        member = list(group).index(rank)
        only = worker.failure_mode_only
        watched = {peer: everyone[world][2][0] for peer, world in enumerate(group)
                   if world != rank and _watchable(me, everyone[world][2], only)}
        endpoints = {
            peer: worker.api.UCXEndpoint.create_from_worker_address(
                worker.worker, worker.api.UCXAddress.create_from_buffer(everyone[world][0]),
                peer not in watched)
            for peer, world in enumerate(group) if world != rank}
        made.append(UcxTransport(worker, endpoints, member, len(group),
                                 (channel + index) % (1 << _CHANNEL_BITS), group,
                                 getattr(bootstrap, "peer_lost", lambda gone: None), watched))
    return made


class UcxStagedEngine(BatchingStagedEngine):
    """The staged engine over UCX (``UcxTransport``): hosts of any kinds.  An abort is told
    to the level's peers (``UcxTransport.notify``).

    ``HOCCL_UCX_DEVICE_MEMORY=1`` hands CUDA arrays to UCX as they are (its ``cuda_copy``,
    ``cuda_ipc`` and GPUDirect RDMA transports move them) instead of staging them through
    pinned host memory: each step first waits on the host for the caller's stream, and is
    done when UCX's requests are; its messages are a staged peer's (the same chunks).
    Off by default: between two GPU ranks on one H100 it moved an all_gather at 44 GB/s,
    but beside a peer in host memory the all_reduce fell to 0.09 GB/s, 28x slower than
    staged (``results/h100/2026-12-07b``)."""

    name = "ucx"
    transport: UcxTransport
    device_memory = False

    def _step(self, what: str, stream: Optional[int], count: int, send: Any, send_blocks: int,
              recv: Any, recv_blocks: int, start: Any) -> None:
        arrays = [array for array in (send, recv) if array is not None]
        if not (self.device_memory and arrays and self.device is not None
                and not self._on_host(arrays)):
            return super()._step(what, stream, count, send, send_blocks, recv, recv_blocks,
                                 start)
        self._refuse_if_broken(what)
        device = self.device
        device.synchronize_stream(device.resolve_stream(stream, arrays), self.timeout)
        send_bytes, recv_bytes = _byte_view(send), _byte_view(recv)
        if send_bytes is not None and recv_bytes is not None:
            (a, a_bytes), (b, b_bytes) = address(send_bytes), address(recv_bytes)
            if a < b + b_bytes and b < a + a_bytes and a != b:  # in place: UCX reads a copy
                send_bytes = send_bytes.clone() if hasattr(send_bytes, "clone") \
                    else send_bytes.copy()
        # the messages of a peer that stages (or is in host memory): ``_staged``'s chunks,
        # a chunk's piece of each block
        item = _itemsize(send if send is not None else recv)
        parts = block_parts(count, item, send_bytes, send_blocks, recv_bytes, recv_blocks)
        self._in_chunks(what, count, self.per_chunk(max(send_blocks, recv_blocks), item),
                        lambda a, b: start(*parts(a, b)))

    def _copied(self, device: Any, event: Any, what: str) -> None:
        """Wait for a stage copy, progressing UCX meanwhile: the chunks already posted move
        only while the worker is progressed (unless a thread of its own does it), and a
        GPU member waits for a chunk's copy out before each post."""
        progress = self.transport._worker.progress

        def done() -> bool:
            progress()
            return bool(device.done(event))
        self._wait(done, what)

    def all_reduce(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None:
        """Two members in host memory: the staged all_gather's messages, in ``_staged``'s
        chunks (at most ``_DIRECT_CHUNK_BYTES`` where none stages), ``2 * SLOTS`` in flight,
        each folded in member order once sent and received.  Else all_gather, then fold."""
        if not (self.size == 2 and recv.shape[0] and self._on_host([send, recv])):
            return super().all_reduce(send, recv, op, stream=stream)
        self._refuse_if_broken("all_reduce")
        send, recv = _to_numpy(send), _to_numpy(recv)
        if _overlap(send, recv) and send.ctypes.data != recv.ctypes.data:
            send = send.copy()  # a fold into recv would write over chunks not yet sent
        count, item, peer, slots = recv.shape[0], recv.dtype.itemsize, 1 - self.member, 2 * SLOTS
        chunk = self.per_chunk(2, item)  # the staged all_gather's, which a GPU peer posts
        if self.direct:  # no member stages: both cut alike, at most _DIRECT_CHUNK_BYTES
            chunk = min(chunk, max(1, _DIRECT_CHUNK_BYTES // item))
        piece, chunks = max(1, _FOLD_PIECE_BYTES // item), -(-count // chunk)
        theirs = self.scratch(recv, slots * min(chunk, count), None)  # a ring of chunks

        def post(k: int) -> Any:
            a, b, at = k * chunk, min(count, (k + 1) * chunk), k % slots * chunk
            return self.transport._post([(peer, send[a:b].view(np.uint8))],
                                        [(peer, theirs[at:at + b - a].view(np.uint8))])

        def fold(k: int, request: Any) -> None:
            a, b, at = k * chunk, min(count, (k + 1) * chunk), k % slots * chunk - k * chunk
            self._transferred(request, "all_reduce")
            for start in range(a, b, piece):  # UCX moves the others only while progressed
                stop = min(b, start + piece)
                pieces = [send[start:stop], theirs[at + start:at + stop]]
                reduce_into(recv[start:stop], pieces[::-1] if self.member else pieces, op,
                            threads=host_threads())
                self.transport._worker.progress()
        requests = [post(k) for k in range(min(slots, chunks))]
        for k in range(chunks):
            fold(k, requests[k])
            if k + slots < chunks:
                requests.append(post(k + slots))

    def abort(self, reason: str = "") -> None:
        super().abort(reason)
        self.transport.notify(reason or "abort() was called")

    @classmethod
    def check_world(cls, call: str, backends: Sequence[str], hostnames: Sequence[str]) -> None:
        if not available():
            raise InvalidArgumentError(f"{call}: inter_host='ucx' needs ucxx (pip install "
                                       f"'hoccl[ucx]')")

    @classmethod
    def transports(cls, setup: Setup) -> Tuple[Transport, Transport]:
        topology, rank = setup.topology, setup.bootstrap.rank
        rail = topology.groups("rail")[topology.local_of(rank)]
        # every rank makes the transports of its own rail and of the world, one channel
        # for all the rails (each process is in one) and one for the world
        made = ucx_transports(setup.call, setup.bootstrap,
                              [rail, tuple(range(topology.world_size))])
        rails, world = made
        assert rails is not None and world is not None
        names = "+".join(rails._worker.transports()) or "none found"
        rails.label = world.label = f"ucx [{names}]"
        return rails, world

    @classmethod
    def connect(cls, setup: Setup) -> Tuple[Any, Any]:
        engines = super().connect(setup)
        on = environ("HOCCL_UCX_DEVICE_MEMORY") in ("1", "on", "true", "yes")
        for engine in engines:
            assert isinstance(engine, UcxStagedEngine)
            engine.device_memory = on and engine.transport._worker.cuda
        return engines
