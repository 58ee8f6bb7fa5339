"""Plans: what every rank does for one collective, as plain data.

A plan is built by an algorithm (``hoccl.sched.algorithms``) from the collective's
shape alone, so every rank builds the same plan and can reason about its peers'
steps.  Each rank runs a *program*: an ordered tuple of steps, each on a *lane*
(one copy stream of that rank).  Steps on one lane run in program order; steps on
different lanes are unordered unless joined by ``Mark``/``After`` or, across ranks,
by ``Signal``/``Wait`` on signal pads.

Buffers are named per rank (``"send"``, ``"recv"``, ``"scratch"``) and addressed by
byte offset; a ``BufferSpec`` says which bytes hold input on entry and which bytes
must hold output on exit.  In-place forms use one buffer name, so a plan never has
two names for the same memory.

Signal values are small integers relative to the collective: the executor adds the
communicator's running base, so values grow monotonically across collectives and a
``Wait`` for ``value`` (``>=``) can never be released by an older collective.

Every rank's program is implicitly preceded by an *entry fence* (its lanes start
after the caller's stream reaches the call) and followed by an *exit fence* (the
caller's stream continues after all its lanes end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

__all__ = ["BufRef", "Copy", "Signal", "Wait", "Reduce", "Mark", "After", "Step",
           "BufferSpec", "Plan", "READY", "DONE", "GATHERED", "PAIR_READY", "PAIR_DONE",
           "CHANNELS", "CHANNEL_NAMES", "OPS", "RING"]

# Signal channels: a pad slot is ``sender * CHANNELS + channel`` in the receiver's pad, so
# every slot has exactly one writer (one rank, one lane) and its values only grow.
READY = 0      # "my buffers are free: you may write into them / read from them"
DONE = 1       # "my copies into (or reads of) your buffers have finished", value = chunk + 1
GATHERED = 2   # second data phase (all_reduce's gather), value = chunk + 1
PAIR_READY = 3  # send/recv: the receiver's buffer is free (own per-pair sequence)
PAIR_DONE = 4   # send/recv: the sender's copy has landed
CHANNELS = 5
CHANNEL_NAMES = ("READY", "DONE", "GATHERED", "PAIR_READY", "PAIR_DONE")

#: A direct kernel's staging buffer (``algorithms._direct``): its peers store into it
#: without waiting for its READY.  It has two halves, and each call uses the half of its
#: direct-kernel epoch's parity (the executor adds the offset on the device), as do the
#: signature words beside each signal word, so a peer that is one call ahead writes the
#: other half.  No peer can be two calls ahead: in every direct call each rank's last step
#: follows, through signals, the first step of every other rank, so a rank that finished
#: call e+1 knows that every rank finished call e (the ranks' direct kernels run one at a
#: time).  Every rank, not only the ones it stores into: the next call may store into any
#: peer's ring.  ``verify`` checks that rule for every plan with a ring, and exempts the
#: ring from the READY rule (that argument spans calls); every other rule holds.
RING = "ring"

#: The reduction operators a ``Reduce`` step may name, which every backend computes:
#: "avg" is the sum divided by the number of inputs.  The one list of them in hoccl.
OPS = ("sum", "prod", "max", "min", "avg")


@dataclass(frozen=True, order=True)
class BufRef:
    """A byte address: ``offset`` bytes into ``rank``'s buffer ``buffer``."""
    rank: int
    buffer: str
    offset: int


@dataclass(frozen=True)
class Copy:
    """One DMA of ``nbytes`` from ``src`` to ``dst``, issued on ``lane`` of the running rank."""
    lane: int
    src: BufRef
    dst: BufRef
    nbytes: int


@dataclass(frozen=True)
class Signal:
    """Write ``value`` into slot ``slot`` of ``peer``'s signal pad, after the lane's earlier steps."""
    lane: int
    peer: int
    slot: int
    value: int


@dataclass(frozen=True)
class Wait:
    """Block ``lane`` until slot ``slot`` of the running rank's own pad is ``>= value``."""
    lane: int
    slot: int
    value: int


@dataclass(frozen=True)
class Reduce:
    """``output[i] = op(inputs[0][i], inputs[1][i], ...)`` for ``count`` elements of ``dtype``
    (with ``scale``, a sum: ``scale * sum(...)``, multiplied before the one rounding).

    The only step that uses SMs.  Inputs and output live on the running rank; the
    output may be exactly one of the inputs (element-wise in place), never a partial
    overlap.
    """
    lane: int
    inputs: Tuple[BufRef, ...]
    output: BufRef
    count: int
    dtype: str
    op: str
    scale: Optional[float] = None


@dataclass(frozen=True)
class Mark:
    """Record mark ``mark`` on ``lane`` (an event): ``After`` steps on other lanes wait for it."""
    lane: int
    mark: int


@dataclass(frozen=True)
class After:
    """Block ``lane`` until mark ``mark`` (recorded earlier in this rank's program) is reached."""
    lane: int
    mark: int


Step = Union[Copy, Signal, Wait, Reduce, Mark, After]


@dataclass(frozen=True)
class BufferSpec:
    """One named buffer of one rank.

    ``inputs`` are the byte ranges ``(start, stop)`` that hold the caller's data on
    entry; ``outputs`` the ranges the collective must write exactly once.  A scratch
    buffer has neither.
    """
    name: str
    nbytes: int
    inputs: Tuple[Tuple[int, int], ...] = ()
    outputs: Tuple[Tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Plan:
    """A whole collective: every rank's buffers and program.

    ``max_value`` is the largest signal value the plan uses; the executor advances
    the communicator's signal base by it after each collective.  ``participants``
    are the ranks that take part (all of them, except for send/recv, whose values
    count from a per-pair base instead: ``pair`` is then ``(sender, receiver)``).
    """
    collective: str
    world_size: int
    lanes: int
    buffers: Tuple[Tuple[BufferSpec, ...], ...]
    programs: Tuple[Tuple[Step, ...], ...]
    max_value: int
    participants: Tuple[int, ...]
    pair: Tuple[int, ...] = ()
    options: Tuple[Tuple[str, object], ...] = field(default=())

    def buffer(self, rank: int, name: str) -> BufferSpec:
        for spec in self.buffers[rank]:
            if spec.name == name:
                return spec
        raise KeyError(f"Plan.buffer: rank {rank} has no buffer {name!r}")

    @property
    def slots(self) -> int:
        """Pad slots a rank needs for this plan."""
        return self.world_size * CHANNELS

    @property
    def kernel_blocks(self) -> int:
        """Blocks (SMs) of the direct kernel that runs every rank's program, or 0: a plan
        whose steps each go to their own stream operation (``algorithms._direct``)."""
        for name, value in self.options:
            if name == "kernel_blocks":
                return int(value)  # type: ignore[call-overload]
        return 0

    def uses_sms(self, rank: int) -> bool:
        """True when ``rank``'s program has a step that runs on SMs (a reduction or a same-rank
        copy, or any step of a direct kernel)."""
        if self.kernel_blocks and self.programs[rank]:
            return True
        return any(isinstance(step, Reduce) or
                   (isinstance(step, Copy) and step.src.rank == step.dst.rank == rank)
                   for step in self.programs[rank])

    def shared(self, rank: int) -> Tuple[str, ...]:
        """The names of ``rank``'s buffers that other ranks' steps read or write: the only
        ones a process must export to its peers for this plan."""
        names: set = set()
        for other, program in enumerate(self.programs):
            if other == rank:
                continue
            for step in program:
                refs = ((step.src, step.dst) if isinstance(step, Copy) else
                        step.inputs + (step.output,) if isinstance(step, Reduce) else ())
                names.update(ref.buffer for ref in refs if ref.rank == rank)
        return tuple(sorted(names))

    def describe(self) -> str:
        """A human-readable listing, one step per line, for logs and debugging."""
        lines = [f"plan {self.collective} world_size={self.world_size} lanes={self.lanes} "
                 f"max_value={self.max_value} options={dict(self.options)}"]
        for rank, program in enumerate(self.programs):
            lines.append(f" rank {rank}: buffers "
                         + ", ".join(f"{b.name}[{b.nbytes}]" for b in self.buffers[rank]))
            lines.extend(f"   {step}" for step in program)
        return "\n".join(lines)
