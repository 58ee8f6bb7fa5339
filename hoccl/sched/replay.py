"""Plans replayed from a CUDA graph: signals that reset, checked.

An eager call's signals carry values that grow from call to call (the communicator's
running base), so a wait can never be released by an older call.  A graph bakes every
value in at capture, so a replayed call signals the same values every time.  A call
captured into a graph therefore runs on a pad region of its own (the graph slots) with
the plan's own small values, and each rank puts a slot back to 0 right after its last
wait on it in the call (``last_waits``), on the same lane.

That is safe when no write of the *next* call can reach the slot before the reset.  For
every slot ``s`` that rank ``p`` writes in rank ``r``'s pad, ``replay_problem`` proves
one of:

* (a) ``p`` makes each of its writes into ``s`` after waiting for a signal from ``r``
  (earlier on the same lane, or on a lane it follows through a ``Mark``/``After``): in
  the next call, that signal comes only after ``r`` finished this call, resets included;
* (b) after its last wait on ``s``, ``r`` signals ``p`` on the same lane, and ``p``
  waits for that signal: ``p`` finishes this call, and so starts the next, only after
  the reset.

It also needs ``r``'s waits on ``s`` on one lane, the last for the largest value ``p``
writes there (no wait of this call comes after the reset, no write of it lands after).  The collectives whose every rank
exchanges data with every peer pass (all_gather, all_to_all, reduce_scatter,
all_reduce); a barrier does not (a rank's READY for the next barrier may overtake the
peer's reset), nor do rooted collectives whose root finishes without hearing back.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .plan import CHANNELS, After, Mark, Plan, Signal, Wait

__all__ = ["last_waits", "replay_problem"]

_PROBLEMS: Dict[int, Tuple[Plan, Optional[str]]] = {}


def last_waits(plan: Plan, rank: int) -> Dict[int, int]:
    """slot -> index in ``rank``'s program of its last wait on that slot."""
    last: Dict[int, int] = {}
    for index, step in enumerate(plan.programs[rank]):
        if isinstance(step, Wait):
            last[step.slot] = index
    return last


def replay_problem(plan: Plan) -> Optional[str]:
    """Why ``plan`` cannot be replayed from a graph with resetting signals, or None.
    Cached per plan object."""
    cached = _PROBLEMS.get(id(plan))
    if cached is not None and cached[0] is plan:
        return cached[1]
    problem = _problem(plan)
    if len(_PROBLEMS) > 1024:
        _PROBLEMS.clear()
    _PROBLEMS[id(plan)] = (plan, problem)
    return problem


def _problem(plan: Plan) -> Optional[str]:
    if plan.kernel_blocks:
        return None  # a direct kernel's values carry the device's epoch: nothing resets
    programs = plan.programs
    # writes[(writer, receiver, slot)] = [(index, lane, value)]
    writes: Dict[Tuple[int, int, int], List[Tuple[int, int, int]]] = {}
    for writer, program in enumerate(programs):
        for index, step in enumerate(program):
            if isinstance(step, Signal):
                writes.setdefault((writer, step.peer, step.slot), []).append(
                    (index, step.lane, step.value))
    heard = [_heard_before(program) for program in programs]
    for (writer, receiver, slot), signals in writes.items():
        name = f"{plan.collective}: rank {writer}'s signal into rank {receiver}'s slot {slot}"
        waits = [(index, step) for index, step in enumerate(programs[receiver])
                 if isinstance(step, Wait) and step.slot == slot]
        if not waits:
            return f"{name} is never waited for, so it could not be reset"
        last_index, last = waits[-1]
        if any(step.lane != last.lane for _, step in waits):
            return (f"{name} is waited for on several lanes: a reset after the last wait "
                    f"could come before another lane's wait")
        if last.value != max(value for _, _, value in signals) or any(
                step.value > last.value for _, step in waits):
            return f"{name}: the last wait is not for the largest value written"
        if all(receiver in heard[writer][index] for index, _, _ in signals):
            continue  # (a)
        if _answered(programs, receiver, writer, last_index, last.lane):
            continue  # (b)
        return (f"{name}: the writer may signal it again in the next call before rank "
                f"{receiver} has reset it")
    return None


def _heard_before(program) -> List[frozenset]:
    """For each step of ``program``: the ranks whose signals it follows (a wait for one
    earlier on its lane, or on a lane it follows through ``Mark``/``After``)."""
    lanes: Dict[int, frozenset] = {}
    marks: Dict[int, frozenset] = {}
    heard: List[frozenset] = []
    for step in program:
        known = lanes.get(step.lane, frozenset())
        if isinstance(step, Wait):
            known = known | {step.slot // CHANNELS}
        elif isinstance(step, Mark):
            marks[step.mark] = known
        elif isinstance(step, After):
            known = known | marks.get(step.mark, frozenset())
        lanes[step.lane] = known
        heard.append(known)
    return heard


def _answered(programs, receiver: int, writer: int, after: int, lane: int) -> bool:
    """Whether ``receiver`` signals ``writer`` on ``lane`` after its step ``after``, with a
    value that one of ``writer``'s waits needs."""
    for step in programs[receiver][after + 1:]:
        if isinstance(step, Signal) and step.lane == lane and step.peer == writer:
            if any(isinstance(wait, Wait) and wait.slot == step.slot and wait.value <= step.value
                   for wait in programs[writer]):
                return True
    return False
