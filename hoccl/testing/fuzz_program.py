"""The fuzzer's programs: random calls drawn from a seed alone (``program``), the same on
every process, and what a program covers (``coverage``).  ``hoccl.testing.fuzz`` runs
them."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Counter, List, Optional, Sequence, Tuple

import numpy as np

from .._dtypes import NAMES, numpy_dtype
from . import IN_PLACE_FORMS

__all__ = ["Settings", "Call", "Step", "program", "coverage", "COLLECTIVES", "ROOTED",
           "REDUCING", "OPS", "SCALES", "SLAB_BYTES"]


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
               "reduce", "gather", "scatter")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("reduce_scatter", "all_reduce", "reduce")
OPS = ("sum", "prod", "max", "min", "avg")
#: factors of a float sum's ``scale``: powers of two, and 3 (the product rounds)
SCALES = (0.5, 0.25, 3.0)
#: bytes of the registered slab of each communicator (a call that does not fit uses
#: plain buffers)
SLAB_BYTES = 4 << 20
_ALIGN = 256


def _dtypes() -> Tuple[str, ...]:
    """hoccl's dtypes that numpy can hold here (bfloat16 needs ml_dtypes)."""
    found = []
    for name in NAMES:
        try:
            numpy_dtype(name)
        except (ImportError, TypeError):
            continue
        found.append(name)
    return tuple(found)


@dataclass(frozen=True)
class Settings:
    """What ``program`` draws from."""
    max_count: int = 1 << 16
    dtypes: Tuple[str, ...] = field(default_factory=_dtypes)
    registered: bool = True
    splits: bool = True
    #: send/recv rings (inside ``hoccl.group()``)
    rings: bool = True
    #: calls on streams of the ranks' own, and sums with a ``scale``
    streams: bool = True
    scales: bool = True
    #: several collectives (and rings) inside one ``hoccl.group()``; off: groups hold rings
    grouped_collectives: bool = True
    #: under mpiexec, a rank late to the calls of some steps (``Runner``), so that its
    #: peers' calls and messages run ahead of its own; no effect on ranks of one process
    late: bool = True

    def flags(self) -> List[str]:
        """The command-line flags that give these settings."""
        default = Settings()
        flags = [] if self.max_count == default.max_count else [f"--max-count {self.max_count}"]
        if self.dtypes != default.dtypes:
            flags.append(f"--dtypes {','.join(self.dtypes)}")
        flags += [flag for flag, on in (("--no-registered", not self.registered),
                                        ("--no-splits", not self.splits),
                                        ("--no-rings", not self.rings),
                                        ("--no-streams", not self.streams),
                                        ("--no-scales", not self.scales),
                                        ("--no-grouped-collectives",
                                         not self.grouped_collectives),
                                        ("--no-late", not self.late))
                  if on]
        return flags


@dataclass(frozen=True)
class Call:
    """One call of every rank.  ``collective``: a collective's name, ``"ring"`` (every rank
    sends to rank + ``root``, receives from rank - ``root``) or ``"barrier"``."""
    collective: str
    dtype: str = "float32"
    count: int = 0
    op: str = "sum"
    root: int = 0
    in_place: bool = False
    registered: bool = False
    scale: Optional[float] = None
    #: 0: ``stream=None``; 1 or 2: one of two streams each rank made for the run
    stream: int = 0

    def describe(self) -> str:
        on = f" stream={self.stream}" if self.stream else ""
        if self.collective == "barrier":
            return "barrier" + on
        text = f"{self.collective} {self.dtype} count={self.count}"
        if self.collective == "ring":
            return f"{text} shift={self.root}{' registered' if self.registered else ''}{on}"
        if self.collective in REDUCING:
            text += f" op={self.op}" + (f" scale={self.scale}" if self.scale is not None else "")
        if self.collective in ROOTED:
            text += f" root={self.root}"
        return (text + (" in_place" if self.in_place else "")
                + (" registered" if self.registered else "") + on)

    @property
    def calls_per_rank(self) -> int:
        return 2 if self.collective == "ring" else 1


@dataclass(frozen=True)
class Step:
    """Calls made together: one after another, or inside one ``hoccl.group()``
    (``grouped``); with ``colors`` (one per rank), on the communicators a split of them
    makes, each color's ranks making the calls in their own world."""
    calls: Tuple[Call, ...]
    grouped: bool = False
    colors: Optional[Tuple[int, ...]] = None

    def describe(self) -> str:
        calls = "; ".join(call.describe() for call in self.calls)
        if self.colors is not None:
            return f"split colors={list(self.colors)}: {calls}"
        return f"group({calls})" if self.grouped else calls


def _count(rng: np.random.Generator, max_count: int) -> int:
    """0 now and then, mostly small, sometimes up to ``max_count``."""
    tier = rng.random()
    if tier < 0.05:
        return 0
    top = (16 if tier < 0.45 else 1024 if tier < 0.8 else 1 << 14 if tier < 0.95
           else max_count)
    return int(rng.integers(1, max(2, min(top, max_count) + 1)))


def _collective(rng: np.random.Generator, world_size: int, settings: Settings,
                registered: bool) -> Call:
    collective = COLLECTIVES[int(rng.integers(len(COLLECTIVES)))]
    dtype = settings.dtypes[int(rng.integers(len(settings.dtypes)))]
    op, scale = "sum", None
    if collective in REDUCING:
        op = OPS[int(rng.integers(len(OPS)))]
        if (settings.scales and op == "sum" and dtype.startswith(("float", "bfloat"))
                and rng.random() < 0.5):
            scale = SCALES[int(rng.integers(len(SCALES)))]
    count = _count(rng, settings.max_count)
    return Call(collective, dtype, count, op,
                root=int(rng.integers(world_size)) if collective in ROOTED else 0,
                in_place=bool(rng.random() < 0.4) and count > 0 and collective in IN_PLACE_FORMS,
                registered=registered and settings.registered and bool(rng.random() < 0.3),
                scale=scale, stream=_stream(rng, settings))


def _ring(rng: np.random.Generator, world_size: int, settings: Settings) -> Call:
    dtype = settings.dtypes[int(rng.integers(len(settings.dtypes)))]
    return Call("ring", dtype, _count(rng, settings.max_count),
                root=int(rng.integers(1, world_size)),
                registered=settings.registered and bool(rng.random() < 0.3),
                stream=_stream(rng, settings))


def _stream(rng: np.random.Generator, settings: Settings) -> int:
    return 0 if not settings.streams or rng.random() < 0.6 else int(rng.integers(1, 3))


def program(seed: int, world_size: int, calls: int, settings: Settings = Settings()
            ) -> List[Step]:
    """Steps of at least ``calls`` calls per rank (a ring is two: a send and a recv), drawn
    from ``seed`` alone."""
    rng = np.random.default_rng(seed)
    steps: List[Step] = []
    made = 0
    while made < calls:
        kind = rng.random()
        if settings.rings and world_size > 1 and kind < 0.15:  # one or two rings a group
            rings = tuple(_ring(rng, world_size, settings)
                          for _ in range(1 + int(rng.random() < 0.3)))
            step = Step(rings, grouped=True)
        elif settings.grouped_collectives and world_size > 1 and kind < 0.3:
            members = [_collective(rng, world_size, settings, True)
                       for _ in range(int(rng.integers(2, 5)))]
            if settings.rings and rng.random() < 0.5:
                members.insert(int(rng.integers(len(members) + 1)),
                               _ring(rng, world_size, settings))
            step = Step(tuple(members), grouped=True)
        elif settings.splits and world_size > 2 and kind > 0.985:
            colors = tuple(int(c) for c in rng.integers(0, 2, world_size))
            smallest = min(colors.count(color) for color in set(colors))
            members = [_collective(rng, smallest, settings, False)
                       for _ in range(int(rng.integers(1, 4)))]
            step = Step(tuple(members), colors=colors)
        elif kind > 0.965:
            step = Step((Call("barrier", stream=_stream(rng, settings)),))
        else:
            step = Step((_collective(rng, world_size, settings, True),))
        steps.append(step)
        made += sum(call.calls_per_rank for call in step.calls)
    return steps


def coverage(steps: Sequence[Step]) -> Counter:
    """How many calls of each kind ``steps`` hold: by collective ("ring", "barrier"
    too), dtype, op, form, and "registered", "scale", "grouped", "grouped collective",
    "split", "count 0", "count > 16384", "own stream"."""
    found: Counter = collections.Counter()
    for step in steps:
        for call in step.calls:
            found[call.collective] += 1
            if call.collective == "barrier":
                continue
            found[f"dtype {call.dtype}"] += 1
            found[f"op {call.op}"] += call.collective in REDUCING
            found["in place" if call.in_place else "out of place"] += call.collective != "ring"
            found["registered"] += call.registered
            found["scale"] += call.scale is not None
            found["grouped"] += step.grouped
            found["grouped collective"] += step.grouped and call.collective != "ring"
            found["split"] += step.colors is not None
            found["count 0"] += call.count == 0
            found["count > 16384"] += call.count > 1 << 14
            found["own stream"] += call.stream > 0
    return found
