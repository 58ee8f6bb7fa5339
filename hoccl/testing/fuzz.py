"""A seeded differential fuzzer: random calls on real communicators, checked against numpy.

    python -m hoccl.testing.fuzz --ranks 4 --calls 100000 --seed 7      # ranks of one process
    mpiexec -n 4 python -m hoccl.testing.fuzz --calls 100000 --seed 7   # a rank a process
    HOCCL_LOCAL_SIZE=2 mpiexec -n 4 python -m hoccl.testing.fuzz --hierarchical  # 2 hosts x 2

``program(seed, world_size, calls, settings)`` draws the calls from ``seed`` alone, so
every process draws the same program: every collective in place and out of place, every
dtype (bfloat16 where numpy has it through ml_dtypes), counts from 0 to
``settings.max_count`` (most small, a few large), every op and root, sums with a
``scale``, plain and registered buffers (``hoccl.empty``: one slab a communicator, each
call's buffers at the same offsets on every rank), ``stream=None`` and two streams of
each rank's own, rings of send/recv (every rank sends to rank + shift and receives from
rank - shift) inside ``hoccl.group()``, groups of several collectives beside rings,
barriers, and splits (``split_local`` or ``split``) whose children make calls of their
own; under mpiexec, in about a third of the steps one rank is late to each call (``late``).
Each of these can be switched off (``Settings``; ``--hierarchical`` keeps what a
communicator across hosts takes).

``Runner.run`` makes the calls, step by step: each call's inputs are drawn from
``(seed, step, call)`` for every rank (so each process knows the reference of its own
ranks), every output is poisoned first (``hoccl.testing.poison``), and after the step
every output of this process's ranks is compared bit for bit with
``hoccl.testing.expected``.  A wrong output is counted and the run goes on; an error
(a call that raised) ends the run.  The report names the seed and the command that
replays the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import numpy_dtype
from ..config import environ
from ..backends._kernels import MAX_INPUTS
from . import (POISON_BITS, ArrayModule, _COUNTS, _in_place_buffers, array_module_for,
               assert_exact, expected, is_poison, poison, random_array)
from .fuzz_program import (_ALIGN, COLLECTIVES, OPS, REDUCING, ROOTED, SCALES, SLAB_BYTES, Call,
                           Settings, Step, coverage, program)

__all__ = ["Settings", "Call", "Step", "Report", "Runner", "program", "coverage", "run_local",
           "run_process", "replay_command", "summary", "main"]

@dataclass
class Report:
    """What a run found on this process's ranks."""
    seed: int
    world_size: int
    calls: int = 0          # calls made per rank (send and recv count one each)
    outputs: int = 0        # outputs compared (one per rank and call that has one)
    wrong: int = 0          # outputs that differ from numpy's
    errors: List[str] = field(default_factory=list)
    empty: int = 0          # of the outputs, those of no element (a flipped bit cannot show)
    failures: List[str] = field(default_factory=list)  # the first wrong outputs, described
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.wrong and not self.errors


class _Slab:
    """A communicator's registered slab, handed out call by call at the same offsets on
    every rank (each call takes three slots of its largest buffer's size)."""

    def __init__(self, comm: Any, arrays: ArrayModule):
        import hoccl
        self.comm, self.arrays = comm, arrays
        self.array = hoccl.empty(SLAB_BYTES, "uint8", comm, framework=arrays.kind)
        self.used = 0

    def take(self, nbytes: int) -> Optional[int]:
        """The offset of three slots of ``nbytes`` (rounded up), or None when they do not
        fit; slot k of them is at offset + k * ``slot_bytes(nbytes)``."""
        slot = self.slot_bytes(nbytes)
        if self.used + 3 * slot > SLAB_BYTES:
            return None
        start, self.used = self.used, self.used + 3 * slot
        return start

    @staticmethod
    def slot_bytes(nbytes: int) -> int:
        return -(-max(nbytes, 1) // _ALIGN) * _ALIGN

    def place(self, offset: int, data: np.ndarray) -> Any:
        """``data`` copied into the slab at ``offset``; the view is returned."""
        raw = self.array[offset:offset + data.nbytes]
        if self.arrays.kind == "torch":
            import torch
            view = raw.view(getattr(torch, str(data.dtype)))
        else:
            view = raw.view(data.dtype)
        self.arrays.fill(view, data)
        return view


class Runner:
    """Runs a program on ``comms`` (every rank of ``init_local``, or this process's rank)
    and checks each output against numpy.  ``fault="flip"`` flips the lowest bit of the
    first element of every output before it is compared: each non-empty output must then
    count as wrong (how the checker is shown to fail)."""

    def __init__(self, comms: Sequence[Any], seed: int, fault: Optional[str] = None,
                 split: Any = None):
        self.comms = list(comms)
        self.seed = seed
        self.fault = fault
        self.backend = self.comms[0].backend
        #: makes children: ``split(comms, colors) -> the children of comms`` (None each
        #: where a rank's color has none)
        self.split = split
        self.slabs: Dict[int, _Slab] = {}
        #: each rank's streams by ``Call.stream``: None, then two of its own
        self.streams = {comm.rank: [None, _new_stream(comm), _new_stream(comm)]
                        for comm in self.comms}
        self.report = Report(seed, self.comms[0].world_size)
        self.settings = Settings()

    def run(self, steps: Sequence[Step], settings: Settings) -> Report:
        started = time.monotonic()
        self.settings = settings
        if settings.registered:
            for comm in self.comms:  # collective: every rank, in the same order
                self.slabs[comm.rank] = _Slab(comm, array_module_for(self.backend, "uint8"))
        try:
            for index, step in enumerate(steps):
                try:
                    self._step(index, step)
                except Exception as error:  # noqa: BLE001 - reported, and the run ends
                    self.report.errors.append(f"step {index} ({step.describe()}): "
                                              f"{type(error).__name__}: {error}")
                    break
        finally:
            if not self.report.errors:
                for slab in self.slabs.values():
                    slab.comm.deregister(slab.array)
            self.report.seconds = time.monotonic() - started
        return self.report

    # -- one step --------------------------------------------------------------------------
    def _step(self, index: int, step: Step) -> None:
        if step.colors is None:
            self._calls(index, step, self.comms, 0)
            return
        children = self.split(self.comms, list(step.colors))
        try:
            by_color: Dict[int, List[Any]] = {}
            for comm, child in zip(self.comms, children):
                if child is not None:
                    by_color.setdefault(step.colors[comm.rank], []).append(child)
            for color, members in sorted(by_color.items()):
                self._calls(index, step, members, color + 1)
        finally:
            for child in children:
                if child is not None:
                    child.close()

    def _calls(self, index: int, step: Step, comms: List[Any], color: int) -> None:
        for slab in self.slabs.values():
            slab.used = 0
        prepared = [self._prepare(comms, call, [self.seed, index, position, color],
                                  registered=color == 0)
                    for position, call in enumerate(step.calls)]
        if self.backend != "host":  # the inputs' copies to the GPUs ran on other streams
            for comm in comms:
                ArrayModule("cupy").synchronize(comm.device)
        # the children of a split use their default streams
        streams = self.streams if color == 0 else {comm.rank: [None] * 3 for comm in comms}
        late = self._late(index, comms)
        if step.grouped:
            import hoccl
            with hoccl.group():
                for comm in comms:
                    for call, (_, buffers, _) in zip(step.calls, prepared):
                        late()
                        _issue(comm, call, *buffers[comm.rank], streams[comm.rank][call.stream])
        else:
            for call, (_, buffers, _) in zip(step.calls, prepared):
                for comm in comms:
                    late()
                    _issue(comm, call, *buffers[comm.rank], streams[comm.rank][call.stream])
        late()
        for comm in comms:
            comm.synchronize()
        for call, (want, buffers, bits) in zip(step.calls, prepared):
            self._check(index, step, call, comms, want, buffers, bits)
        self.report.calls += sum(call.calls_per_rank for call in step.calls)

    def _late(self, index: int, comms: List[Any]) -> Any:
        """What this process does before each call of step ``index`` and before its
        synchronize: under mpiexec (``Settings.late``), in about a third of the steps one
        rank (the same on every process, drawn from the seed and the step) sleeps 2-6 ms
        there, so that its peers' calls and messages come before its own; else nothing."""
        rng = np.random.default_rng([self.seed, index, 0x1A7E])
        if (not self.settings.late or len(self.comms) != 1 or rng.random() >= 0.3
                or int(rng.integers(self.comms[0].world_size)) != self.comms[0].rank):
            return lambda: None
        return lambda: time.sleep(0.002 + 0.004 * rng.random())

    def _prepare(self, comms: List[Any], call: Call, key: List[int], registered: bool
                 ) -> Tuple[List[Optional[np.ndarray]], Dict[int, Tuple[Any, Any]], int]:
        """The reference and every local rank's (send, recv) of ``call``, outputs poisoned."""
        n = comms[0].world_size
        if call.collective == "barrier":
            return [None] * n, {comm.rank: (None, None) for comm in comms}, 0
        rng = np.random.default_rng(key)
        collective = "send_recv" if call.collective == "ring" else call.collective
        send_count, recv_count = (call.count * n if times == "n" else call.count
                                  for times in _COUNTS[collective])
        inputs: List[Any] = [random_array(rng, send_count, call.dtype) for _ in range(n)]
        if call.collective == "ring":
            want: List[Optional[np.ndarray]] = [inputs[(r - call.root) % n].copy()
                                                for r in range(n)]
        else:
            if call.collective in ("broadcast", "scatter"):
                inputs = [x if r == call.root else None for r, x in enumerate(inputs)]
            topology = getattr(comms[0], "topology", None)  # across hosts: its fold order
            want = expected(call.collective, inputs, op=call.op, root=call.root,
                            scale=call.scale, local_size=getattr(topology, "local_size", None),
                            inputs_per_launch=MAX_INPUTS if self.backend == "cuda" else None)
        bits = POISON_BITS[call.dtype]
        if any(w is not None and is_poison(w).any() for w in want):
            bits ^= (1 << 8 * numpy_dtype(call.dtype).itemsize) - 1
        arrays = array_module_for(self.backend, call.dtype)
        itemsize = numpy_dtype(call.dtype).itemsize
        buffers = {}
        for comm in comms:
            r = comm.rank
            # a slab is uint8 of the backend's array module: cupy on GPUs has no bfloat16
            in_slab = registered and call.registered and (
                self.backend == "host" or call.dtype != "bfloat16")
            slab = self.slabs.get(r) if in_slab else None
            largest = max(send_count, recv_count) * itemsize
            offset = slab.take(largest) if slab else None

            def make(slot: int, data: np.ndarray, comm: Any = comm, slab: Any = slab,
                     offset: Optional[int] = offset) -> Any:
                if offset is None:
                    return arrays.asarray(data, comm.device)
                return slab.place(offset + slot * slab.slot_bytes(largest), data)
            recv = make(0, poison(recv_count, call.dtype, bits)) if want[r] is not None else None
            send = make(1, inputs[r]) if inputs[r] is not None else None
            if call.in_place:
                send, recv = _in_place_buffers(call.collective, r, call.root, n, call.count,
                                               inputs[r], send, recv, make, call.dtype, bits)
            buffers[r] = (send, recv)
        return want, buffers, bits

    def _check(self, index: int, step: Step, call: Call, comms: List[Any],
               want: List[Optional[np.ndarray]], buffers: Dict[int, Tuple[Any, Any]],
               bits: int) -> None:
        arrays = array_module_for(self.backend, call.dtype)
        for comm in comms:
            reference = want[comm.rank]
            if reference is None:
                continue
            got = np.array(arrays.to_numpy(buffers[comm.rank][1], call.dtype), copy=True)
            if self.fault == "flip" and got.size:
                got.view(f"u{got.dtype.itemsize}")[0] ^= 1
            self.report.outputs += 1
            self.report.empty += not got.size
            try:
                assert_exact(f"step {index} ({step.describe()}): {call.describe()}: rank "
                             f"{comm.rank} of {comm.world_size}", reference, got, bits)
            except AssertionError as wrong:
                self.report.wrong += 1
                if len(self.report.failures) < 10:
                    self.report.failures.append(str(wrong))


def _new_stream(comm: Any) -> Any:
    """A stream of ``comm``'s device for ``stream=``: the host backend's own, or cupy's."""
    if comm.backend == "host":
        return comm.device_handle.create_stream()
    import cupy
    with cupy.cuda.Device(comm.device):
        return cupy.cuda.Stream(non_blocking=True)


def _issue(comm: Any, call: Call, send: Any, recv: Any, stream: Any) -> None:
    """Rank ``comm.rank``'s part of ``call``, on ``stream``."""
    name = call.collective
    if name == "barrier":
        comm.barrier(stream=stream)
    elif name == "ring":
        rank, n = comm.rank, comm.world_size
        comm.send(send, (rank + call.root) % n, stream=stream)
        comm.recv(recv, (rank - call.root) % n, stream=stream)
    elif name in ("broadcast", "gather", "scatter"):
        getattr(comm, name)(send, recv, call.root, stream=stream)
    elif name == "reduce":
        comm.reduce(send, recv, call.root, call.op, scale=call.scale, stream=stream)
    elif name in ("reduce_scatter", "all_reduce"):
        getattr(comm, name)(send, recv, call.op, scale=call.scale, stream=stream)
    else:
        getattr(comm, name)(send, recv, stream=stream)


# -- running it -------------------------------------------------------------------------------
def _under_mpi() -> bool:
    return any(name in os.environ for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK",
                                               "PMIX_RANK"))


def replay_command(seed: int, world_size: int, calls: int, settings: Settings,
                   mpi: bool, backend: str = "host") -> str:
    """The command that runs the same program again."""
    flags = " ".join([f"--calls {calls}", f"--seed {seed}"] + settings.flags()
                     + ([f"--backend {backend}"] if backend != "host" else []))
    if mpi:
        hosts = environ("HOCCL_LOCAL_SIZE")
        return (f"{f'HOCCL_LOCAL_SIZE={hosts} ' if hosts else ''}mpiexec -n {world_size} "
                f"python -m hoccl.testing.fuzz {flags}")
    return f"python -m hoccl.testing.fuzz --ranks {world_size} {flags}"


def run_local(world_size: int, seed: int, calls: int, settings: Settings = Settings(), *,
              fault: Optional[str] = None, **init: Any) -> Report:
    """The program on ``init_local(world_size)`` (``init``: its settings)."""
    import hoccl
    comms = hoccl.init_local(world_size, **init)
    try:
        runner = Runner(comms, seed, fault,
                        split=lambda parents, colors: hoccl.split_local(parents, colors))
        return runner.run(program(seed, world_size, calls, settings), settings)
    finally:
        for comm in comms:
            comm.close()


def run_process(seed: int, calls: int, settings: Settings = Settings(), *,
                fault: Optional[str] = None, **init: Any) -> Report:
    """The program on this process's rank of ``hoccl.init()`` (under mpiexec)."""
    import hoccl
    comm = hoccl.init(**init)
    try:
        runner = Runner([comm], seed, fault,
                        split=lambda parents, colors: [parents[0].split(colors[parents[0].rank])])
        return runner.run(program(seed, comm.world_size, calls, settings), settings)
    finally:
        comm.close()


def summary(report: Report, ranks: str) -> List[str]:
    """The report's lines: ``hoccl fuzz <ranks>: N calls per rank, M outputs, W wrong, E
    errors`` and the first failures."""
    lines = [f"hoccl fuzz {ranks}: seed {report.seed}, {report.calls} calls per rank, "
             f"{report.outputs} outputs checked, {report.wrong} wrong, {len(report.errors)} "
             f"errors, {report.seconds:.1f} s"]
    lines += [f"  wrong: {failure}" for failure in report.failures]
    lines += [f"  error: {error}" for error in report.errors]
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hoccl.testing.fuzz",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per rank")
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one")
    parser.add_argument("--ranks", type=int, default=4,
                        help="ranks of init_local (ignored under mpiexec: one a process)")
    parser.add_argument("--backend", default="host")
    parser.add_argument("--max-count", type=int, default=Settings().max_count)
    parser.add_argument("--dtypes", default=",".join(Settings().dtypes))
    parser.add_argument("--no-registered", action="store_true")
    parser.add_argument("--no-splits", action="store_true")
    parser.add_argument("--no-rings", action="store_true")
    parser.add_argument("--no-streams", action="store_true")
    parser.add_argument("--no-scales", action="store_true")
    parser.add_argument("--hierarchical", action="store_true",
                        help="what a communicator across hosts (HOCCL_LOCAL_SIZE) takes: no "
                             "groups, rings, splits, registered buffers, streams or scales")
    parser.add_argument("--no-grouped-collectives", action="store_true",
                        help="groups hold send/recv rings only, no collectives")
    parser.add_argument("--no-late", action="store_true",
                        help="no rank made late to the calls of some steps (under mpiexec)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--dump-stacks-after", type=float, default=0.0,
                        help="print every thread's stack once after this many seconds "
                             "(a run that hangs shows where it waits; 0: never)")
    parser.add_argument("--fault", choices=("flip",), default=None,
                        help="corrupt every output before it is checked (the checker must fail)")
    args = parser.parse_args(argv)
    if args.dump_stacks_after > 0:
        import faulthandler
        faulthandler.dump_traceback_later(args.dump_stacks_after, exit=False)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    mpi = _under_mpi()
    flat = not args.hierarchical
    settings = Settings(max_count=args.max_count, dtypes=tuple(args.dtypes.split(",")),
                        registered=flat and not args.no_registered,
                        # GPU ranks of one process split only with HOCCL_SPLIT_CUDA
                        splits=flat and not args.no_splits and (mpi or args.backend == "host"),
                        rings=flat and not args.no_rings,
                        grouped_collectives=flat and not args.no_grouped_collectives,
                        streams=flat and not args.no_streams, scales=flat and not args.no_scales,
                        late=not args.no_late)
    if mpi:
        from mpi4py import MPI
        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    else:
        rank, size = 0, args.ranks
    if rank == 0:
        print(f"hoccl fuzz: seed {seed}, {size} ranks "
              f"({'one a process' if mpi else 'init_local'}), {args.calls} calls per rank; "
              f"replay: {replay_command(seed, size, args.calls, settings, mpi, args.backend)}",
              flush=True)
    init = {"backend": args.backend, "timeout": args.timeout}
    if mpi:
        report = run_process(seed, args.calls, settings, fault=args.fault, **init)
        label = f"rank {rank} of {size}"
    else:
        report = run_local(size, seed, args.calls, settings, fault=args.fault, **init)
        label = f"{size} ranks"
    for line in summary(report, label):
        print(line, flush=True)
    if args.dump_stacks_after > 0:
        import faulthandler
        faulthandler.cancel_dump_traceback_later()
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
