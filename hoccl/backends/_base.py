"""The small interface every device backend implements.

A ``Device`` is one rank's view of one GPU (or, on the host backend, of host
memory).  The stream manager and the P2P executor drive it; they never touch the
CUDA driver themselves.  Every method that takes a ``stream`` *enqueues* and
returns: nothing here blocks the host except ``synchronize_stream`` and the
``HostWord.value`` read.

Addresses are plain ints in the device's unified address space (the host backend
may hand out ``RemotePtr`` for another process's memory; it supports ``+ int``).
Values written and waited for are unsigned 64-bit; waits are ``>=``.

Timeline of one collective on one rank (``seq`` = the collective's signal base)::

    caller stream  ─record(E_k)─wait(done >= k)─────────────────────────► later kernels
    lane 0           wait_event(E_k)─signals─waits─copies─…─join─write(done=k)
    lane 1           wait_event(E_k)─copies──────────────────┘
"""

from __future__ import annotations

import abc
import contextlib
import enum
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .._dtypes import FLOATING, ITEMSIZE, NAMES
from ..sched.plan import OPS as _PLAN_OPS

__all__ = ["Device", "HostWord", "MemOp", "SmCaps", "DTYPES", "OPS", "check_reduce_extras",
           "DirectProgram", "DIRECT_SIGNAL", "DIRECT_WAIT", "DIRECT_COPY", "DIRECT_REDUCE",
           "DIRECT_VALUE_BITS"]

#: dtype names every backend accepts in ``reduce``.
DTYPES = NAMES
#: reduction operators; "avg" is the sum divided by the number of inputs.
OPS = _PLAN_OPS


def check_reduce_extras(op: str, dtype: str, divisor: Optional[int],
                        scale: Optional[float]) -> None:
    """Raise unless ``Device.reduce``'s ``divisor`` (avg only, in [1, 2**32)) and ``scale``
    (sum of a floating dtype only, a finite float) fit ``op`` and ``dtype``."""
    from .._errors import InvalidArgumentError
    if divisor is not None and (op != "avg" or not isinstance(divisor, int)
                                or isinstance(divisor, bool) or not 0 < divisor < 2 ** 32):
        raise InvalidArgumentError(f"reduce: expected a divisor in [1, 2**32) for avg only, "
                                   f"got {divisor!r} for {op!r}")
    if scale is not None and (op != "sum" or dtype not in FLOATING
                              or not isinstance(scale, float) or scale != scale
                              or scale in (float("inf"), float("-inf"))):
        raise InvalidArgumentError(f"reduce: expected a finite float scale for a sum of a "
                                   f"floating dtype, got {scale!r} for {op!r} of {dtype}")


@dataclass
class SmCaps:
    """How many SMs (thread blocks) one communicator's kernels on its device may take:
    ``max_sms`` for reductions, ``copy_sms`` for the same-GPU copy of out-of-place own
    blocks.  Per communicator, not per device: communicators split from one another
    share a device but not their caps (``set_options`` changes one communicator's)."""
    max_sms: int
    copy_sms: int
    #: a pushed reduction's chunk sums as one launch whose blocks wait for each chunk on
    #: the device (``Device.reduce_chunks``), instead of a stream wait and a launch per chunk
    fuse_sums: bool = True


#: the steps of a ``DirectProgram`` (the values the CUDA kernel's ``DirectKind`` uses)
DIRECT_SIGNAL, DIRECT_WAIT, DIRECT_COPY, DIRECT_REDUCE = range(4)
#: a direct kernel signals ``(epoch << DIRECT_VALUE_BITS) + value``: its values grow from
#: kernel to kernel with an epoch the device keeps, so a graph replay needs no reset
DIRECT_VALUE_BITS = 16


@dataclass(eq=False)
class DirectProgram:
    """One rank's program of a direct-kernel plan (``Plan.kernel_blocks``), every address
    resolved, for ``Device.direct``: the whole collective in one launch of ``blocks``
    blocks.

    ``counter``: two 64-bit words of this rank's pad, the epoch (direct kernels run so
    far) and the blocks of the running kernel that finished.  ``ops``: tuples
    ``(DIRECT_SIGNAL, slot, value)`` (``slot``: block 0's slot of the channel in the
    peer's pad; block ``b`` writes ``slot + 8 * b``), ``(DIRECT_WAIT, slot, value)`` (own
    pad: every block's slot must reach the value), ``(DIRECT_COPY, dst, src, nbytes,
    dst_shift, src_shift)`` and ``(DIRECT_REDUCE, output, ((input, shift), ...), count,
    output_shift)`` (``dtype``, ``op``, ``scale``; avg divides by the number of inputs).
    An address with a nonzero shift lies in a double-buffered ring (``plan.RING``): in a
    kernel of odd epoch it means ``address + shift`` (the ring's second half).
    ``completion`` and ``host_word``: the rank's completion words, which a launch with a
    value writes when the kernel ends (``Device.direct``).  ``signature``: a digest of
    the call (what every rank must agree on; 0: unchecked), written beside each signal
    into its twin ``signature_shift`` bytes on (``signature_half`` more in odd epochs)
    and compared by each wait; a difference writes the call's value (``1 << 61`` for a
    launch without one) into the ``error`` word and stops the data steps.
    ``packed`` is the backend's encoding, made once."""
    blocks: int
    counter: Any
    ops: Tuple[tuple, ...]
    dtype: str = "uint8"
    op: str = "sum"
    scale: Optional[float] = None
    completion: Any = None
    host_word: Any = None
    error: Any = None
    signature: int = 0
    signature_shift: int = 0
    signature_half: int = 0
    packed: Any = None


class MemOp(str, enum.Enum):
    """The kind of a stream memory operation in ``Device.memops`` (a str: hashed at C
    speed, as the keys of kept batches are)."""
    WRITE = "write"  # write a 64-bit value after the stream's earlier work
    WAIT = "wait"    # block the stream until a 64-bit word is >= a value


class HostWord(abc.ABC):
    """A 64-bit counter the device can write with ``write_value`` and the host can read."""

    address: int

    @property
    @abc.abstractmethod
    def value(self) -> int:
        """The counter's current value, read by the host without synchronising any stream."""


class Device(abc.ABC):
    """One rank's device: streams, events, memory, and the zero-SM primitives."""

    backend: str = ""
    #: device ordinal (CUDA) or None (host)
    ordinal: Any = None
    #: what names the physical device on its host whatever a process's view of the
    #: devices (a GPU's PCI bus id), or None where there is nothing to share (host)
    physical: Optional[str] = None
    #: the device's model, as its driver names it ("host" on the host backend): what a
    #: tuning table is keyed by with the world size and link (``hoccl.tuning``)
    model: str = "host"
    #: how it reaches the host's other GPUs ("nvlink", "pcie", "none"), how many it
    #: reaches, and the driver's version: the rest of a tuning table's key
    link: str = "host"
    peers: int = 0
    driver: str = "none"

    # -- streams and events ------------------------------------------------------------
    @abc.abstractmethod
    def create_stream(self) -> Any:
        """A new non-blocking copy stream (a lane), highest priority where supported."""

    @abc.abstractmethod
    def destroy_stream(self, stream: Any) -> None: ...

    def capturing(self, stream: Any) -> bool:
        """Whether ``stream`` is being captured into a CUDA graph (never, without CUDA)."""
        return False

    def relaxed_capture(self) -> Any:
        """A context in which this thread may make driver calls that a capture in
        progress would otherwise refuse (allocations, stream creation, IPC mapping):
        ``cuThreadExchangeStreamCaptureMode(RELAXED)``, restored on exit."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def resolve_stream(self, stream: Any, arrays: Sequence[Any]) -> Any:
        """The caller's stream as a handle this device can enqueue on.

        ``stream=None`` means the current stream of the arrays' framework (cupy,
        torch), or the device's default stream.  Borrowed streams are never destroyed.
        """

    @abc.abstractmethod
    def create_event(self) -> Any: ...

    @abc.abstractmethod
    def destroy_event(self, event: Any) -> None: ...

    @abc.abstractmethod
    def record(self, stream: Any, event: Any) -> None:
        """Record ``event`` at the current end of ``stream``."""

    @abc.abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for the latest record of ``event``."""

    @abc.abstractmethod
    def done(self, event: Any) -> bool:
        """True once the work before ``event``'s latest record has finished (never blocks)."""

    @abc.abstractmethod
    def synchronize_stream(self, stream: Any, timeout: float) -> None:
        """Block the host until ``stream`` is idle; raise HocclTimeoutError after ``timeout`` s."""

    # -- memory ------------------------------------------------------------------------
    @abc.abstractmethod
    def alloc(self, nbytes: int) -> int:
        """Device memory for scratch and pads (not zeroed)."""

    @abc.abstractmethod
    def free(self, address: int) -> None: ...

    @abc.abstractmethod
    def alloc_pad(self, slots: int) -> int:
        """A zeroed array of ``slots`` 64-bit signal slots in device memory; peers map it."""

    def free_pad(self, address: int) -> None:
        """This rank, and every peer in this process, is done with the pad at ``address``
        (from ``alloc_pad``).  Peers in other processes may still write into it until they
        close: they hold their mapping (``import_pad``), and the memory stays theirs to
        write until they drop it.  The default frees it (a peer's mapping of device
        memory keeps the memory alive)."""
        self.free(address)

    def import_pad(self, descriptor: Any) -> Any:
        """Map a peer process's signal pad (``export`` of the pad with its size) for this
        rank's writes, held until ``drop_pad``: a write into it never lands in memory its
        owner has released, however late it comes."""
        return self.import_(descriptor)

    def drop_pad(self, descriptor: Any) -> None:
        """This rank will write into the peer's pad no more (``import_pad``)."""

    @abc.abstractmethod
    def alloc_host_word(self) -> HostWord:
        """A zeroed 64-bit counter in host memory that this device can write."""

    def free_host_word(self, word: HostWord) -> None:
        """Nothing will write ``word`` any more (its communicator has closed); the
        device's close frees those not freed before."""

    @abc.abstractmethod
    def export(self, address: int, nbytes: int = 0) -> Any:
        """A picklable descriptor another process passes to ``import_`` to map ``address``
        (``nbytes``: how many bytes from it the peers will reach; 0: unknown)."""

    @abc.abstractmethod
    def import_(self, descriptor: Any) -> Any:
        """Map a peer process's exported buffer; returns the local address of ``address``.

        Mappings are cached by allocation identity, so importing the same buffer
        again costs no driver call.  Released by ``close``.
        """

    def hold_import(self, descriptor: Any) -> Any:
        """``import_`` for a registered window: the mapping is counted, and released by
        ``drop_import`` when no window holds it and no call has used it."""
        return self.import_(descriptor)

    def drop_import(self, descriptor: Any) -> None:
        """A window's hold on a mapping ends (``hold_import``)."""

    @abc.abstractmethod
    def enable_peer_access(self, peer: "Device") -> None:
        """Let this device read and write ``peer``'s memory directly (one process)."""

    # -- the zero-SM primitives ---------------------------------------------------------
    @abc.abstractmethod
    def copy(self, stream: Any, dst: Any, src: Any, nbytes: int) -> None:
        """One DMA on ``stream``: between devices it runs on a copy engine."""

    def copy_batch(self, stream: Any, copies: Sequence[Tuple[Any, Any, int]]) -> None:
        """Several copies with no order among them, after ``stream``'s earlier work."""
        for dst, src, nbytes in copies:
            self.copy(stream, dst, src, nbytes)

    @abc.abstractmethod
    def local_copy(self, stream: Any, dst: Any, src: Any, nbytes: int,
                   sms: Optional[int] = None) -> None:
        """A copy within this device, on at most ``sms`` SMs (on GPUs this needs SMs);
        ``None``: the device's ``copy_sms``."""

    @abc.abstractmethod
    def write_value(self, stream: Any, address: Any, value: int) -> None:
        """Write the 64-bit ``value`` to ``address`` after ``stream``'s earlier work."""

    @abc.abstractmethod
    def wait_value(self, stream: Any, address: Any, value: int) -> None:
        """Block ``stream`` until the 64-bit word at ``address`` (own memory) is ``>= value``."""

    def memops(self, stream: Any, operations: Sequence[Tuple[MemOp, Any, int]]) -> None:
        """``(kind, address, value)`` writes and waits, in order, in one call where the
        backend can batch them (``cuStreamBatchMemOp``)."""
        for kind, address, value in operations:
            if kind is MemOp.WRITE:
                self.write_value(stream, address, value)
            else:
                self.wait_value(stream, address, value)

    def fresh(self) -> Optional["Device"]:
        """A device on the same hardware for a communicator made from an aborted one's
        survivors (``Communicator.shrink``), or None: borrow this one.  A CUDA device is
        borrowed (a process imports a peer's buffer once per context, and an abort
        leaves the context usable); the host backend opens a new one, since an abort
        drops its streams' queued work for good."""
        return None

    def activate(self) -> None:
        """Make this device current for the calls that follow on this thread (CUDA: its
        context); called once at the start of every public call, not per operation."""

    @abc.abstractmethod
    def reduce(self, stream: Any, output: Any, inputs: Sequence[Any], count: int,
               dtype: str, op: str, divisor: Optional[int] = None,
               sms: Optional[int] = None, scale: Optional[float] = None) -> None:
        """``output = op(*inputs)`` element-wise over ``count`` elements, on at most ``sms``
        SMs (``None``: the device's ``max_sms``).  ``avg`` divides by ``divisor``, by default
        the number of inputs (one input and a divisor: a division in place, as an average
        across hosts finishes).  A ``sum`` with ``scale`` is multiplied by it before the
        result is rounded to ``dtype`` (floating dtypes)."""

    def reduce_chunks(self, stream: Any, flags: Sequence[Any], value: int, output: Any,
                      inputs: Sequence[Any], count: int, last_count: int, chunks: int,
                      stride: int, dtype: str, op: str, sms: Optional[int] = None,
                      scale: Optional[float] = None) -> None:
        """A pushed reduction's ``chunks`` chunks in one launch: chunk ``k`` is
        ``reduce`` of the elements ``[k * stride, k * stride + count)`` (``last_count`` for
        the last) of ``output`` and every input, once every 64-bit word at ``flags`` (own
        memory, where the peers' copies signal) is ``>= value + k``.  A word at or above
        an abort's value (2**62) ends it: nothing more is written.  ``stride * itemsize``
        must be a multiple of 16, the inputs at most ``MAX_INPUTS`` and the flags at most
        ``CHUNK_FLAGS`` (the executor fuses only such runs).  This default is what the
        launch replaces: the waits and a reduction per chunk."""
        itemsize = ITEMSIZE[dtype]
        for k in range(chunks):
            for flag in flags:
                self.wait_value(stream, flag, value + k)
            shift = k * stride * itemsize
            self.reduce(stream, output + shift, [address + shift for address in inputs],
                        last_count if k == chunks - 1 else count, dtype, op, sms=sms,
                        scale=scale)

    def prepare_direct(self, dtype: str, op: str) -> None:
        """Load what ``direct`` will launch for programs of ``dtype`` and ``op`` (a kernel
        module: loading one may synchronize the device, so it happens before any caller
        waits for the call)."""

    def direct(self, stream: Any, program: DirectProgram, value: int = 0) -> None:
        """Run ``program`` (a direct kernel) on ``stream``, after its earlier work; with a
        ``value``, the kernel's end writes it into the program's completion words (the
        device's at least that value, never lowering an abort's; the host's only then)."""
        raise NotImplementedError(f"direct: the {self.backend} backend runs no direct kernels")

    # -- out of band (diagnosis and abort) --------------------------------------------------
    @abc.abstractmethod
    def peek(self, address: Any, count: int) -> List[int]:
        """Read ``count`` 64-bit words from the host, ordered after no stream (a blocked
        stream cannot delay it); raises HocclTimeoutError if the device does not answer."""

    @abc.abstractmethod
    def poke(self, writes: Sequence[Tuple[Any, int]]) -> None:
        """Write 64-bit words from the host, ordered after no stream: how ``abort``
        releases waits that no stream operation will ever release."""

    def failure(self) -> Optional[str]:
        """A description of work that failed on this device's streams, if any."""
        return None

    def abort(self, streams: Optional[Sequence[Any]] = None) -> None:
        """Drop work still queued on ``streams`` (default: every stream of this device)
        where the backend can (the host backend's queues).  A communicator that shares
        its device with others (``Communicator.split``) names its own lanes."""

    # -- lifetime ----------------------------------------------------------------------
    @abc.abstractmethod
    def close(self, leak: bool = False) -> None:
        """Release every resource this device created; idempotent.

        ``leak=True``: work that may still touch this device's memory is queued behind
        something that never finished (a stuck caller stream after an abort): keep every
        allocation, mapping and the context alive for the life of the process instead of
        freeing memory that queued work would then write into."""
