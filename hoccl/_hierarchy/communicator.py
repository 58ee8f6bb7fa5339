"""The communicator across hosts: the API and argument checks of ``CommunicatorApi``, each
call run as the phases of its ``hoccl.sched.hierarchical`` plan on the level engines."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Type

from .._buffers import Buffer, as_buffer
from .._errors import AbortedError, HocclError, HocclTimeoutError, InvalidArgumentError
from ..bootstrap import Bootstrap
from .._api import CommunicatorApi
from .._group_calls import held_calls
from ..comm import Communicator
from ..sched import Shape
from ..sched.hierarchical import (Call, Divide, HierarchicalPlan, Region, Topology,
                                  build_hierarchical, divide_in_place, verify_hierarchical)
from .arrays import Arrays, framework_array
from .engine import InterHostEngine, Setup
from .hoccl_engine import HocclEngine
from .mpi import MpiEngine
from .nccl import NcclEngine
from .topology import SubBootstrap

__all__ = ["HierarchicalCommunicator", "ENGINES", "INTER_HOST_ENGINES"]

log = logging.getLogger("hoccl")

#: the engines between hosts, by their ``inter_host=`` name
ENGINES: Dict[str, Type[InterHostEngine]] = {
    engine.name: engine for engine in (NcclEngine, MpiEngine, HocclEngine)}
INTER_HOST_ENGINES = tuple(ENGINES)


def _default_engine(backend: str, one_machine: bool) -> str:
    """cuda: NCCL when nccl4py imports or torch.distributed runs on NCCL, else MPI; host:
    hoccl itself for simulated hosts on one machine, else MPI."""
    if backend == "cuda":
        try:
            import nccl.core  # noqa: F401
            return "nccl"
        except ImportError:
            pass
        try:
            import torch.distributed as dist
            if dist.is_initialized() and dist.get_backend() == "nccl":
                return "nccl"
        except ImportError:
            pass
        return "mpi"
    return "hoccl" if one_machine else "mpi"



class HierarchicalCommunicator(CommunicatorApi):
    """One rank of a world that spans hosts.  Create with ``hoccl.init``.

    The API is ``CommunicatorApi``'s, with the same argument checks as ``Communicator``;
    each call runs the phases of its ``hoccl.sched.hierarchical`` plan.  ``describe()`` says how the world
    is split and which engines run where.  Not inside ``hoccl.group()``."""

    def __init__(self, *, topology: Topology, rank: int, host: Communicator,
                 rail: InterHostEngine, world: InterHostEngine, inter_host: str, grouping: str,
                 bootstrap: Bootstrap, verify_plans: bool):
        self.topology = topology
        self.rank = rank
        self.world_size = topology.world_size
        self.backend: str = host.backend
        self.device: Optional[int] = host.device
        self.inter_host = inter_host
        self._host = host
        self._levels: Dict[str, InterHostEngine] = {
            "host": HocclEngine(host, f"hoccl ({host.backend})"), "rail": rail, "world": world}
        self._grouping = grouping
        self._bootstrap = bootstrap
        self._verify_plans = verify_plans
        self._verified: Dict[int, HierarchicalPlan] = {}
        self._streams: Dict[int, Any] = {}   # caller streams used since the last synchronize
        self._aborted_reason = ""
        self._closed = False
        # the host backend runs a call's phases one after another on the host
        self._blocking = host.backend == "host"

    @classmethod
    def connect(cls, *, call: str, backend: str, bootstrap: Bootstrap, topology: Topology,
                hostnames: List[str], grouping: str, device: Optional[int],
                inter_host: Optional[str], mpi_comm: Any, verify_plans: bool,
                connect_host: Callable[..., Communicator]) -> "HierarchicalCommunicator":
        """Build this rank's host communicator, its rail engine and the world engine; every
        rank of ``bootstrap`` must call this at the same time (as ``init`` does)."""
        rank = bootstrap.rank
        one_machine = len(set(hostnames)) == 1
        engine = inter_host if inter_host is not None else _default_engine(backend, one_machine)
        if engine not in ENGINES:
            raise InvalidArgumentError(f"{call}: inter_host must be one of {INTER_HOST_ENGINES} "
                                       f"or None; got {engine!r}")
        kind = ENGINES[engine]
        kind.check_world(call, backend, hostnames)
        if backend == "cuda" and device is None:
            from ..backends import cuda_device_count
            machine_rank = hostnames[:rank].count(hostnames[rank])
            device = machine_rank % cuda_device_count()
        host_index, local = topology.host_of(rank), topology.local_of(rank)
        host = connect_host(SubBootstrap(bootstrap, topology.groups("host")[host_index]), device)
        rail, world = kind.connect(Setup(call=call, backend=backend, bootstrap=bootstrap,
                                         topology=topology, device=device, mpi_comm=mpi_comm,
                                         host=host, connect_host=connect_host))
        bootstrap.barrier()
        comm = cls(topology=topology, rank=rank, host=host, rail=rail, world=world,
                   inter_host=engine, grouping=grouping, bootstrap=bootstrap,
                   verify_plans=verify_plans)
        log.info("init: rank %d/%d on host %d of %d (local rank %d), inter-host engine %s",
                 rank, topology.world_size, host_index, topology.hosts, local, rail.label)
        return comm

    # -- state ------------------------------------------------------------------------------
    def describe(self) -> Dict[str, Any]:
        """How the world is split and which engine runs each level."""
        return {"world_size": self.world_size, "rank": self.rank, "hosts": self.topology.hosts,
                "local_size": self.topology.local_size,
                "host": self.topology.host_of(self.rank),
                "local_rank": self.topology.local_of(self.rank), "grouping": self._grouping,
                "intra_host": self._levels["host"].label,
                "inter_host": self._levels["rail"].label,
                "ordering": ("each call's phases run one after another on the host"
                             if self._blocking else "every phase enqueued on the caller's stream")}

    @property
    def host_communicator(self) -> Communicator:
        """The hoccl communicator of this rank's host (world ``local_size``)."""
        return self._host

    @property
    def device_handle(self) -> Any:
        return self._host.device_handle

    @property
    def options(self) -> Any:
        return self._host.options

    @property
    def timeout(self) -> float:
        return self._host.timeout

    @property
    def max_sms(self) -> int:
        return self._host.max_sms

    @property
    def copy_sms(self) -> int:
        return self._host.copy_sms

    @property
    def aborted(self) -> bool:
        return bool(self._aborted_reason) or self._host.aborted

    @property
    def abort_reason(self) -> str:
        return self._aborted_reason or self._host.abort_reason

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        t = self.topology
        return (f"<hoccl.HierarchicalCommunicator rank {self.rank}/{self.world_size} "
                f"({t.hosts} hosts x {t.local_size}) backend={self.backend} device={self.device} "
                f"inter_host={self.inter_host}>")

    # -- host side ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block until this rank's calls have finished: the caller streams they used (the
        engine's work is on them) and the host communicator's calls."""
        self._usable("synchronize")
        if self.backend == "cuda":
            from cuda.bindings import driver
            # the frameworks may have made another GPU's context current since hoccl's
            # last call: the streams below are this GPU's
            self._host.device_handle.activate()
            for stream in list(self._streams):
                self._host.device_handle.synchronize_stream(driver.CUstream(stream), self.timeout)
            self._streams.clear()
        for engine in self._levels.values():
            engine.synchronize()

    def abort(self, reason: str = "") -> None:
        """Abort the host communicator and the engines (NCCL's ``ncclCommAbort``; an MPI
        step in progress cannot be taken back).  Idempotent."""
        if self._aborted_reason:
            return
        self._aborted_reason = reason or f"rank {self.rank}: abort() was called"
        for engine in self._levels.values():
            try:
                engine.abort(self._aborted_reason)
            except HocclError as error:
                log.warning("rank %d abort: %s", self.rank, error)

    def split(self, color: Optional[int], key: Optional[int] = None, *,
              timeout: Optional[float] = None, verify_plans: Optional[bool] = None,
              max_sms: Optional[int] = None, copy_sms: Optional[int] = None,
              **options: Any) -> Optional[Communicator]:
        """Not offered yet: a world across hosts would need its rails and inter-host
        engines split too.  Raises ``InvalidArgumentError``."""
        self._usable("split")
        raise InvalidArgumentError("split: not supported across hosts yet (a "
                                   "HierarchicalCommunicator); split the MPI communicator "
                                   "and call hoccl.init(mpi_comm=...) on each part instead")

    def register(self, array: Any) -> Any:
        """Not offered yet across hosts (the inter-host engines have registrations of
        their own).  Raises ``InvalidArgumentError``."""
        self._usable("register")
        raise InvalidArgumentError("register: not supported across hosts yet (a "
                                   "HierarchicalCommunicator); calls on unregistered buffers "
                                   "work as ever")

    def deregister(self, window: Any) -> None:
        self._usable("deregister")
        raise InvalidArgumentError("deregister: nothing is registered across hosts")

    def _explain(self, shape: Shape) -> Dict[str, Any]:
        raise InvalidArgumentError("explain: not offered across hosts yet (a "
                                   "HierarchicalCommunicator): each call runs the phases of its "
                                   "hoccl.sched.hierarchical plan; explain on host_communicator "
                                   "tells the path of a phase inside a host")

    def set_options(self, **changes: Any) -> None:
        """Options of the hoccl communicators (the host's, and the rails' with hoccl)."""
        self._usable("set_options")
        for engine in self._levels.values():
            engine.set_options(**changes)

    def close(self) -> None:
        """Wait for outstanding work, then close the engines, the host communicator and
        the bootstrap.  Idempotent."""
        if self._closed:
            return
        if not self.aborted:
            try:
                self.synchronize()
            except HocclError as error:
                log.warning("rank %d close: %s", self.rank, error)
        self._closed = True
        for level in ("rail", "world", "host"):  # NCCL's rails were split from its world
            try:
                self._levels[level].close()
            except Exception as error:  # every level must get its close
                log.warning("rank %d close %s: %r", self.rank, level, error)
        self._bootstrap.close()

    # -- a call -------------------------------------------------------------------------
    def _usable(self, name: str) -> None:
        if self._closed:
            raise InvalidArgumentError(f"{name}: the communicator is closed")
        if self.aborted:
            raise AbortedError(f"{name}: the communicator was aborted: {self.abort_reason}")

    def _plan(self, shape: Shape) -> HierarchicalPlan:
        plan = build_hierarchical(shape, self.topology)
        if self._verify_plans and self._verified.get(id(plan)) is not plan:
            verify_hierarchical(plan)
            self._verified[id(plan)] = plan
        return plan

    def _run(self, name: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
               stream: Any) -> None:
        """Run ``shape``'s hierarchical plan on this rank's arrays (every argument has been
        checked by ``CommunicatorApi``)."""
        if shape.scale is not None:
            raise InvalidArgumentError(
                f"{name}: scale is not supported across hosts yet; scale the result, or use a "
                f"communicator within one host")
        if held_calls() is not None:
            raise InvalidArgumentError(
                f"{name}: a communicator across hosts does not take calls inside hoccl.group() "
                f"(its phases mix engines); make them outside, sends and receives in an order "
                f"that cannot wait in a cycle")
        arrays = {key: framework_array(buffer.owner) for key, buffer in buffers.items()
                  if buffer is not None}
        handle = self._stream(name, stream, list(arrays.values()))
        plan = self._plan(shape)
        first = next(iter(arrays.values()), None)
        kit = Arrays.of(first) if first is not None else Arrays("numpy")
        views = {key: kit.flat(array) for key, array in arrays.items()}
        scratch = plan.scratch_count(self.rank)
        if scratch:
            views["scratch"] = kit.empty(views[next(iter(views))], scratch, handle)

        def region(part: Optional[Region]) -> Any:
            return None if part is None else views[part.buffer][part.start:part.stop]
        for level, steps in plan.program(self.rank):
            self._usable(name)
            if level == "local":
                for step in steps:
                    assert isinstance(step, Divide)
                    self._divide(name, region(step.region), step.divisor, handle)
                continue
            engine = self._levels[level]
            for step in steps:
                assert isinstance(step, Call)
                try:
                    engine.issue(step, region(step.send), region(step.recv), handle)
                except HocclTimeoutError as error:  # a step left to its engine: no more calls
                    self.abort(f"rank {self.rank}: {name}: {error}")
                    raise
            if self._blocking:
                engine.synchronize()

    def _divide(self, name: str, view: Any, divisor: int,
                stream: Optional[int]) -> None:
        """``view /= divisor`` as avg divides.  On GPUs hoccl's own reduction kernel does it
        (one input, ``divisor``), on the caller's stream through the same driver handle
        the phases before it were given, on at most ``max_sms`` SMs; the host backend's
        phases run on the host, and so does its division."""
        if stream is None:
            divide_in_place(view, divisor)
            return
        buffer = as_buffer(name, "recvbuf", view)
        if buffer.count:
            device = self._host.device_handle
            device.activate()
            device.reduce(device.resolve_stream(stream, [view]), buffer.address,
                          [buffer.address], buffer.count, buffer.dtype, "avg", divisor=divisor)

    def _stream(self, name: str, stream: Any, arrays: List[Any]) -> Optional[int]:
        """The caller's stream as a raw handle (None on the host backend, which runs each
        call's phases on the host and so takes no stream)."""
        if self.backend == "host":
            if stream is not None:
                raise InvalidArgumentError(
                    f"{name}: across hosts the host backend runs each call's phases on the "
                    f"host, one after another; pass stream=None")
            return None
        device = self._host.device_handle
        device.activate()
        handle = int(device.resolve_stream(stream, arrays))
        self._streams[handle] = True
        return handle
