"""The communicator across hosts: the API and argument checks of ``CommunicatorApi``, each
call run as the phases of its ``hoccl.sched.hierarchical`` plan on the level engines."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, Union

from .._buffers import Buffer, as_buffer
from .._errors import AbortedError, HocclError, HocclTimeoutError, InvalidArgumentError
from ..bootstrap import Bootstrap
from .._api import CommunicatorApi
from .._group_calls import held_calls
from ..comm import Communicator
from ..sched import Shape
from ..sched.hierarchical import (Call, Divide, HierarchicalPlan, PipelinedPlan, Region, Step,
                                  Topology, divide_in_place, verify_hierarchical,
                                  verify_pipelined)
from ..config import ACROSS_HOSTS, Config
from .arrays import Arrays, framework_array
from .engine import InterHostEngine, Setup, caller_begin, caller_end
from .hoccl_engine import HocclEngine
from .phases import Entry, PhaseRunner, plan_of
from .hosts import SHARED_SETTINGS, HostReport, agree, intra_host_engine, local_report, refusal
from .nccl import NcclEngine
from .shrinking import shrink
from .pairs import PairCalls, PairGroup
from .staged import GlooStagedEngine, MpiStagedEngine
from .topology import SubBootstrap
from .torch_group import TorchGroupEngine, torch_groups
from .ucx import UcxStagedEngine, usable as ucx_usable

__all__ = ["HierarchicalCommunicator", "ENGINES", "INTER_HOST_ENGINES"]

log = logging.getLogger("hoccl")

#: the engines between hosts, by their ``inter_host=`` name
ENGINES: Dict[str, Type[InterHostEngine]] = {
    engine.name: engine for engine in (NcclEngine, MpiStagedEngine, GlooStagedEngine,
                                       UcxStagedEngine, HocclEngine)}
INTER_HOST_ENGINES = tuple(ENGINES)
#: what a collective runs on each kind of engine inside a host
_PRIMITIVES = {"torch": TorchGroupEngine.primitives, "cuda": HocclEngine.primitives,
               "host": HocclEngine.primitives}


def _default_engine(reports: List[HostReport], one_machine: bool,
                    ucx_everywhere: Callable[[], bool]) -> str:
    """Every host on hoccl's cuda backend: NCCL when nccl4py imports or torch.distributed
    runs on NCCL.  Every rank on the host backend: hoccl itself for simulated hosts on one
    machine.  Otherwise (hosts of different kinds, or no NCCL): UCX where ucxx loads on
    every rank (``ucx_everywhere``, asked of every rank at once), else staged through
    host memory over MPI when mpi4py imports, else over torch.distributed's gloo."""
    backends = {report.backend for report in reports}
    if backends == {"cuda"}:
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
    if backends == {"host"} and one_machine:
        return "hoccl"
    if ucx_everywhere():
        return "ucx"
    try:
        import mpi4py  # noqa: F401
        return "mpi"
    except ImportError:
        return "gloo"


class HostSettings:
    """What a communicator across hosts reads from its host's communicator: the device,
    the options, the timeout and the SM caps (``set_options`` changes them there)."""

    _host: Communicator

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
    def fuse_sums(self) -> bool:
        return self._host.fuse_sums


class HierarchicalCommunicator(PairCalls, HostSettings, CommunicatorApi):
    """One rank of a world that spans hosts.  Create with ``hoccl.init``.

    The API is ``CommunicatorApi``'s, with the same argument checks as ``Communicator``;
    each call runs the phases of its ``hoccl.sched.hierarchical`` plan.  ``describe()``
    says how the world is split and which engines run where (each host's device kind and
    engine inside it).  Inside ``hoccl.group()`` it takes sends and receives, run
    together when the group ends (``pairs.py``), and refuses collectives."""

    def __init__(self, *, topology: Topology, rank: int, host: Communicator,
                 intra: InterHostEngine, rail: InterHostEngine, world: InterHostEngine,
                 inter_host: str, grouping: str, bootstrap: Bootstrap, config: Config,
                 hosts: List[HostReport]):
        self.topology = topology
        self.rank = rank
        self.world_size = topology.world_size
        self.backend: str = host.backend
        self.device: Optional[int] = host.device
        self.inter_host = inter_host
        self._host = host
        self._hosts = hosts
        self._levels: Dict[str, InterHostEngine] = {"host": intra, "rail": rail, "world": world}
        self._grouping = grouping
        self._bootstrap = bootstrap
        self._config = config
        self._verified: Dict[int, Union[HierarchicalPlan, PipelinedPlan]] = {}
        self._refusals: Dict[int, Tuple[Any, Optional[str]]] = {}  # by plan: (plan, verdict)
        self._streams: Dict[int, Any] = {}   # caller streams used since the last synchronize
        self._aborted_reason = ""
        self._closed = False
        self._calls = 0
        # the host backend runs a call's phases one after another on the host
        self._blocking = host.backend == "host"
        device = host.device_handle
        self._runner = (PhaseRunner(host.timeout) if self._blocking else
                        PhaseRunner(host.timeout, device.create_event, device.destroy_event))
        self._group = PairGroup(self._batch)  # hoccl.group() hands it held sends, receives

    @classmethod
    def connect(cls, *, call: str, backend: str, bootstrap: Bootstrap, topology: Topology,
                hostnames: List[str], grouping: str, device: Optional[int],
                inter_host: Optional[str], mpi_comm: Any, config: Config,
                connect_host: Callable[..., Communicator]) -> "HierarchicalCommunicator":
        """Report this rank's host kind (one allgather), build its host communicator and
        the engine inside its host, its rail engine and the world engine; every rank of
        ``bootstrap`` must call this at the same time (as ``init`` does)."""
        rank = bootstrap.rank
        one_machine = len(set(hostnames)) == 1
        mine = local_report(hostnames[rank], intra_host_engine(config.intra_host, backend),
                            backend, tuple((name, getattr(config, name))
                                           for name in SHARED_SETTINGS))
        reports: List[HostReport] = bootstrap.allgather(mine)
        hosts = agree(call, reports, topology)
        engine = inter_host if inter_host is not None else _default_engine(
            reports, one_machine, lambda: all(bootstrap.allgather(ucx_usable())))
        if engine not in ENGINES:
            raise InvalidArgumentError(f"{call}: inter_host must be one of {INTER_HOST_ENGINES} "
                                       f"or None; got {engine!r}")
        kind = ENGINES[engine]
        kind.check_world(call, [report.backend for report in reports], hostnames)
        if backend == "cuda" and device is None:
            from ..backends import cuda_device_count
            machine_rank = hostnames[:rank].count(hostnames[rank])
            device = machine_rank % cuda_device_count()
        host_index, local = topology.host_of(rank), topology.local_of(rank)
        members = topology.groups("host")
        host = connect_host(SubBootstrap(bootstrap, members[host_index]), device)
        torch_hosts = [index for index, report in enumerate(hosts) if report.engine == "torch"]
        intra: InterHostEngine = HocclEngine(host, mine.label)
        if torch_hosts:  # every rank makes every torch group, as torch requires
            groups = torch_groups(call, rank, topology.world_size,
                                  [members[index] for index in torch_hosts])
            if host_index in torch_hosts:
                engine_inside = TorchGroupEngine(groups[torch_hosts.index(host_index)],
                                                 members[host_index], host.timeout, mine.label)
                engine_inside.probe("cuda" if backend == "cuda" else "cpu")
                intra = engine_inside
            lacks = bootstrap.allgather(intra.lacks)
            hosts = [replace(report, lacks=tuple(lacks[members[index][0]]))
                     for index, report in enumerate(hosts)]
        rail, world = kind.connect(Setup(call=call, backend=backend, bootstrap=bootstrap,
                                         topology=topology, device=device, mpi_comm=mpi_comm,
                                         host=host, connect_host=connect_host, config=config,
                                         devices=tuple(r.device for r in reports)))
        bootstrap.barrier()
        comm = cls(topology=topology, rank=rank, host=host, intra=intra, rail=rail,
                   world=world, inter_host=engine, grouping=grouping, bootstrap=bootstrap,
                   config=config, hosts=hosts)
        log.info("init: rank %d/%d on host %d of %d (local rank %d), inside %s, between %s",
                 rank, topology.world_size, host_index, topology.hosts, local, intra.label,
                 rail.label)
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
                "host_engines": [report.describe(index, ranks) for index, (report, ranks)
                                 in enumerate(zip(self._hosts, self.topology.groups("host")))],
                "phases": self._config.phases,
                "ordering": ("each call's phases run on the host" if self._blocking else
                             "every phase enqueued on the caller's stream"
                             if self._levels["rail"].enqueues else
                             "hoccl's phases enqueued on the caller's stream; the engine "
                             "between hosts on a stream of its own, ordered by events with "
                             "the phases before and after it")}

    @property
    def config(self) -> Config:
        """The settings this communicator was made with (``set_options`` changes them)."""
        return self._config

    @property
    def host_communicator(self) -> Communicator:
        """The hoccl communicator of this rank's host (world ``local_size``)."""
        return self._host

    @property
    def calls(self) -> int:
        """How many calls (collectives, send, recv, barrier) this rank has made so far."""
        return self._calls

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

    def _shrink(self, exclude: Any, wait: bool, settings: Dict[str, Any]) -> CommunicatorApi:
        return shrink(self, exclude, wait, settings)

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
        """Settings for later calls: the phases' (``phases``, ``phase_bytes``) here, the
        others on the hoccl communicators (the host's, and the rails' with hoccl).  The
        engines are fixed at init: ``intra_host`` and ``stage_bytes`` cannot change."""
        self._usable("set_options")
        config = self._config.replace("set_options", **changes)
        fixed = sorted(name for name in ("intra_host", "stage_bytes")
                       if getattr(config, name) != getattr(self._config, name))
        if fixed:
            raise InvalidArgumentError(f"set_options: {fixed} choose the engines, made at init; "
                                       f"they cannot change (got {changes})")
        hoccl_settings = {name: value for name, value in changes.items()
                          if name not in ACROSS_HOSTS}
        if hoccl_settings:
            self._host.set_options(**hoccl_settings)
            for engine in self._levels.values():
                engine.set_options(**hoccl_settings)
        self._config = config

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
        self._runner.close()
        closers = [(level, self._levels[level].close) for level in ("rail", "world", "host")]
        # NCCL's rails were split from its world; the hoccl host communicator goes last
        # (the host level's engine when it is hoccl's: closing twice is harmless)
        for level, close in closers + [("host communicator", self._host.close)]:
            try:
                close()
            except Exception as error:  # every level must get its close
                log.warning("rank %d close %s: %r", self.rank, level, error)
        self._bootstrap.close()

    # -- a call -------------------------------------------------------------------------
    def _usable(self, name: str) -> None:
        if self._closed:
            raise InvalidArgumentError(f"{name}: the communicator is closed")
        if self.aborted:
            raise AbortedError(f"{name}: the communicator was aborted: {self.abort_reason}")

    def _plan(self, shape: Shape) -> Union[HierarchicalPlan, PipelinedPlan]:
        config = self._config
        plan = plan_of(shape, self.topology, config.phases, config.phase_bytes,
                       any(engine.enqueues for engine in self._levels.values()))
        if config.verify_plans and self._verified.get(id(plan)) is not plan:
            if isinstance(plan, PipelinedPlan):
                verify_pipelined(plan)
            else:
                verify_hierarchical(plan)
            self._verified[id(plan)] = plan
        return plan

    def _run(self, name: str, shape: Shape, buffers: Dict[str, Optional[Buffer]],
               stream: Any) -> None:
        """Run ``shape``'s hierarchical plan on this rank's (checked) arrays."""
        self._repeats.remember(shape, buffers)
        self._calls += 1
        if shape.scale is not None:
            raise InvalidArgumentError(
                f"{name}: scale is not supported across hosts yet; scale the result, or use a "
                f"communicator within one host")
        held = held_calls()
        if held is not None:
            return self._hold(name, shape, buffers, stream, held)
        arrays = {key: framework_array(buffer.owner) for key, buffer in buffers.items()
                  if buffer is not None}
        handle = self._stream(name, stream, list(arrays.values()))
        with self._naming_peers(name, self._peers_of(name, shape)):
            self._plan_run(name, shape, arrays, handle)

    def _plan_run(self, name: str, shape: Shape, arrays: Dict[str, Any],
                  handle: Optional[int]) -> None:
        plan = self._plan(shape)
        self._refuse(name, plan)
        first = next(iter(arrays.values()), None)
        kit = Arrays.of(first) if first is not None else Arrays("numpy")
        views = {key: kit.flat(array) for key, array in arrays.items()}
        scratch = plan.scratch_count(self.rank)
        if scratch:
            views["scratch"] = kit.empty(views[next(iter(views))], scratch, handle)

        def region(part: Optional[Region]) -> Any:
            return None if part is None else views[part.buffer][part.start:part.stop]

        def runner(level: str, steps: Tuple[Step, ...]) -> Callable[[Any, Any], None]:
            return lambda ready, done: self._steps(name, level, steps, region, handle, ready,
                                                   done)
        if isinstance(plan, PipelinedPlan):
            program = plan.program(self.rank)
            last: Dict[int, int] = {}
            entries: List[Entry] = []
            for index, entry in enumerate(program):
                entries.append((entry.level, runner(entry.level, entry.steps),
                                last.get(entry.chunk)))
                last[entry.chunk] = index
            try:
                self._runner.pipelined(name, entries)
            except HocclTimeoutError as error:
                self.abort(f"rank {self.rank}: {name}: {error}")
                raise
            return
        self._runner.sequential([(level, runner(level, steps), None)
                                 for level, steps in plan.program(self.rank)])

    def _refuse(self, name: str, plan: Union[HierarchicalPlan, PipelinedPlan]) -> None:
        """Raise, on every rank alike and before any data moves, when a host's engine
        cannot run its steps of ``plan`` (what it lacks was exchanged at init)."""
        if not any(report.lacks for report in self._hosts):
            return
        if id(plan) not in self._refusals:
            whole = plan.flatten() if isinstance(plan, PipelinedPlan) else plan
            steps = [(self.topology.host_of(rank), step.shape.collective)
                     for phase in whole.phases if phase.level == "host"
                     for rank, made in enumerate(phase.steps) for step in made
                     if isinstance(step, Call)]
            self._refusals[id(plan)] = (plan, refusal(name, self._hosts, steps, _PRIMITIVES))
        verdict = self._refusals[id(plan)][1]
        if verdict is not None:
            raise InvalidArgumentError(verdict)

    def _steps(self, name: str, level: str, steps: Tuple[Step, ...],
               region: Callable[[Optional[Region]], Any], handle: Optional[int],
               ready: Any = None, done: Any = None) -> None:
        """One phase's steps of this rank on its level's engine, after the event ``ready``
        and before the event ``done`` on the device (``PhaseRunner``)."""
        self._usable(name)
        device = self._host.device_handle
        engine = None if level == "local" else self._levels[level]
        begin, end = (caller_begin, caller_end) if engine is None else (engine.begin, engine.end)
        work = handle if handle is None else begin(device, handle, ready)
        for step in steps:
            if isinstance(step, Divide):
                self._divide(name, region(step.region), step.divisor, work)
                continue
            assert engine is not None
            try:
                engine.issue(step, region(step.send), region(step.recv), work)
            except HocclTimeoutError as error:  # a step left to its engine: no more calls
                self.abort(f"rank {self.rank}: {name}: {error}")
                raise
        if handle is not None and work is not None:
            end(device, handle, work, done)
        if engine is not None and self._blocking:
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
