"""A repeated call replayed: its command list submitted again with patched values.

The first call of a shape on some buffers is prepared, matched and issued in full
(``Engine.submit``); where its repeats need nothing of that again, the engine keeps a
``Replay`` of it (``Engine.replayable``).  A repeat then goes from the public call to
``Engine.replay``: no argument is resolved (``hoccl._repeats``), no prepared call looked
up, no plan bound and no message awaited.  It takes the next number and signal base
of its sequence, and submits the bound program (its command list: memory operations,
copies, launches, every address resolved) on the caller's stream with the values that
change patched in (the signal base, the completion value, the wait for the previous
call where the stream is not yet ordered after it).  A world of one's call with no step
(in place, unscaled) has an empty command list: its repeats submit nothing.

What may be replayed, stated once: an eager call (not captured, not in a
``hoccl.group()``) of a communicator whose peers live in other processes (``hoccl.init``),
bound for peers' buffers this rank knows without asking (none: world 1; registered
windows; the direct kernels' rings), on the caller's stream it was built on.  One that
runs on its caller's stream (one lane, or a direct kernel) is the shortest: its steps
and completion go on that stream; one on the lanes is fenced and issued there.  A call
with peers still offers itself to them as every call issued without asking does (its
description folded, ``hoccl._groups.folds``): a mismatch is found by the same checks,
within the same timeout, on every rank.  A replay is dropped when what it was built from changes:
the engine's memory layout (``Engine.layout_epoch`` past its prepared call's
``epoch``), its prepared calls (options,
tuning: ``CallCache.generation``), the caller's stream, or the communicator's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .calls import PreparedCall

__all__ = ["Replay"]


@dataclass(eq=False, slots=True)
class Replay:
    """What a repeat of one call needs: the public call's name, its prepared call (plan,
    signature, bound program), the caller's stream it runs on (by ``stream_key``), and
    what it was built from (``valid``)."""
    name: str
    prepared: PreparedCall
    caller_key: Any
    #: the cache's generation when it was built (the layout's is its prepared call's epoch)
    generation: int
    #: its peers are offered each call (folded): the group's ``post``
    offers: bool
    #: it runs on its caller's stream (``Executor.issue_on_caller``), else on the lanes
    on_caller: bool

    def valid(self, layout_epoch: int, generation: int) -> bool:
        """Whether nothing it was built from has changed since."""
        prepared = self.prepared
        return (prepared.epoch == layout_epoch and self.generation == generation
                and prepared.program is not None
                # still bound for the peers' buffers told without asking (a call that
                # asked may have bound it for what its peers described since)
                and (not self.offers or prepared.bound_to is prepared.fast))
