"""The collective scheduler: pure Python, no CUDA, no I/O.

``build_plan(shape, options)`` turns a collective's shape into a ``Plan``;
``verify(plan)`` proves it safe over every ordering it allows; ``simulate(plan,
arrays)`` runs it on numpy arrays and is the oracle the backends are tested against.
"""

from .algorithms import COLLECTIVES, Options, Shape, build_plan, split
from .plan import (After, BufferSpec, BufRef, Copy, Mark, Plan, Reduce, Signal, Step, Wait)
from .simulate import SCRATCH_FILL, simulate
from .verify import verify

__all__ = ["COLLECTIVES", "Options", "Shape", "build_plan", "split",
           "After", "BufferSpec", "BufRef", "Copy", "Mark", "Plan", "Reduce", "Signal",
           "Step", "Wait", "simulate", "SCRATCH_FILL", "verify"]
