"""The transports of the staged engine: a library's nonblocking steps on host bytes,
each started and then polled until done, so that every step of the engine ends within
its timeout or at an abort.  ``PairTransport`` writes the steps once over pairwise
messages; MPI (through mpi4py; ``cma.py`` reads the peers' memory instead), a
torch.distributed gloo group and UCX (``ucx.py``) each give only how a set of messages
is posted and tested."""

from __future__ import annotations

import abc
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .._errors import HocclTimeoutError
from .arrays import address

__all__ = ["Start", "Transport", "PairTransport", "MpiTransport", "GlooTransport"]

#: starts a transport's step on (host send bytes, host receive bytes), either may be None
Start = Callable[[Any, Any], Any]

#: the tag of the staged engine's messages (``MpiTransport._post``) on its own
#: communicators
_EXCHANGE = 7


class Transport(abc.ABC):
    """A library's nonblocking steps on host byte arrays (flat uint8 numpy arrays): each
    starts a step and returns a request that ``test`` polls."""

    size: int
    member: int
    label: str
    #: the steps that take, in place of a block-major byte array, a list of one byte
    #: array per member (``MpiTransport``)
    blocks: Tuple[str, ...] = ()

    #: ``own=False``: the caller moves its own block (a staged member copies it on its
    #: device), and the step need not fill its own block of ``recv``
    @abc.abstractmethod
    def all_gather(self, send: np.ndarray, recv: np.ndarray, own: bool = True) -> Any: ...

    @abc.abstractmethod
    def all_to_all(self, send: np.ndarray, recv: np.ndarray, own: bool = True) -> Any: ...

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> Any: ...

    @abc.abstractmethod
    def gather(self, send: np.ndarray, recv: Optional[np.ndarray], root: int) -> Any: ...

    @abc.abstractmethod
    def scatter(self, send: Optional[np.ndarray], recv: np.ndarray, root: int) -> Any: ...

    @abc.abstractmethod
    def send(self, buf: np.ndarray, peer: int) -> Any: ...

    @abc.abstractmethod
    def recv(self, buf: np.ndarray, peer: int) -> Any: ...

    @abc.abstractmethod
    def barrier(self) -> Any: ...

    @abc.abstractmethod
    def test(self, request: Any) -> bool: ...

    def close(self) -> None:
        """Free what the transport made."""


class PairTransport(Transport):
    """A transport that moves only pairwise messages: a subclass gives ``_post(sends,
    recvs)`` (each a list of ``(member, byte array)``; every message posted, a request
    returned) and ``test``; the steps are written here, once, over it.  Every step posts
    all its messages before any is waited for, so no order of the members waits in a
    cycle.  A member's messages to one peer match that peer's receives from it in the
    order both post them."""

    #: the list forms ``StagedEngine`` may hand over (``Transport.blocks``)
    blocks = ("all_gather", "all_to_all")

    @abc.abstractmethod
    def _post(self, sends: Sequence[Tuple[int, np.ndarray]],
              recvs: Sequence[Tuple[int, np.ndarray]]) -> Any: ...

    def _others(self) -> List[int]:
        """Every other member, nearest first after this one (a ring's order: the
        members' first messages go to different peers)."""
        return [(self.member + step) % self.size for step in range(1, self.size)]

    def all_gather(self, send: np.ndarray, recv: Any, own: bool = True) -> Any:
        recvs = _pieces(recv, self.size)
        if own:
            _copy(recvs[self.member], send)
        others = self._others()
        return self._post([(peer, send) for peer in others],
                          [(peer, recvs[peer]) for peer in others])

    def all_to_all(self, send: Any, recv: Any, own: bool = True) -> Any:
        sends, recvs = _pieces(send, self.size), _pieces(recv, self.size)
        if own:
            _copy(recvs[self.member], sends[self.member])
        others = self._others()
        return self._post([(peer, sends[peer]) for peer in others],
                          [(peer, recvs[peer]) for peer in others])

    def broadcast(self, buf: np.ndarray, root: int) -> Any:
        if self.member == root:
            return self._post([(peer, buf) for peer in self._others()], [])
        return self._post([], [(root, buf)])

    def gather(self, send: np.ndarray, recv: Optional[np.ndarray], root: int) -> Any:
        if self.member != root:
            return self._post([(root, send)], [])
        assert recv is not None
        recvs = _pieces(recv, self.size)
        _copy(recvs[root], send)
        return self._post([], [(peer, recvs[peer]) for peer in self._others()])

    def scatter(self, send: Optional[np.ndarray], recv: np.ndarray, root: int) -> Any:
        if self.member != root:
            return self._post([], [(root, recv)])
        assert send is not None
        sends = _pieces(send, self.size)
        _copy(recv, sends[root])
        return self._post([(peer, sends[peer]) for peer in self._others()], [])

    def send(self, buf: np.ndarray, peer: int) -> Any:
        return self._post([(peer, buf)], [])

    def recv(self, buf: np.ndarray, peer: int) -> Any:
        return self._post([], [(peer, buf)])

    def barrier(self) -> Any:
        """One byte to and from every other member."""
        token, others = np.zeros(1, np.uint8), self._others()
        return self._post([(peer, token) for peer in others],
                          [(peer, np.zeros(1, np.uint8)) for peer in others])


class MpiTransport(PairTransport):
    """mpi4py's point-to-point messages on bytes: every step's messages posted at once,
    they move as the BTL moves them (a single copy between processes of a host), where a
    nonblocking collective's rounds move only while it is tested."""

    def __init__(self, comm: Any):
        from mpi4py import MPI
        self.MPI, self.comm = MPI, comm
        self.size, self.member, self.label = comm.Get_size(), comm.Get_rank(), "mpi"

    def _post(self, sends: Sequence[Tuple[int, np.ndarray]],
              recvs: Sequence[Tuple[int, np.ndarray]]) -> Any:
        # one tag: MPI matches the messages between two members in the order both post them
        return ([self.comm.Irecv(buf, source=peer, tag=_EXCHANGE) for peer, buf in recvs]
                + [self.comm.Isend(buf, dest=peer, tag=_EXCHANGE) for peer, buf in sends])

    def send(self, buf: np.ndarray, peer: int) -> Any:
        """A synchronous-mode send: done once the peer's receive has matched it, so a send
        whose receive never comes ends in the engine's timeout, as on every other engine
        (a small standard send would be done at once, buffered by MPI)."""
        return [self.comm.Issend(buf, dest=peer, tag=_EXCHANGE)]

    def barrier(self) -> Any:
        return self.comm.Ibarrier()

    def test(self, request: Any) -> bool:
        if isinstance(request, list):
            return bool(self.MPI.Request.Testall(request))
        return bool(request.Test())

    def close(self) -> None:
        if not self.MPI.Is_finalized():
            self.comm.Free()


def _copy(dst: Any, src: Any) -> None:
    """``dst[...] = src``, nothing where they are the same bytes (an in-place all_gather);
    numpy arrays, or byte views of device arrays (torch, cupy) for a transport that
    moves device memory itself."""
    if address(dst)[0] != address(src)[0]:
        dst[...] = src


def _pieces(array: Any, size: int) -> List[np.ndarray]:
    """A member's pieces of a step: the list given, or a byte array's equal parts."""
    if isinstance(array, list):
        return array
    width = array.nbytes // size
    return [array[i * width:(i + 1) * width] for i in range(size)]


class GlooTransport(PairTransport):
    """torch.distributed's point-to-point messages of a (gloo) group on bytes.  gloo's send
    and receive report completion only to ``wait``: a step's messages are all posted,
    then waited for in turn, each at most ``timeout`` seconds (gloo's own limit)."""

    def __init__(self, group: Any, members: Sequence[int], timeout: float):
        self.timeout = timeout
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.group, self.members = torch, dist, group, list(members)
        self.size, self.member = len(self.members), self.members.index(dist.get_rank())
        self.label = _library(torch, dist, group)

    def _post(self, sends: Sequence[Tuple[int, np.ndarray]],
              recvs: Sequence[Tuple[int, np.ndarray]]) -> Any:
        dist, tensor = self.dist, self.torch.from_numpy
        return ([_Posted("recv", dist.irecv(tensor(buf), src=self.members[peer], group=self.group))
                 for peer, buf in recvs if buf.nbytes]
                + [_Posted("send", dist.isend(tensor(buf), dst=self.members[peer],
                                              group=self.group))
                   for peer, buf in sends if buf.nbytes])

    def test(self, request: Any) -> bool:
        """Wait for each posted send or receive (gloo tells its end only to ``wait``), at
        most ``timeout`` seconds: posted first, a step's messages are all in flight while
        the first of them is waited for."""
        import datetime
        for posted in request:
            try:
                posted.work.wait(timeout=datetime.timedelta(seconds=self.timeout))
            except RuntimeError as error:
                raise HocclTimeoutError(f"{posted.what} across hosts ({self.label}, member "
                                        f"{self.member} of {self.size}): not finished within "
                                        f"{self.timeout:g} s, or failed: {error}") from None
        request.clear()
        return True


def _library(torch: Any, dist: Any, group: Any) -> str:
    """The library of a torch group: its backend's name, or "gloo" for a gloo backend
    registered under another name (the groups hoccl's torch backend makes while it
    connects are gloo's: ``hoccl.torch._mixed``)."""
    try:
        backend = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):
        return dist.get_backend(group)
    return "gloo" if isinstance(backend, dist.ProcessGroupGloo) else dist.get_backend(group)


class _Posted:
    """A gloo send or receive in flight (``GlooTransport.send``, ``recv``)."""

    __slots__ = ("what", "work")

    def __init__(self, what: str, work: Any):
        self.what, self.work = what, work
