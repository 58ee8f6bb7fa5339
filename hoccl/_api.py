"""The public API of a communicator, with every argument check, apart from what runs it.

``CommunicatorApi`` holds the collectives, send, recv and barrier: each resolves and
checks its buffers (``hoccl._validate``), describes the call as a ``Shape`` and hands it
to one hook, ``_run(name, shape, buffers, stream)``.  A communicator derives from it and
supplies the hook and the state it reads (``_usable``, ``rank``, ``world_size``,
``backend``, ``device``) and the host-side methods (``synchronize``, ``close``, ...):
``hoccl.Communicator`` runs a call on its engine and group, ``HierarchicalCommunicator``
as the phases of a plan across hosts.  Both get the same checks, so the same bad
argument raises the same error from either.
"""

from __future__ import annotations

import abc
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from . import _validate as check
from ._buffers import Buffer, as_buffer
from ._errors import InvalidArgumentError
from ._group_calls import held_calls
from ._repeats import Repeats
from .sched import Shape

__all__ = ["CommunicatorApi"]

#: the collectives ``CommunicatorApi.explain`` tells about
_EXPLAINED = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
              "reduce", "gather", "scatter")


_Method = TypeVar("_Method", bound=Callable[..., None])


def _refusable(method: _Method) -> _Method:
    """A call whose wrong arguments raise InvalidArgumentError before it is made: its
    peers are told in its place (``_refused_call``), so that their matching calls end too
    and every rank's sequence of calls stays aligned.  The error is named after the public
    call (a helper below the API, the device's ``resolve_stream``, names its own).

    A call whose arguments were checked before (``hoccl._repeats``) goes straight to
    ``_run`` with what those checks made of them; the others are checked in full, and
    ``_run`` keeps what their checks made (``Repeats.remember``)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: "CommunicatorApi", *args: Any, **kwargs: Any) -> None:
        repeats = self._repeats
        try:
            key = repeats.current = repeats.key(name, args, kwargs)
            if key is not None:
                replay = repeats.replays.get(key)
                if replay is not None and self._replay(name, replay, args, kwargs):
                    return  # a repeat, replayed (``hoccl._engine.replay``)
            found = None if key is None else repeats.take(key, args, kwargs)
            if found is not None:  # checked before: the same checks would pass again
                self._usable(name)
                self._run(name, found[0], found[1], kwargs.get("stream"))
                return
            repeats.pending = None if key is None else (key, args, kwargs)
            try:
                method(self, *args, **kwargs)
            finally:
                repeats.pending = None
        except InvalidArgumentError as error:
            if not getattr(error, "made", False):
                peer = kwargs.get("peer", args[1] if len(args) > 1 else None)
                self._refused_call(name, peer, error)
            named = check.renamed(name, error)
            if named is error:
                raise
            raise named from None
        finally:
            repeats.current = None
    return call  # type: ignore[return-value]


class CommunicatorApi(abc.ABC):
    """The collectives and their argument checks; subclasses run the checked calls
    (``_run``) and own the state (``_usable``)."""

    rank: int
    world_size: int
    #: "cuda" or "host"
    backend: str
    #: CUDA ordinal of this rank's GPU (None on the host backend)
    device: Optional[int]

    # -- what a communicator supplies ---------------------------------------------------
    @abc.abstractmethod
    def _usable(self, name: str) -> None:
        """Raise, naming ``name``, if no call can be made now (closed, aborted)."""

    @abc.abstractmethod
    def _run(self, name: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
             stream: Any) -> None:
        """Run the checked call ``name`` of ``shape`` on ``buffers`` (by role: "send",
        "recv", or "send"/"recv" alone for send and recv; None where a rank has none).
        First ``self._repeats.remember(shape, buffers)``: the call's repeats skip the
        checks."""

    @property
    def _repeats(self) -> Repeats:
        """The calls checked so far, by their arguments (``hoccl._repeats``)."""
        repeats = self.__dict__.get("_repeat_cache")
        if repeats is None:
            repeats = self.__dict__["_repeat_cache"] = Repeats()
        return repeats

    def _replay(self, name: str, replay: Any, args: tuple, kwargs: Dict[str, Any]) -> bool:
        """Replay a repeat of a call made before on the same arguments (``replay``: what
        ``_run`` kept, ``Repeats.keep_replay``); False: not replayed, nothing done (the
        call then goes the whole way)."""
        return False

    def _refused_call(self, name: str, peer: Any, error: InvalidArgumentError) -> None:
        """This rank's call ``name`` (``peer``: a send's or recv's) raised ``error`` before
        it was made: tell the peers in its place, where the communicator can."""

    @property
    @abc.abstractmethod
    def device_handle(self) -> Any:
        """This rank's ``hoccl.backends`` Device."""

    @property
    @abc.abstractmethod
    def options(self) -> Any:
        """The planning options (``hoccl.sched.Options``) later calls use."""

    @property
    @abc.abstractmethod
    def timeout(self) -> float:
        """Seconds a host wait lasts before the communicator is aborted."""

    @property
    @abc.abstractmethod
    def max_sms(self) -> int:
        """The most SMs this communicator's reduction kernels take."""

    @property
    @abc.abstractmethod
    def copy_sms(self) -> int:
        """The most SMs the same-GPU copy of out-of-place own blocks takes."""

    @property
    @abc.abstractmethod
    def aborted(self) -> bool:
        """Whether the communicator was aborted."""

    @property
    @abc.abstractmethod
    def abort_reason(self) -> str:
        """Why it was aborted ("" if it was not)."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether ``close`` ran."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until all work this communicator enqueued has finished."""

    @abc.abstractmethod
    def abort(self, reason: str = "") -> None:
        """Release every wait of this communicator and make later calls raise."""

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for outstanding work, then release everything.  Idempotent."""

    @abc.abstractmethod
    def split(self, color: Optional[int], key: Optional[int] = None, *,
              timeout: Optional[float] = None, verify_plans: Optional[bool] = None,
              max_sms: Optional[int] = None, copy_sms: Optional[int] = None,
              **options: Any) -> Optional["CommunicatorApi"]:
        """A new communicator of the ranks that pass the same ``color``."""

    def shrink(self, exclude: Any, *, wait: bool = True, **settings: Any) -> "CommunicatorApi":
        """A new communicator of every rank not in ``exclude`` (ncclCommShrink): the way on
        after a rank was lost (its process died, was killed mid-call, closed, or is to be
        left out while still running).  Every rank that goes on calls it with the same
        ``exclude``; the excluded ranks do not.

        The ranks keep their order, numbered 0..n-1 among themselves.  The new
        communicator has its own signal pads, lanes and mailboxes, and this one's
        settings unless given here (``timeout=`` and any ``hoccl.Config`` field).  This
        one is left aborted: with ``wait`` (torch's SHRINK_DEFAULT) once its calls in
        flight have finished or failed (a lost peer ends them within about a second, a
        live peer that never makes its call only at the timeout), else at once
        (SHRINK_ABORT); no call of it hangs.  Close it when convenient.  The ranks meet
        through this communicator's mailboxes, not its bootstrap (which would wait for
        the lost rank): each wait is bounded by the timeout, and a rank that goes on but
        dies or closes meanwhile makes the others raise PeerDeadError or
        PeerClosedError (shrink again, excluding it too); a rank that gets another's
        ``exclude`` and finds it different raises MismatchError (one left waiting for a
        rank that disagreed raises when that rank closes, or at the timeout).  The new
        communicator can shrink again, not split.  ``init_local`` ranks shrink together
        (``hoccl.shrink_local``).  Across simulated hosts (``inter_host="hoccl"``) the
        survivors get a communicator across their hosts, or a ``Communicator`` when one
        host is left; where they are not as many on every host, each counts as a host
        of its own.  Communicators between real hosts (MPI, gloo, NCCL, torch groups
        inside hosts) refuse to shrink.  Not inside ``hoccl.group()``.
        docs/troubleshooting.md ("Going on after a lost rank") has an example."""
        if held_calls() is not None:
            raise InvalidArgumentError("shrink: not inside hoccl.group(); shrink after it")
        if not isinstance(wait, bool):
            raise InvalidArgumentError(f"shrink: wait must be True or False; got {wait!r}")
        return self._shrink(exclude, wait, settings)

    def _shrink(self, exclude: Any, wait: bool, settings: Dict[str, Any]) -> "CommunicatorApi":
        raise InvalidArgumentError(
            f"shrink: not supported across hosts yet ({type(self).__name__}); make a new "
            f"communicator of the processes that go on (hoccl.init over their own MPI "
            f"communicator or store)")

    @abc.abstractmethod
    def register(self, array: Any) -> Any:
        """Register ``array`` with every rank (a collective call)."""

    @abc.abstractmethod
    def deregister(self, window: Any) -> None:
        """Drop a registration (a collective call)."""

    @abc.abstractmethod
    def set_options(self, **changes: Any) -> None:
        """Change settings (fields of ``hoccl.Config``) for later calls."""

    @abc.abstractmethod
    def _explain(self, shape: Shape) -> Dict[str, Any]:
        """What ``explain`` tells of the checked ``shape``."""

    def __enter__(self) -> "CommunicatorApi":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def explain(self, collective: str, nbytes: int, dtype: Any = "float32", *,
                in_place: bool = False, op: Any = "sum", root: int = 0) -> Dict[str, Any]:
        """The path and settings a call would get, and where each came from: ``path``
        (push, pull, one_shot, direct), ``settings`` (the planning options), ``sources``
        (each setting the user or a table row decided: "user" or "table row N (...)"),
        ``row`` and ``table`` (where the table came from, or "defaults").  ``nbytes`` is
        nccl-tests' size: the whole output of all_gather, the whole input of
        reduce_scatter and all_to_all, the buffer of the others.  Nothing is enqueued."""
        name = "explain"
        if collective not in _EXPLAINED:
            raise InvalidArgumentError(f"{name}: collective must be one of {_EXPLAINED}; got "
                                       f"{collective!r}")
        itemsize = check.dtype_itemsize(name, dtype)
        blocks = self.world_size if collective in ("all_gather", "reduce_scatter",
                                                   "all_to_all") else 1
        nbytes = check.count(name, "nbytes", nbytes, itemsize * blocks,
                             f"{blocks} blocks of {dtype}")
        shape = Shape(collective, self.world_size, nbytes // itemsize // blocks,
                      check.dtype_name(name, dtype), itemsize, op=check.reduce_op(name, op),
                      root=check.rank(name, "root", root, self.world_size),
                      in_place=check.flag(name, "in_place", in_place))
        return self._explain(shape)

    # -- public collectives ----------------------------------------------------------------
    @_refusable
    def all_gather(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:
        """``recvbuf[r*count:(r+1)*count] = sendbuf of rank r`` for every rank r.

        Naive equivalent: ``recv = concatenate([send_of(r) for r in range(world_size)])``.
        In place when ``sendbuf`` is this rank's own block of ``recvbuf`` (no copy of
        the own block at all).  Ordered after the work already on ``stream`` and before
        the work enqueued on it later; returns without waiting.
        """
        name = "all_gather"
        send, recv = self._buffers(name, sendbuf=sendbuf, recvbuf=recvbuf)
        check.blocks(name, send, recv, self.world_size, recv_is_large=True)
        in_place = check.in_place(name, self.rank, send, recv,
                                  recv.block(self.rank, send.count), send)
        shape = self._shape(name, send, in_place=in_place)
        self._run(name, shape, {"send": send, "recv": recv}, stream)

    @_refusable
    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, op: Any = "sum", *,
                       scale: Optional[float] = None, stream: Any = None) -> None:
        """``recvbuf = op over ranks r of sendbuf_r[rank*count:(rank+1)*count]``.

        In place when ``recvbuf`` is this rank's own block of ``sendbuf``.  Reductions
        run on at most ``max_sms`` SMs, overlapped with the copies.  ``scale`` (a sum of
        floats only; every rank passes the same): the sum times ``scale``, multiplied by
        the reduction kernel before it rounds (torch's PREMUL_SUM, with no pass of its own).
        """
        name = "reduce_scatter"
        send, recv = self._buffers(name, sendbuf=sendbuf, recvbuf=recvbuf)
        op = check.reduce_op(name, op)
        factor = check.scale(name, scale, op, recv.dtype)
        check.blocks(name, send, recv, self.world_size, recv_is_large=False)
        in_place = check.in_place(name, self.rank, send, recv,
                                  send.block(self.rank, recv.count), recv)
        shape = self._shape(name, recv, op=op, in_place=in_place, scale=factor)
        self._run(name, shape, {"send": send, "recv": recv}, stream)

    @_refusable
    def all_reduce(self, sendbuf: Any, recvbuf: Any, op: Any = "sum", *,
                   scale: Optional[float] = None, stream: Any = None) -> None:
        """``recvbuf = op over ranks of sendbuf`` on every rank.  In place when they are one
        buffer.  ``scale``: as for ``reduce_scatter``."""
        name = "all_reduce"
        send, recv = self._buffers(name, sendbuf=sendbuf, recvbuf=recvbuf)
        op = check.reduce_op(name, op)
        factor = check.scale(name, scale, op, send.dtype)
        check.same_shape(name, send, recv)
        in_place = check.in_place(name, self.rank, send, recv, recv, send)
        shape = self._shape(name, send, op=op, in_place=in_place, scale=factor)
        self._run(name, shape, {"send": send, "recv": recv}, stream)

    @_refusable
    def all_to_all(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:
        """Block j of rank i's ``sendbuf`` goes to block i of rank j's ``recvbuf``."""
        name = "all_to_all"
        send, recv = self._buffers(name, sendbuf=sendbuf, recvbuf=recvbuf)
        check.same_shape(name, send, recv)
        if send.count % self.world_size:
            raise InvalidArgumentError(f"{name}: sendbuf.size must be a multiple of world_size "
                                       f"{self.world_size}; got {send.count}")
        check.disjoint(name, send, recv)
        shape = self._shape(name, send, count=send.count // self.world_size)
        self._run(name, shape, {"send": send, "recv": recv}, stream)

    @_refusable
    def broadcast(self, sendbuf: Any, recvbuf: Any, root: int, *, stream: Any = None) -> None:
        """Every rank's ``recvbuf`` = root's ``sendbuf`` (``sendbuf`` is ignored off the root
        and may be None).  In place when ``sendbuf is recvbuf`` on the root."""
        name = "broadcast"
        root = check.rank(name, "root", root, self.world_size)
        is_root = self.rank == root
        send, recv = self._buffers(name, sendbuf=sendbuf if is_root else None, recvbuf=recvbuf,
                                   optional=() if is_root else ("sendbuf",))
        in_place = False  # only the root knows; the plans of other ranks do not depend on it
        if is_root:
            check.same_shape(name, send, recv)
            in_place = check.in_place(name, self.rank, send, recv, recv, send)
        shape = self._shape(name, recv, root=root, in_place=in_place)
        self._run(name, shape, {"send": send, "recv": recv}, stream)

    @_refusable
    def reduce(self, sendbuf: Any, recvbuf: Any, root: int, op: Any = "sum", *,
               scale: Optional[float] = None, stream: Any = None) -> None:
        """Root's ``recvbuf`` = op over ranks of ``sendbuf`` (``recvbuf`` may be None
        elsewhere).  ``scale``: as for ``reduce_scatter``."""
        name = "reduce"
        root = check.rank(name, "root", root, self.world_size)
        op = check.reduce_op(name, op)
        is_root = self.rank == root
        send, recv = self._buffers(name, sendbuf=sendbuf, recvbuf=recvbuf if is_root else None,
                                   optional=() if is_root else ("recvbuf",))
        in_place = False
        if is_root:
            check.same_shape(name, send, recv)
            in_place = check.in_place(name, self.rank, send, recv, recv, send)
        factor = check.scale(name, scale, op, send.dtype)
        shape = self._shape(name, send, op=op, root=root, in_place=in_place,
                            scale=factor)
        self._run(name, shape, {"send": send, "recv": recv}, stream)

    @_refusable
    def gather(self, sendbuf: Any, recvbuf: Any, root: int, *, stream: Any = None) -> None:
        """Root's ``recvbuf[r*count:(r+1)*count]`` = rank r's ``sendbuf`` (``recvbuf`` may be
        None off the root).  In place when the root's ``sendbuf`` is its own block of
        ``recvbuf``."""
        self._rooted_blocks("gather", sendbuf, recvbuf, root, stream)

    @_refusable
    def scatter(self, sendbuf: Any, recvbuf: Any, root: int, *, stream: Any = None) -> None:
        """Rank r's ``recvbuf`` = root's ``sendbuf[r*count:(r+1)*count]`` (``sendbuf`` may be
        None off the root).  In place when the root's ``recvbuf`` is its own block of
        ``sendbuf``."""
        self._rooted_blocks("scatter", sendbuf, recvbuf, root, stream)

    def _rooted_blocks(self, name: str, sendbuf: Any, recvbuf: Any, root: int,
                       stream: Any) -> None:
        """gather and scatter: the root's large buffer holds world_size blocks of the size
        of every rank's small one (send for gather, receive for scatter)."""
        root = check.rank(name, "root", root, self.world_size)
        is_root = self.rank == root
        gathers = name == "gather"
        large_name = "recvbuf" if gathers else "sendbuf"  # None is allowed for it off the root
        send, recv = self._buffers(name, sendbuf=sendbuf if is_root or gathers else None,
                                   recvbuf=recvbuf if is_root or not gathers else None,
                                   optional=() if is_root else (large_name,))
        small, large = (send, recv) if gathers else (recv, send)
        in_place = False
        if is_root:
            check.blocks(name, send, recv, self.world_size, recv_is_large=gathers,
                         whose="the root's ")
            in_place = check.in_place(name, self.rank, send, recv,
                                      large.block(root, small.count), small)
        shape = self._shape(name, small, root=root, in_place=in_place)
        self._run(name, shape, {"send": send, "recv": recv}, stream)

    @_refusable
    def send(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        """Send ``buf`` to ``peer``, which must call ``recv`` with a buffer of the same size.

        Without ``hoccl.group()`` the call may wait on the host until ``peer`` makes its
        ``recv`` (the ranks swap buffer descriptors); a cycle of sends must be grouped."""
        self._pair("send", buf, peer, stream)

    @_refusable
    def recv(self, buf: Any, peer: int, *, stream: Any = None) -> None:
        """Receive into ``buf`` what ``peer`` sends with ``send``."""
        self._pair("recv", buf, peer, stream)

    @_refusable
    def barrier(self, *, stream: Any = None) -> None:
        """Work enqueued on ``stream`` after the barrier starts only after every rank's
        stream reached its barrier.  Zero SMs, no data."""
        self._usable("barrier")
        self._run("barrier", Shape("barrier", self.world_size, 0), {}, stream)

    # -- argument checks -------------------------------------------------------------
    def _buffers(self, name: str, optional: Tuple[str, ...] = (),
                 **arrays: Any) -> List[Buffer]:
        """Resolve each array (None only where ``optional``; then None is returned)."""
        self._usable(name)
        resolved: List[Any] = []
        for argument, array in arrays.items():
            if array is None:
                if argument in optional:
                    resolved.append(None)
                    continue
                raise InvalidArgumentError(f"{name}: {argument} is required on rank "
                                           f"{self.rank}; got None")
            buffer = as_buffer(name, argument, array,
                               writable=argument == "recvbuf" or name == "recv",
                               reduction=name in ("all_reduce", "reduce_scatter", "reduce"))
            check.on_device(name, argument, buffer, self.backend, self.device)
            resolved.append(buffer)
        return resolved

    def _shape(self, name: str, buffer: Buffer, count: Optional[int] = None, **fields: Any
               ) -> Shape:
        return Shape(name, self.world_size, buffer.count if count is None else count,
                     buffer.dtype, buffer.itemsize, **fields)

    def _pair(self, name: str, buf: Any, peer: int, stream: Any) -> None:
        (buffer,) = self._buffers(name, buf=buf)
        peer = check.rank(name, "peer", peer, self.world_size, other_than=self.rank)
        sender, receiver = (self.rank, peer) if name == "send" else (peer, self.rank)
        shape = Shape("sendrecv", self.world_size, buffer.count, buffer.dtype, buffer.itemsize,
                      root=sender, peer=receiver)
        self._run(name, shape, {name: buffer}, stream)
