"""``simulate``: run a plan on numpy arrays.  The oracle every backend is tested against.

Steps run one at a time, in an order the plan allows: lanes are FIFO queues, a
``Wait`` runs once its slot has reached the value, an ``After`` once its mark was
recorded.  ``seed`` picks a random legal order at every step (a different
interleaving per seed); without it lanes are served round-robin.  A plan that
cannot finish (a ``Wait`` that no ``Signal`` releases) raises ``PlanError``.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence

import numpy as np

from .._dtypes import numpy_dtype, reduce_arrays
from .._errors import PlanError
from .plan import After, BufRef, Copy, Mark, Plan, Reduce, Signal, Wait

__all__ = ["simulate", "SCRATCH_FILL"]

#: the byte scratch buffers start filled with, so that reading unwritten scratch shows
SCRATCH_FILL = 0xA5


def _bytes_of(array: np.ndarray) -> np.ndarray:
    if not array.flags.c_contiguous:
        raise ValueError("simulate: arrays must be C-contiguous")
    return array.reshape(-1).view(np.uint8)


def simulate(plan: Plan, arrays: Sequence[Dict[str, np.ndarray]], *,
             seed: Optional[int] = None) -> List[Dict[str, np.ndarray]]:
    """Run ``plan`` on ``arrays`` (per rank, buffer name -> array) in place and return them.

    Buffers the plan needs but ``arrays`` lacks (scratch) are created, poisoned.
    """
    memory: List[Dict[str, np.ndarray]] = []
    for rank in range(plan.world_size):
        given = dict(arrays[rank]) if rank < len(arrays) else {}
        views = {}
        for spec in plan.buffers[rank]:
            if spec.name not in given:
                given[spec.name] = np.full(spec.nbytes, SCRATCH_FILL, dtype=np.uint8)
            view = _bytes_of(given[spec.name])
            if view.size < spec.nbytes:
                raise ValueError(f"simulate: rank {rank} buffer {spec.name!r} has {view.size} "
                                 f"bytes, the plan needs {spec.nbytes}")
            views[spec.name] = view
        memory.append(views)
        if rank < len(arrays):
            arrays[rank].update({k: v for k, v in given.items() if k not in arrays[rank]})

    def region(ref: BufRef, nbytes: int) -> np.ndarray:
        return memory[ref.rank][ref.buffer][ref.offset:ref.offset + nbytes]

    queues: Dict[tuple, List] = {}
    for rank, program in enumerate(plan.programs):
        for step in program:
            queues.setdefault((rank, step.lane), []).append(step)
    heads = {key: 0 for key in queues}
    pads: Dict[tuple, int] = {}
    marks = set()
    chooser = random.Random(seed) if seed is not None else None

    def runnable(key) -> bool:
        rank, _ = key
        step = queues[key][heads[key]]
        if isinstance(step, Wait):
            return pads.get((rank, step.slot), 0) >= step.value
        if isinstance(step, After):
            return (rank, step.mark) in marks
        return True

    def run(key) -> None:
        rank, _ = key
        step = queues[key][heads[key]]
        heads[key] += 1
        if isinstance(step, Copy):
            region(step.dst, step.nbytes)[...] = region(step.src, step.nbytes)
        elif isinstance(step, Signal):
            slot = (step.peer, step.slot)
            pads[slot] = max(pads.get(slot, 0), step.value)
        elif isinstance(step, Mark):
            marks.add((rank, step.mark))
        elif isinstance(step, Reduce):
            dtype = numpy_dtype(step.dtype)
            nbytes = step.count * dtype.itemsize
            inputs = [region(ref, nbytes).view(dtype) for ref in step.inputs]
            result = reduce_arrays(inputs, step.op, dtype, scale=step.scale)
            region(step.output, nbytes)[...] = result.view(np.uint8)

    live = [key for key in queues if queues[key]]
    while live:
        ready = [key for key in live if runnable(key)]
        if not ready:
            stuck = {key: queues[key][heads[key]] for key in live}
            raise PlanError(f"simulate: plan {plan.collective} cannot finish; blocked steps: {stuck}")
        if chooser is None:
            for key in ready:
                if runnable(key):
                    run(key)
        else:
            run(chooser.choice(ready))
        live = [key for key in live if heads[key] < len(queues[key])]
    return list(arrays)
