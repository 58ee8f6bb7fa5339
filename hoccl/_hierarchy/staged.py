"""Between hosts of any kinds: device data staged through pinned host memory on copy
engines, MPI (mpi4py) or gloo (torch.distributed) for the transfer, chunk by chunk.

A step of ``StagedEngine`` on device arrays runs as a pipeline over chunks of
``stage_bytes``::

    lane out (D2H, copy engine)  | c0 | c1 | c2 |
    transport (MPI / gloo)            | c0 | c1 | c2 |
    lane in  (H2D, copy engine)            | c0 | c1 | c2 |
    phase's stream   ...waits for the last H2D (an event), then goes on (a fold)

Chunk k+1 is copied out while chunk k is on the wire and chunk k−1 is copied in: two
pinned slots per direction (``SLOTS``), each reused only after the copy that read it (an
event on the lane) and the transfer that filled it are done; a transfer per slot is in
flight, so one chunk's handshake with the peers overlaps another's bytes.  The copies
are ``cuMemcpyAsync`` on two streams of hoccl's device (copy engines, no SM); the
transport's steps are its nonblocking forms, tested until done, so each ends within
``timeout`` or at ``abort()``.
Where every member of a level keeps its arrays in host memory the stage is a no-op: the
transport moves the caller's memory itself, in one step.  A member in host memory
beside staged members copies its chunks through plain memory, so that every member
cuts a step into the same chunks.

Reductions follow hoccl's rule (``FoldingEngine``): the library moves the inputs, hoccl
folds them in member order.

A phase of a hierarchical call runs on a stream of the engine's own (``begin``), not on
the caller's: lane out starts after it reaches the event of the phase before (or the
caller's work so far), its folds and scratch are ordered on it, and ``end`` hands the
phase after an event recorded on it (or orders the caller's stream after it).  The
caller's stream, where the other levels enqueue the next chunks' phases meanwhile, so
waits for exactly what it reads.
"""

from __future__ import annotations

import abc
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..backends._cross_memory import FOLD_BLOCK_BYTES, move, remote_reader
from ..config import host_threads
from .._dtypes import reduce_into
from .._errors import AbortedError, HocclError, HocclTimeoutError, InvalidArgumentError
from .._mailbox import wait_until
from ..bootstrap import Bootstrap, MPIBootstrap
from .arrays import Arrays, address
from .cma import READ_PART_BYTES, CmaTransport
from .engine import Pair, Setup
from .folding import FoldingEngine, _to_numpy
from ..backends._segments import shared_bytes
from .slots import HOST_COPIES, SLOTS, Stager
from .staged_batch import BatchStage, run_batch
from .transports import GlooTransport, Start, Transport

__all__ = ["StagedEngine", "BatchingStagedEngine", "MpiStagedEngine", "GlooStagedEngine",
           "Transport", "block_parts"]

#: the longest sleep between two polls of a copy or a transfer (after 2 ms of spinning):
#: a transport's nonblocking step moves only while it is tested (MPI's collectives
#: progress inside ``Test``), and a chunk of ``stage_bytes`` crosses shared memory in
#: about 0.4 ms, so the mailbox's 1 ms would leave the wire idle most of the time
POLL_SLEEP = 50e-6


class StagedEngine(FoldingEngine):
    """A ``Transport`` between hosts, device data staged through pinned host memory (the
    module docstring).  ``MpiStagedEngine`` and ``GlooStagedEngine`` say how the
    transport is connected, ``BatchingStagedEngine`` how it takes batches of pairs."""

    name = "staged"
    host_scratch = staticmethod(shared_bytes)  # peers map an in-place fold's offered copy

    def __init__(self, transport: Transport, device: Any, timeout: float, stage_bytes: int,
                 direct: bool = False):
        self.transport, self.device = transport, device
        #: every member's arrays in host memory: the transport moves them themselves, in
        #: one step (no member stages, so none needs the chunks)
        self.direct = direct
        self.size, self.member = transport.size, transport.member
        self.timeout, self.stage_bytes = timeout, stage_bytes
        self.label = f"{transport.label} (staged)"
        self._stagers: Dict[int, Stager] = {}  # by the id of the device that copies
        #: a phase's own stream and its two events, started and finished (``begin``)
        self._phase: Optional[Tuple[Any, Any, Any]] = None
        self._broken = ""
        self._aborted = ""

    @classmethod
    def connect(cls, setup: Setup) -> Tuple["StagedEngine", "StagedEngine"]:
        rails, world = cls.transports(setup)
        device = setup.host.device_handle if setup.backend == "cuda" else None
        timeout, stage, topology = setup.host.timeout, setup.config.stage_bytes, setup.topology
        rail = topology.groups("rail")[topology.local_of(setup.bootstrap.rank)]
        return (cls(rails, device, timeout, stage, _in_host_memory(setup, rail)),
                cls(world, device, timeout, stage,
                    _in_host_memory(setup, range(topology.world_size))))

    @classmethod
    @abc.abstractmethod
    def transports(cls, setup: Setup) -> Tuple[Transport, Transport]:
        """(this rank's rail transport, the world's)."""

    def pinned(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of page-locked host memory (copy engines move it with no bounce): a
        segment that peers on this machine may map (``shared_bytes``), page-locked by
        hoccl's device (no torch or cupy needed)."""
        memory = shared_bytes(nbytes)
        if nbytes:
            self.device.pin_host(memory.ctypes.data, nbytes)
        return memory

    def unpinned(self, memory: np.ndarray) -> None:
        """Undo ``pinned``'s page-locking (after the copies that use the memory)."""
        if memory.nbytes:
            self.device.unpin_host(memory.ctypes.data)

    # -- waiting ----------------------------------------------------------------------
    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Poll ``ready`` until it holds, the timeout passes or the engine is aborted; a
        step that ends otherwise is still in the library's hands: no more calls."""
        def aborted() -> None:
            if self._aborted:
                self._broken = f"{what} was left unfinished by an abort"
                raise AbortedError(f"{what} across hosts ({self.label}): aborted: "
                                   f"{self._aborted}")
        try:
            wait_until(ready, time.monotonic() + self.timeout,
                       lambda: f"{what} across hosts ({self.label}, member {self.member} of "
                               f"{self.size} in its group): not finished within "
                               f"{self.timeout:g} s: a rank did not make the matching call, or "
                               f"is gone; the step cannot be taken back, so this communicator "
                               f"takes no more calls", check=aborted,
                       longest_sleep=POLL_SLEEP)
        except HocclTimeoutError:
            self._broken = f"{what} did not finish within {self.timeout:g} s"
            raise
        except HocclError as error:  # the transport failed mid-step (a peer gone)
            self._broken = self._broken or f"{what} failed: {error}"
            raise

    def _transfer(self, what: str, start: Callable[[], Any]) -> None:
        self._transferred(start(), what)

    def _transferred(self, request: Any, what: str) -> None:
        self._wait(lambda: self.transport.test(request), what)

    def _copied(self, device: Any, event: Any, what: str) -> None:
        self._wait(lambda: bool(device.done(event)), what)

    # -- a phase on a stream of its own ------------------------------------------------
    def begin(self, device: Any, stream: int, ready: Any) -> int:
        """A stream of the engine's own for a phase's steps (their lanes' starts and ends,
        folds and scratch), after the event ``ready``, else after the caller's work so
        far.  The caller's stream, where the other levels enqueue the next chunks'
        phases, then waits for this phase only where ``end`` makes it."""
        if self.device is None:
            return super().begin(device, stream, ready)
        work, started, _ = self._phase_stream()
        if ready is None:
            device.record(device.resolve_stream(stream, []), started)
            ready = started
        device.wait_event(work, ready)
        return int(work)

    def end(self, device: Any, stream: int, work: int, done: Any) -> None:
        if self.device is None:
            super().end(device, stream, work, done)
            return
        own, _, finished = self._phase_stream()
        if done is not None:
            device.record(own, done)
            return
        device.record(own, finished)
        device.wait_event(device.resolve_stream(stream, []), finished)

    def _phase_stream(self) -> Tuple[Any, Any, Any]:
        if self._phase is None:
            device = self.device
            self._phase = (device.create_stream(), device.create_event(), device.create_event())
        return self._phase

    # -- one step ---------------------------------------------------------------------
    def _step(self, what: str, stream: Optional[int], count: int,
              send: Any, send_blocks: int, recv: Any, recv_blocks: int,
              start: Start) -> None:
        """A step whose send holds ``send_blocks`` blocks of ``count`` elements and whose
        recv ``recv_blocks`` (either may be None); ``start(host_send, host_recv)`` starts
        the transport's step on byte arrays laid out block-major."""
        self._refuse_if_broken(what)
        if self.direct:
            host_send = None if send is None else _to_numpy(send).view(np.uint8)
            host_recv = None if recv is None else _to_numpy(recv).view(np.uint8)
            if host_send is not None and host_recv is not None and _overlap(host_send, host_recv):
                host_send = host_send.copy()  # in place: the transport reads a copy
            self._transfer(what, lambda: start(host_send, host_recv))
            return
        arrays = [array for array in (send, recv) if array is not None]
        on_host = self._on_host(arrays)
        device = HOST_COPIES if on_host else self.device
        if device is None:
            raise InvalidArgumentError(f"{what} across hosts ({self.label}): device arrays on a "
                                       f"rank without hoccl's cuda backend")
        self._staged(what, device, None if on_host else stream, count, send, send_blocks,
                     recv, recv_blocks, start)

    def _refuse_if_broken(self, what: str) -> None:
        if self._broken:
            raise AbortedError(f"{what} across hosts ({self.label}): the engine takes no more "
                               f"calls: {self._broken}")

    @staticmethod
    def _on_host(arrays: List[Any]) -> bool:
        """Whether the arrays are in host memory (numpy, torch CPU tensors): no stage."""
        kit = Arrays.of(arrays[0]) if arrays else Arrays("numpy")
        return kit.kind == "numpy" or (kit.kind == "torch" and arrays[0].device.type == "cpu")

    def _staged(self, what: str, device: Any, stream: Optional[int], count: int, send: Any,
                send_blocks: int, recv: Any, recv_blocks: int, start: Start) -> None:
        """The pipeline of the module docstring.  Every member cuts the step into the same
        chunks (from the step's shape and ``stage_bytes``, which every rank shares),
        whether its arrays are on a device or on the host."""
        item = _itemsize(send if send is not None else recv)
        blocks = max(send_blocks, recv_blocks)
        per_chunk = self.per_chunk(blocks, item)
        if device is HOST_COPIES and self._unstaged(what, count, per_chunk, send, send_blocks,
                                                    recv, recv_blocks, start):
            return
        stager = self._stagers.get(id(device))
        if stager is not None and stager.slot_bytes < per_chunk * blocks * item:
            stager.close(self.timeout)  # a slot must hold one element of every block
            stager = None
        if stager is None:
            on_host = device is HOST_COPIES
            stager = Stager(device, max(self.stage_bytes, blocks * item),
                            shared_bytes if on_host else self.pinned,
                            None if on_host else self.unpinned)
            self._stagers[id(device)] = stager
        device.activate()
        caller = device.resolve_stream(stream, [])
        # lane out starts after the work on the step's stream so far (the phase before, a
        # fold: what it reads); lane in after that too, as the host copies a chunk in
        # only once its copy out was seen done
        device.record(caller, stager.started)
        device.wait_event(stager.lanes[0], stager.started)
        chunks = [(a, min(count, a + per_chunk)) for a in range(0, count, per_chunk)]
        send_at = address(send)[0] if send is not None else 0
        recv_at = address(recv)[0] if recv is not None else 0
        # all_gather's and all_to_all's own block never leaves the device: one copy on the
        # step's stream (none in place), no slot bytes, and the transport told to leave
        # the slots' own block alone
        own = self.member if what in _OWN_BLOCK else None
        if own is not None:
            own_send = send_at + (own * count * item if send_blocks > 1 else 0)
            own_recv = recv_at + own * count * item
            if own_send != own_recv and count:
                device.copy(caller, own_recv, own_send, count * item)
            plain: Callable[..., Any] = start
            start = lambda s, r: plain(s, r, own=False)  # noqa: E731
        in_flight: List[Tuple[int, Any]] = []  # (chunk index, request), oldest first

        def copy_in(k: int) -> None:
            a, b = chunks[k]
            slot = k % SLOTS
            host = stager.pinned[slot][1]
            width = (b - a) * item
            for block in range(recv_blocks):
                if block != own:
                    device.copy(stager.lanes[1], recv_at + (block * count + a) * item,
                                host.ctypes.data + block * width, width)
            device.record(stager.lanes[1], stager.in_done[slot])
            stager.in_used[slot] = True

        def finish() -> None:
            """The oldest transfer done, and its chunk copied in."""
            k, request = in_flight.pop(0)
            self._transferred(request, what)
            if recv is not None:
                copy_in(k)

        for k, (a, b) in enumerate(chunks):
            slot = k % SLOTS
            if len(in_flight) == SLOTS:  # the oldest transfer used this slot's bytes
                finish()
            out_host, in_host = stager.pinned[slot]
            width = (b - a) * item
            if send is not None:
                for block in range(send_blocks):
                    if block != own or send_blocks == 1:
                        device.copy(stager.lanes[0], out_host.ctypes.data + block * width,
                                    send_at + (block * count + a) * item, width)
            device.record(stager.lanes[0], stager.out_done[slot])
            if stager.in_used[slot]:  # the slot's last H2D has read its pinned bytes
                self._copied(device, stager.in_done[slot], f"{what} (copy in)")
                stager.in_used[slot] = False
            self._copied(device, stager.out_done[slot], f"{what} (copy out)")
            request = start(out_host[:send_blocks * width] if send is not None else None,
                            in_host[:recv_blocks * width] if recv is not None else None)
            in_flight.append((k, request))
        while in_flight:
            finish()
        if recv is not None and chunks:
            device.wait_event(caller, stager.in_done[(len(chunks) - 1) % SLOTS])

    def _unstaged(self, what: str, count: int, per_chunk: int, send: Any, send_blocks: int,
                  recv: Any, recv_blocks: int, start: Start) -> bool:
        """A member in host memory beside staged peers: its chunks straight from and into
        its own arrays, where the transport takes a side's blocks as a list (or the side
        has one block) and the sides do not overlap; else False (copied through slots).
        A copy through slots is one more pass over the member's bytes."""
        if any(blocks > 1 and what not in self.transport.blocks
               for array, blocks in ((send, send_blocks), (recv, recv_blocks))
               if array is not None):
            return False
        host_send = None if send is None else _to_numpy(send).view(np.uint8)
        host_recv = None if recv is None else _to_numpy(recv).view(np.uint8)
        item = _itemsize(send if send is not None else recv)
        if host_send is not None and host_recv is not None and _overlap(host_send, host_recv) \
                and not (what == "all_gather" and host_send.ctypes.data == host_recv.ctypes.data
                         + self.member * count * item and host_send.nbytes == count * item):
            return False  # (an in-place all_gather: peers read the block the member keeps)

        parts = block_parts(count, item, host_send, send_blocks, host_recv, recv_blocks)
        self._in_chunks(what, count, per_chunk, lambda a, b: start(*parts(a, b)))
        return True

    def per_chunk(self, blocks: int, item: int) -> int:
        """Elements per chunk of a step of ``blocks`` blocks of ``item``-byte elements: a
        slot holds a chunk of every block.  Every member cuts a step alike from it."""
        return max(1, self.stage_bytes // (blocks * item))

    def _in_chunks(self, what: str, count: int, per_chunk: int,
                   start: Callable[[int, int], Any]) -> None:
        """``start(a, b)`` the transfer of elements [a, b) of every chunk, as many in flight
        as a staged member keeps, each waited for in turn."""
        in_flight: List[Any] = []  # oldest first
        for a in range(0, count, per_chunk):
            if len(in_flight) == SLOTS:
                self._transferred(in_flight.pop(0), what)
            in_flight.append(start(a, min(count, a + per_chunk)))
        for request in in_flight:
            self._transferred(request, what)

    # -- reductions -------------------------------------------------------------------
    def all_reduce(self, send: Any, recv: Any, op: str, *, stream: Any = None) -> None:
        """Between two members, an all_gather and a fold: the bytes of a reduce_scatter and
        an all_gather in one step, with no fold between two.  A member in host memory whose
        transport reads its peer's memory folds the peer's bytes as it reads them
        (``CmaTransport.all_reduce``).  From three members on, the two steps move fewer."""
        if self.size != 2:
            return super().all_reduce(send, recv, op, stream=stream)
        count = recv.shape[0]
        if not count or self._folded_as_read(count, send, recv, op):
            return
        everyone = self.scratch(send, 2 * count, stream)
        self.all_gather(send, everyone, stream=stream)
        self.folding([everyone[:count], everyone[count:]], recv, op, stream)

    def _folded_as_read(self, count: int, send: Any, recv: Any, op: str) -> bool:
        """``all_reduce``'s fold as it reads, where this member's arrays are in host
        memory and the transport reads its peers' (else False: nothing done).  Cut into
        the chunks of the peer's all_gather (``_staged``: a slot holds a chunk of each
        member's block), or one step where no member stages."""
        transport = self.transport
        if not (isinstance(transport, CmaTransport) and self._on_host([send, recv])):
            return False
        self._refuse_if_broken("all_reduce")
        host_send, host_recv = _to_numpy(send), _to_numpy(recv)
        # in place, the fold would write over what the peer reads: it reads a copy, made on
        # every helper thread (waiting for its read before each fold made the rail 1.5x slower)
        offered = (_to_numpy(self.scratch(send, count, None))
                   if _overlap(host_send, host_recv) else host_send)

        def start(a: int, b: int) -> Any:
            if offered is not host_send:
                move(offered[a:b].ctypes.data, host_send[a:b].ctypes.data, offered[a:b].nbytes,
                     piece_bytes=READ_PART_BYTES)
            return transport.all_reduce(offered[a:b].view(np.uint8),
                                        _fold_into(host_recv[a:b], op))
        item = host_recv.dtype.itemsize
        per_chunk = count if self.direct else self.per_chunk(2, item)
        self._in_chunks("all_reduce", count, per_chunk, start)
        return True

    # -- the copies -------------------------------------------------------------------
    def all_gather(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self._step("all_gather", stream, send.shape[0], send, 1, recv, self.size,
                   self.transport.all_gather)

    def all_to_all(self, send: Any, recv: Any, *, stream: Any = None) -> None:
        self._step("all_to_all", stream, send.shape[0] // self.size, send, self.size, recv,
                   self.size, self.transport.all_to_all)

    def exchanged(self, send: Any, received: Any, count: int, stream: Optional[int]) -> list:
        """In host memory, the member's own block is folded from ``send`` where it lies: the
        transport leaves it out of ``received`` (a copy of ``count`` elements saved)."""
        if not (self.direct or self._on_host([send, received])):
            return super().exchanged(send, received, count, stream)
        def start(host_send: Any, host_recv: Any, own: bool = False) -> Any:
            return self.transport.all_to_all(host_send, host_recv, own=False)
        self._step("all_to_all", stream, count, send, self.size, received, self.size, start)
        parts = [received[i * count:(i + 1) * count] for i in range(self.size)]
        parts[self.member] = send[self.member * count:(self.member + 1) * count]
        return parts

    def broadcast(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        if self.member != root:
            self._step("broadcast", stream, recv.shape[0], None, 0, recv, 1,
                       lambda s, r: self.transport.broadcast(r, root))
            return
        if address(send)[0] != address(recv)[0]:
            self._local_copy(recv, send, stream)
        self._step("broadcast", stream, send.shape[0], send, 1, None, 0,
                   lambda s, r: self.transport.broadcast(s, root))

    def _local_copy(self, dst: Any, src: Any, stream: Optional[int]) -> None:
        """``dst[...] = src``: on the host, or on the caller's stream by a copy engine."""
        if stream is None or self.device is None:
            _to_numpy(dst)[...] = _to_numpy(src)
            return
        (dst_at, nbytes), (src_at, _) = address(dst), address(src)
        self.device.copy(self.device.resolve_stream(stream, []), dst_at, src_at, nbytes)

    def gather(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        at_root = self.member == root
        self._step("gather", stream, send.shape[0], send, 1, recv if at_root else None,
                   self.size, lambda s, r: self.transport.gather(s, r, root))

    def scatter(self, send: Any, recv: Any, root: int, *, stream: Any = None) -> None:
        at_root = self.member == root
        self._step("scatter", stream, recv.shape[0], send if at_root else None, self.size,
                   recv, 1, lambda s, r: self.transport.scatter(s, r, root))

    def send(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        self._step("send", stream, buf.shape[0], buf, 1, None, 0,
                   lambda s, r: self.transport.send(s, peer))

    def recv(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        self._step("recv", stream, buf.shape[0], None, 0, buf, 1,
                   lambda s, r: self.transport.recv(r, peer))

    def barrier(self, *, stream: Any = None) -> None:
        if stream is not None and self.device is not None:
            self.device.synchronize_stream(self.device.resolve_stream(stream, []), self.timeout)
        self._transfer("barrier", self.transport.barrier)

    # -- state ------------------------------------------------------------------------
    def abort(self, reason: str = "") -> None:
        """A step in progress returns (its request cannot be taken back: the engine takes
        no more calls); later calls are refused."""
        self._aborted = reason or "abort() was called"

    def close(self) -> None:
        for stager in self._stagers.values():
            stager.close(self.timeout)
        self._stagers.clear()
        if self._phase is not None:
            stream, *events = self._phase
            self.device.synchronize_stream(stream, self.timeout)
            for event in events:
                self.device.destroy_event(event)
            self.device.destroy_stream(stream)
            self._phase = None
        self.transport.close()


#: the steps whose own block a staged member copies on its device (``_staged``)
_OWN_BLOCK = ("all_gather", "all_to_all")


def _in_host_memory(setup: Setup, group: Sequence[int]) -> bool:
    """Whether every member of ``group`` reported its arrays in host memory."""
    return bool(setup.devices) and all(setup.devices[m] == "cpu" for m in group)


def block_parts(count: int, item: int, send: Any, send_blocks: int, recv: Any,
                recv_blocks: int) -> Callable[[int, int], Tuple[Any, Any]]:
    """``(a, b) -> (send's piece, recv's piece)`` of elements [a, b) of every block of the
    byte arrays ``send`` and ``recv`` (block-major, blocks of ``count`` elements of
    ``item`` bytes): a side of one block as an array, of more as a list, None where
    absent."""
    def part(array: Any, blocks: int, a: int, b: int) -> Any:
        if array is None:
            return None
        views = [array[(block * count + a) * item:(block * count + b) * item]
                 for block in range(blocks)]
        return views[0] if blocks == 1 else views
    return lambda a, b: (part(send, send_blocks, a, b), part(recv, recv_blocks, a, b))


def _fold_into(out: np.ndarray, op: str) -> Callable[[List[Any]], None]:
    """A fold of the members' pieces into ``out`` that reads a peer's piece (a
    ``RemotePtr``) where it lies, a block at a time."""
    def fold(pieces: List[Any]) -> None:
        reduce_into(out, [piece.view(out.dtype) if isinstance(piece, np.ndarray) else
                          remote_reader(piece, out.dtype) for piece in pieces], op,
                    threads=host_threads(), block_bytes=FOLD_BLOCK_BYTES)
    return fold


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    a_at, b_at = a.ctypes.data, b.ctypes.data
    return a_at < b_at + b.nbytes and b_at < a_at + a.nbytes


def _itemsize(array: Any) -> int:
    return array.element_size() if hasattr(array, "element_size") else array.dtype.itemsize


class BatchingStagedEngine(StagedEngine):
    """A ``StagedEngine`` that takes batches of sends and receives (``staged_batch``: every
    pair posted before any is waited for), with the pinned memory they keep."""

    _batch_stage: Optional[BatchStage] = None

    def batch(self, pairs: Sequence[Pair], *, stream: Any = None) -> None:
        if self._batch_stage is None:
            self._batch_stage = BatchStage(self.pinned, self.unpinned)
        run_batch(self, self._batch_stage, pairs, stream)

    def close(self) -> None:
        if self._batch_stage is not None:
            self._batch_stage.close(self.device)
        super().close()


class MpiStagedEngine(BatchingStagedEngine):
    """The staged engine over MPI: the rails split from the MPI communicator, the world a
    duplicate of it."""

    name = "mpi"

    @classmethod
    def transports(cls, setup: Setup) -> Tuple[Transport, Transport]:
        mpi = _mpi_communicator(setup.call, setup.bootstrap, setup.mpi_comm)
        rank = setup.bootstrap.rank
        host, local = setup.topology.host_of(rank), setup.topology.local_of(rank)
        return (CmaTransport.connect(mpi.Split(color=local, key=host)),
                CmaTransport.connect(mpi.Dup()))


class GlooStagedEngine(BatchingStagedEngine):
    """The staged engine over torch.distributed groups (gloo): the application's default
    group must span the same world."""

    name = "gloo"

    @classmethod
    def transports(cls, setup: Setup) -> Tuple[Transport, Transport]:
        from .torch_group import torch_groups
        topology, rank = setup.topology, setup.bootstrap.rank
        groups = topology.groups("rail") + [tuple(range(topology.world_size))]
        made = torch_groups(setup.call, rank, topology.world_size, groups)
        local = topology.local_of(rank)
        timeout = setup.host.timeout
        return (GlooTransport(made[local], groups[local], timeout),
                GlooTransport(made[-1], groups[-1], timeout))


#: the tag of ``Create_group`` for a part of the MPI world
_SUB_WORLD = 4242


def _mpi_communicator(call: str, bootstrap: Bootstrap, mpi_comm: Any) -> Any:
    """The MPI communicator the engine splits: the bootstrap's own, or ``mpi_comm`` / the
    world when the bootstrap is not MPI's (its ranks must then be the same), or, for a
    bootstrap of some of the MPI world's processes (a torch sub-group), a communicator of
    those processes made from the world."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise InvalidArgumentError(f"{call}: inter_host='mpi' needs mpi4py (pip install "
                                   f"'hoccl[mpi]')") from None
    if isinstance(bootstrap, MPIBootstrap):
        return bootstrap.mpi
    world = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
    if mpi_comm is None and world.Get_size() > bootstrap.world_size:
        # a part of the MPI world (a torch sub-group): its ranks, in the bootstrap's order
        ranks = bootstrap.allgather(world.Get_rank())
        if len(set(ranks)) == len(ranks):
            return world.Create_group(world.group.Incl(ranks), tag=_SUB_WORLD)
    if world.Get_size() != bootstrap.world_size or world.Get_rank() != bootstrap.rank:
        raise InvalidArgumentError(f"{call}: inter_host='mpi' needs an MPI communicator with the "
                                   f"bootstrap's ranks; MPI has rank {world.Get_rank()} of "
                                   f"{world.Get_size()}, the bootstrap {bootstrap.rank} of "
                                   f"{bootstrap.world_size}")
    return world
