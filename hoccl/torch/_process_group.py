"""torch.distributed's ProcessGroup on a hoccl Communicator: the "hoccl" backend.

Each method takes torch's arguments (tensor lists and an options object), checks what
hoccl can do, and makes hoccl calls through the rank's Launcher (which picks the
stream and makes the Work).  What hoccl has no form for is built from what it has:

* list forms (all_gather, gather, reduce_scatter, scatter) go through one flat
  temporary, copied out or in by torch on the call's stream (``_lists``);
* all_to_all with uneven splits, and the list all_to_all, are a batch of send/recv
  pairs (every rank's chunk for every peer) plus a local copy of the own chunk
  (``_p2p.exchange``);
* PREMUL_SUM(f) is SUM times f (``_ops.premultiply``): a number f multiplied by hoccl's
  reduction kernel, else SUM of ``input * f``, the scaled input a temporary (out of
  place) or the tensor itself (all_reduce, whose output overwrites it);
* copies move any dtype as its bytes; reductions take hoccl's dtypes only;
* a recv from any source (host backend) is matched through the group's store
  (``_p2p.SendCounts``).

Like gloo's and NCCL's, the calls are not recorded by autograd: they run with grad mode
off (``_untracked``), so they write into tensors that require grad (DDP's gradients
under ``backward(create_graph=True)``), which hoccl's own API refuses to do.

CPU tensors in a group whose communicator is on a GPU go to a gloo group made from the
same store, except in a job whose hosts differ (``_mixed``: there they go through the
GPU).  Unsupported requests raise InvalidArgumentError naming the call (and, across
hosts, the rank's host and engines).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import InvalidArgumentError
from . import _lists
from ._collectives import all_gather_into, reduce_scatter_into
from ._mixed import is_mixed, library_groups, staged, tensors_of, to_gloo, where
from ._ops import averaged, movable, one_tensor, premultiply, reducible, reduction
from ._p2p import HeldP2P, SendCounts, even_splits, exchange, issue_held
from ._shrinking import shrink
from ._work import Launcher, WorkList

__all__ = ["ProcessGroupHoccl"]


def _async(opts: Any) -> bool:
    """torch passes ``asyncOp``; without it (older releases, C++ callers' defaults) a call is
    asynchronous, which is also correct for a caller that waits at once."""
    return bool(getattr(opts, "asyncOp", True))


def _untracked(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` as torch's backends run a collective: with grad mode off (it is not
    recorded by autograd and writes into tensors that require grad; hoccl's API refuses
    those unless grad mode is off, and torch's in-place copies and scalings inside the
    call would otherwise be recorded or refused); on a mixed job, a GPU rank's CPU
    tensors through its GPU, and errors naming the rank's host and engines (``_mixed``)."""
    @functools.wraps(method)
    def untracked(self: "ProcessGroupHoccl", *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            if not self.across_hosts:
                return method(self, *args, **kwargs)
            try:
                device = self.launcher.device
                if device is not None and self.stages(tensors_of(args)):
                    return staged(functools.partial(method, self, **kwargs), list(args),
                                  device)
                return method(self, *args, **kwargs)
            except InvalidArgumentError as error:
                raise InvalidArgumentError(f"{error} ({where(self.communicator)})") from None
    return untracked
class ProcessGroupHoccl(dist.ProcessGroup):
    """A torch.distributed process group whose collectives are hoccl calls.

    Made by ``dist.init_process_group("hoccl")`` and ``dist.new_group`` once
    ``hoccl.torch`` is imported; ``communicator`` is its ``hoccl.Communicator``."""

    # what torch asks a backend (``_get_backend`` returns the group itself)
    supports_splitting = False
    supports_coalescing = False
    supports_shrinking = True

    def __init__(self, comm: Any = None, cpu_group: Any = None, store: Any = None, *,
                 connect: Optional[Callable[[], Tuple[Any, Any]]] = None, rank: int = 0,
                 world_size: int = 1):
        if comm is not None:
            rank, world_size = comm.rank, comm.world_size
        super().__init__(rank, world_size)  # type: ignore[call-arg]
        self.store = store
        self._connect = connect  # (communicator, cpu group), made at the first call
        self._comm: Any = None
        self._launcher: Optional[Launcher] = None
        self.cpu_group: Any = None
        self.send_counts: Optional[SendCounts] = None
        self.across_hosts = self.mixed = False
        self._coalesced: Optional[List[dist.Work]] = None
        self._group_name = ""
        self.shrinks = 0  # groups made by ``shrink`` from this one
        if comm is not None:
            self._attach(comm, cpu_group)

    def _attach(self, comm: Any, cpu_group: Any) -> None:
        from .._hierarchy import HierarchicalCommunicator
        self._comm = comm
        self.cpu_group = cpu_group  # gloo, for CPU tensors when comm runs on a GPU
        # the host backend's recvs from any source are matched through the group's store
        self.send_counts = (SendCounts(self.store, comm.rank, comm.world_size)
                            if self.store is not None and comm.backend == "host" else None)
        self._launcher = Launcher(comm)
        self.across_hosts = isinstance(comm, HierarchicalCommunicator)
        self.mixed = self.across_hosts and is_mixed(comm)

    @property
    def communicator(self) -> Any:
        """The hoccl Communicator (connected now if the group defers it to its first call)."""
        if self._comm is None:
            if self._connect is None:
                raise InvalidArgumentError("communicator: this hoccl process group was shut "
                                           "down (destroy_process_group)")
            with library_groups():
                self._attach(*self._connect())
        return self._comm

    @property
    def connected(self) -> bool:
        """Whether the communicator is made (a deferred group makes it at its first call)."""
        return self._comm is not None

    @property
    def launcher(self) -> Launcher:
        self.communicator  # noqa: B018 - connects a deferred group
        assert self._launcher is not None
        return self._launcher

    def stages(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether a call on ``tensors`` goes through this rank's GPU (``_mixed``)."""
        return self.mixed and bool(tensors) and all(tensor.device.type == "cpu"
                                                    for tensor in tensors)

    # -- what torch asks of a backend -----------------------------------------------------
    def getBackendName(self) -> str:
        return "hoccl"

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """Set by torch after the creator returns (a Python group keeps it itself)."""
        return self._group_name

    def _get_backend(self, device: Any) -> Any:
        if torch.device(device).type == "cpu" and self.cpu_group is not None:
            return self.cpu_group
        return self

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def shutdown(self) -> None:
        """Close the communicator and let go of it, and so of the torch groups its engines
        hold (a job whose hosts differ), while torch destroys its groups."""
        issue_held()
        if self._comm is not None:
            self._comm.close()
        self._comm = self._launcher = self._connect = None

    def abort(self) -> None:
        if self._comm is not None:
            self._comm.abort("torch.distributed aborted the process group")

    def shrink(self, ranks: List[int], flags: int = 0, opts: Any = None) -> "ProcessGroupHoccl":
        """``dist.shrink_group``'s backend call (``_shrinking.shrink``)."""
        return shrink(self, ranks, flags, opts)

    # -- routing and bookkeeping --------------------------------------------------------
    def _gloo(self, call: str, tensors: Sequence[torch.Tensor]) -> bool:
        """True when ``tensors`` go to the gloo group beside hoccl (``_mixed.to_gloo``)."""
        return to_gloo(call, tensors, self.launcher.device, self.cpu_group is not None)

    def _run(self, issue: Callable[[Any], Any], outputs: List[torch.Tensor],
             tensors: Sequence[torch.Tensor], opts: Any, blocking: bool = False) -> dist.Work:
        work = self.launcher.run(issue, outputs, tensors, _async(opts), blocking=blocking)
        return self._record(work)

    def _record(self, work: dist.Work) -> dist.Work:
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _root(self, call: str, opts: Any) -> int:
        if getattr(opts, "rootTensor", 0) != 0:
            raise InvalidArgumentError(f"{call}: hoccl takes one tensor per rank (rootTensor 0)")
        return opts.rootRank

    # -- collectives ------------------------------------------------------------------------
    @_untracked
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> dist.Work:
        """dist.all_gather_into_tensor."""
        call = "all_gather_into_tensor"
        issue_held()
        if self._gloo(call, [output, input]):
            return self.cpu_group._allgather_base(output, input, opts)
        return self._record(all_gather_into(self.launcher, output, input, _async(opts)))

    # its name before torch 2.13
    _allgather_base = all_gather_single  # type: ignore[assignment]

    @_untracked
    def allgather(self, output_tensors: List[List[torch.Tensor]],  # type: ignore[override]
                  input_tensors: List[torch.Tensor], opts: Any = None) -> dist.Work:
        """dist.all_gather (a list of outputs)."""
        call = "all_gather"
        issue_held()
        input = one_tensor(call, input_tensors)
        outputs = one_tensor(call, output_tensors)
        if self._gloo(call, [input, *outputs]):
            return self.cpu_group.allgather(output_tensors, input_tensors, opts)
        return self._record(_lists.all_gather_list(self.launcher, outputs, input,
                                                   _async(opts)))

    @_untracked
    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]],  # type: ignore[override]
                            input_list: List[torch.Tensor], opts: Any = None) -> dist.Work:
        """dist.all_gather_coalesced: ``output_lists[r][i]`` = rank r's ``input_list[i]``;
        one all_gather of every input, flattened into one temporary, then copies out."""
        call = "all_gather_coalesced"
        issue_held()
        outputs = [output for outputs in output_lists for output in outputs]
        if self._gloo(call, [*input_list, *outputs]):
            return self.cpu_group.allgather_coalesced(output_lists, input_list, opts)
        return self._record(_lists.all_gather_coalesced(self.launcher, output_lists, input_list,
                                                        _async(opts)))

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor],
                                    inputs: List[torch.Tensor], opts: Any = None) -> dist.Work:
        works = [self.all_gather_single(output, input, opts)
                 for output, input in zip(outputs, inputs)]
        return WorkList(works, outputs)

    # its name before torch 2.13
    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    @_untracked
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> dist.Work:
        """dist.reduce_scatter_tensor."""
        call = "reduce_scatter_tensor"
        issue_held()
        if self._gloo(call, [output, input]):
            return self.cpu_group._reduce_scatter_base(output, input, opts)
        op, factor = reduction(call, opts.reduceOp)
        return self._record(reduce_scatter_into(call, self.launcher, output, input, op, factor,
                                                _async(opts)))

    # its name before torch 2.13
    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    @_untracked
    def reduce_scatter(self, output_tensors: List[torch.Tensor],  # type: ignore[override]
                       input_tensors: List[List[torch.Tensor]], opts: Any = None) -> dist.Work:
        """dist.reduce_scatter (a list of inputs)."""
        call = "reduce_scatter"
        issue_held()
        output = one_tensor(call, output_tensors)
        inputs = one_tensor(call, input_tensors)
        if self._gloo(call, [output, *inputs]):
            return self.cpu_group.reduce_scatter(output_tensors, input_tensors, opts)
        op, factor = reduction(call, opts.reduceOp)
        return self._record(_lists.reduce_scatter_list(self.launcher, output, inputs, op, factor,
                                                       _async(opts)))

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor], opts: Any = None) -> dist.Work:
        works = [self.reduce_scatter_single(output, input, opts)
                 for output, input in zip(outputs, inputs)]
        return WorkList(works, outputs)

    # its name before torch 2.13
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    @_untracked
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """dist.all_reduce (in place)."""
        call = "all_reduce"
        issue_held()
        tensor = one_tensor(call, tensors)
        if self._gloo(call, [tensor]):
            return self.cpu_group.allreduce(tensors, opts)
        op, factor = reduction(call, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        reducible(call, tensor, factor)

        def issue(stream: Any) -> Optional[Callable[[], None]]:
            # the output overwrites the tensor: a premultiply needs no temporary
            source, scale = premultiply(self.communicator, tensor, factor, in_place=True)
            called, divide = averaged(self.communicator, op, tensor)
            self.communicator.all_reduce(source, tensor, called, scale=scale, stream=stream)
            return divide
        return self._run(issue, [tensor], [tensor], opts)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> dist.Work:
        works = [self.allreduce([tensor], opts) for tensor in tensors]
        return WorkList(works, tensors)

    @_untracked
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: List[int], input_split_sizes: List[int],
                          opts: Any = None) -> dist.Work:
        """dist.all_to_all_single: even splits are one hoccl all_to_all; uneven ones a
        batch of send/recv pairs (hoccl's all_to_all has equal blocks only)."""
        call = "all_to_all_single"
        issue_held()
        if self._gloo(call, [output, input]):
            return self.cpu_group.alltoall_base(output, input, output_split_sizes,
                                                input_split_sizes, opts)
        if not output_split_sizes and not input_split_sizes:
            if input.numel() % self.size():
                raise InvalidArgumentError(f"{call}: the input's {input.numel()} elements do not "
                                           f"split evenly over world_size {self.size()}")

            def issue(stream: Any) -> None:
                self.communicator.all_to_all(movable(input), movable(output), stream=stream)
            return self._run(issue, [output], [input, output], opts)
        n = self.size()
        sends = input.split(list(input_split_sizes) or even_splits(call, input, n))
        receives = output.split(list(output_split_sizes) or even_splits(call, output, n))
        return self._record(exchange(self.launcher, call, list(receives), list(sends),
                                     [output], _async(opts)))

    # its name before torch 2.13
    alltoall_base = all_to_all_single  # type: ignore[assignment]

    @_untracked
    def alltoall(self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        """dist.all_to_all (lists; chunks may differ in size): send/recv pairs."""
        call = "all_to_all"
        issue_held()
        if self._gloo(call, [*output_tensors, *input_tensors]):
            return self.cpu_group.alltoall(output_tensors, input_tensors, opts)
        if len(output_tensors) != self.size() or len(input_tensors) != self.size():
            raise InvalidArgumentError(f"{call}: expected world_size = {self.size()} input and "
                                       f"output tensors; got {len(input_tensors)} and "
                                       f"{len(output_tensors)}")
        return self._record(exchange(self.launcher, call, output_tensors, input_tensors,
                                     output_tensors, _async(opts)))

    @_untracked
    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        call = "broadcast"
        issue_held()
        tensor = one_tensor(call, tensors)
        if self._gloo(call, [tensor]):
            return self.cpu_group.broadcast(tensors, opts)
        root = self._root(call, opts)

        def issue(stream: Any) -> None:
            buffer = movable(tensor)
            self.communicator.broadcast(buffer if self.rank() == root else None, buffer, root,
                                        stream=stream)
        return self._run(issue, [tensor], [tensor], opts)

    @_untracked
    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """dist.reduce: the root's tensor receives the result, the others' stay as they are."""
        call = "reduce"
        issue_held()
        tensor = one_tensor(call, tensors)
        if self._gloo(call, [tensor]):
            return self.cpu_group.reduce(tensors, opts)
        root = self._root(call, opts)
        op, factor = reduction(call, opts.reduceOp)
        reducible(call, tensor, factor)

        def issue(stream: Any) -> Optional[Callable[[], None]]:
            output = tensor if self.rank() == root else None
            # off the root the tensor must stay as it was: a premultiply goes to a temporary
            source, scale = premultiply(self.communicator, tensor, factor, in_place=False)
            called, divide = averaged(self.communicator, op, output)
            self.communicator.reduce(source, output, root, called, scale=scale, stream=stream)
            return divide
        return self._run(issue, [tensor], [tensor], opts)

    @_untracked
    def gather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],  # type: ignore[override]
               opts: Any = None) -> dist.Work:
        call = "gather"
        issue_held()
        input = one_tensor(call, input_tensors)
        root = self._root(call, opts)
        is_root = self.rank() == root
        outputs: List[torch.Tensor] = one_tensor(call, output_tensors) if is_root else []
        if self._gloo(call, [input, *outputs]):
            return self.cpu_group.gather(output_tensors, input_tensors, opts)
        return self._record(_lists.gather_list(self.launcher, outputs, input, root,
                                               _async(opts)))

    @_untracked
    def scatter(self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]],  # type: ignore[override]
                opts: Any = None) -> dist.Work:
        call = "scatter"
        issue_held()
        output = one_tensor(call, output_tensors)
        root = self._root(call, opts)
        is_root = self.rank() == root
        inputs: List[torch.Tensor] = one_tensor(call, input_tensors) if is_root else []
        if self._gloo(call, [output, *inputs]):
            return self.cpu_group.scatter(output_tensors, input_tensors, opts)
        return self._record(_lists.scatter_list(self.launcher, output, inputs, root,
                                                _async(opts)))

    def barrier(self, opts: Any = None) -> dist.Work:
        """Every rank's stream reaches the barrier before any goes on; ``wait()`` also blocks
        the host until then (as NCCL's barrier does)."""
        issue_held()

        def issue(stream: Any) -> None:
            self.communicator.barrier(stream=stream)
        return self._run(issue, [], [], opts, blocking=True)

    # -- point to point -------------------------------------------------------------------
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """Held until something needs it (see hoccl.torch._p2p); the tag is not used."""
        return self._p2p("send", tensors, dst, tag)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._p2p("recv", tensors, src, tag)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> dist.Work:
        """dist.recv / irecv with no ``src``: on the host backend, a recv from the first
        rank found whose sends to this rank are ahead of the recvs from it (see
        hoccl.torch._p2p); ``Work._source_rank()`` tells which."""
        call = "recv"
        tensor = one_tensor(call, tensors)
        if self._gloo(call, [tensor]):
            return self.cpu_group.recv_anysource(tensors, tag)
        if self.send_counts is None:
            # on a GPU, counting every send in the store would add a host round trip to
            # each one (NCCL has no recv from any source either)
            raise InvalidArgumentError(
                f"{call}: src=None (a recv from any source) needs hoccl's host backend, "
                f"whose sends count themselves in the group's store; got a group on the "
                f"{self.communicator.backend} backend (device {self.communicator.device}), "
                f"where a recv needs its source rank, as on NCCL: pass src=")
        return self._record(HeldP2P(self.launcher, call, movable(tensor), tensor, None,
                                    self.send_counts))

    def _p2p(self, kind: str, tensors: List[torch.Tensor], peer: int, tag: int) -> dist.Work:
        tensor = one_tensor(kind, tensors)
        if self._gloo(kind, [tensor]):
            return getattr(self.cpu_group, kind)(tensors, peer, tag)
        counts = self.send_counts
        if counts is not None and kind == "send":
            counts.announce(peer)
        return self._record(HeldP2P(self.launcher, kind, movable(tensor), tensor, peer, counts))

    # -- coalescing (torch's _coalescing_manager) ------------------------------------------
    def _start_coalescing(self, device: Any) -> None:
        self._coalesced = []

    def _end_coalescing(self, device: Any) -> dist.Work:
        """One Work for every call since ``_start_coalescing``; held send/recv go out now."""
        works, self._coalesced = self._coalesced or [], None
        issue_held()
        return WorkList(works, [tensor for work in works for tensor in work.result()])

    start_coalescing = _start_coalescing  # the names torch's C++ side calls
    end_coalescing = _end_coalescing
