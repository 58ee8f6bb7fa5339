"""The transports of the staged engine: a library's nonblocking steps on host bytes
(MPI through mpi4py, or a torch.distributed gloo group), each started and then polled
until done, so that every step of the engine ends within its timeout or at an abort."""

from __future__ import annotations

import abc
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .._errors import HocclTimeoutError

__all__ = ["Start", "Transport", "PairTransport", "MpiTransport", "GlooTransport"]

#: starts a transport's step on (host send bytes, host receive bytes), either may be None
Start = Callable[[Any, Any], Any]

#: the tag of the staged engine's exchanges (``MpiTransport._exchange``) on its own
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


class MpiTransport(Transport):
    """mpi4py's nonblocking collectives on bytes."""

    def __init__(self, comm: Any):
        from mpi4py import MPI
        self.MPI, self.comm = MPI, comm
        self.size, self.member, self.label = comm.Get_size(), comm.Get_rank(), "mpi"

    #: its all_gather's receive and its all_to_all's two sides may be lists of one byte
    #: array a member (``StagedEngine``: a member's own arrays, with no copy)
    blocks = ("all_gather", "all_to_all")

    def all_gather(self, send: np.ndarray, recv: Any, own: bool = True) -> Any:
        recvs = _pieces(recv, self.size)
        if own:
            _copy(recvs[self.member], send)
        return self._exchange([send] * self.size, recvs)

    def all_to_all(self, send: Any, recv: Any, own: bool = True) -> Any:
        sends, recvs = _pieces(send, self.size), _pieces(recv, self.size)
        if own:
            _copy(recvs[self.member], sends[self.member])
        return self._exchange(sends, recvs)

    def _exchange(self, sends: Sequence[np.ndarray], recvs: Sequence[np.ndarray]) -> Any:
        """Every peer's block sent and received at once, as point-to-point messages: they
        move as the BTL moves them (a single copy between processes of a host), where a
        nonblocking collective's rounds move only while it is tested."""
        requests = []
        for step in range(1, self.size):
            source, dest = (self.member - step) % self.size, (self.member + step) % self.size
            requests.append(self.comm.Irecv(recvs[source], source=source, tag=_EXCHANGE))
            requests.append(self.comm.Isend(sends[dest], dest=dest, tag=_EXCHANGE))
        return requests

    def broadcast(self, buf: np.ndarray, root: int) -> Any:
        return self.comm.Ibcast(buf, root=root)

    def gather(self, send: np.ndarray, recv: Optional[np.ndarray], root: int) -> Any:
        return self.comm.Igather(send, recv, root=root)

    def scatter(self, send: Optional[np.ndarray], recv: np.ndarray, root: int) -> Any:
        return self.comm.Iscatter(send, recv, root=root)

    def send(self, buf: np.ndarray, peer: int) -> Any:
        """A synchronous-mode send: done once the peer's receive has matched it, so a send
        whose receive never comes ends in the engine's timeout, as on every other engine
        (a small standard send would be done at once, buffered by MPI)."""
        return self.comm.Issend(buf, dest=peer)

    def recv(self, buf: np.ndarray, peer: int) -> Any:
        return self.comm.Irecv(buf, source=peer)

    def barrier(self) -> Any:
        return self.comm.Ibarrier()

    def test(self, request: Any) -> bool:
        if isinstance(request, list):
            return bool(self.MPI.Request.Testall(request))
        return bool(request.Test())

    def close(self) -> None:
        if not self.MPI.Is_finalized():
            self.comm.Free()


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``, nothing where they are the same bytes (an in-place all_gather)."""
    if dst.ctypes.data != src.ctypes.data:
        dst[...] = src


def _pieces(array: Any, size: int) -> List[np.ndarray]:
    """A member's pieces of a step: the list given, or a byte array's equal parts."""
    if isinstance(array, list):
        return array
    width = array.nbytes // size
    return [array[i * width:(i + 1) * width] for i in range(size)]


class GlooTransport(Transport):
    """torch.distributed's asynchronous collectives of a (gloo) group on bytes.  gloo's
    send and receive report completion only to ``wait``: they are waited for at once, at
    most ``timeout`` seconds (gloo's own limit)."""

    def __init__(self, group: Any, members: Sequence[int], timeout: float):
        self.timeout = timeout
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.group, self.members = torch, dist, group, list(members)
        self.size, self.member = len(self.members), self.members.index(dist.get_rank())
        self.label = _library(torch, dist, group)

    def _t(self, array: Optional[np.ndarray]) -> Any:
        return None if array is None else self.torch.from_numpy(array)

    def all_gather(self, send: np.ndarray, recv: np.ndarray, own: bool = True) -> Any:
        gather = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        return gather(self._t(recv), self._t(send), group=self.group, async_op=True)

    def all_to_all(self, send: np.ndarray, recv: np.ndarray, own: bool = True) -> Any:
        return self.dist.all_to_all_single(self._t(recv), self._t(send), group=self.group,
                                           async_op=True)

    def broadcast(self, buf: np.ndarray, root: int) -> Any:
        return self.dist.broadcast(self._t(buf), src=self.members[root], group=self.group,
                                   async_op=True)

    def gather(self, send: np.ndarray, recv: Optional[np.ndarray], root: int) -> Any:
        parts = list(self._t(recv).chunk(self.size)) if recv is not None else None
        return self.dist.gather(self._t(send), gather_list=parts, dst=self.members[root],
                                group=self.group, async_op=True)

    def scatter(self, send: Optional[np.ndarray], recv: np.ndarray, root: int) -> Any:
        parts = list(self._t(send).chunk(self.size)) if send is not None else None
        return self.dist.scatter(self._t(recv), scatter_list=parts, src=self.members[root],
                                 group=self.group, async_op=True)

    def send(self, buf: np.ndarray, peer: int) -> Any:
        return _Posted("send", self.dist.isend(self._t(buf), dst=self.members[peer],
                                               group=self.group))

    def recv(self, buf: np.ndarray, peer: int) -> Any:
        return _Posted("recv", self.dist.irecv(self._t(buf), src=self.members[peer],
                                               group=self.group))

    def _waited(self, request: "_Posted") -> bool:
        """Wait for a posted send or receive (gloo tells its end only to ``wait``), at most
        ``timeout`` seconds: posted first, a batch's sends and receives are all in flight
        while the first of them is waited for."""
        import datetime
        try:
            request.work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as error:
            raise HocclTimeoutError(f"{request.what} across hosts ({self.label}, member "
                                    f"{self.member} of {self.size}): not finished within "
                                    f"{self.timeout:g} s, or failed: {error}") from None
        return True

    def barrier(self) -> Any:
        return self.all_gather(np.zeros(1, np.uint8), np.zeros(self.size, np.uint8))

    def test(self, request: Any) -> bool:
        if isinstance(request, _Posted):
            return self._waited(request)
        return request is None or bool(request.is_completed())


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
