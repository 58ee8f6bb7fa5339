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
from typing import Any, Optional

from .calls import Call, Matcher, PreparedCall, stream_key

__all__ = ["Replay", "replay_of"]


def replay_of(call: Call, rank: int, group: Optional[Matcher], generation: int
              ) -> Optional["Replay"]:
    """A ``Replay`` of ``call`` (rank ``rank``'s, just submitted alone and issued; its
    engine's ``group`` and cache ``generation``) if its repeats may be replayed (above);
    else None."""
    prepared = call.prepared
    if (call.captured or not call.issued or prepared.program is None
            or group is None or not group.exported):
        return None
    alone = call.plan.participants == (rank,)
    if not alone and (prepared.fast is None or prepared.bound_to is not prepared.fast):
        return None
    return Replay(call.name, prepared, stream_key(call.caller), generation, offers=not alone,
                  on_caller=call.on_caller)


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

    @property
    def empty(self) -> bool:
        """Nothing to move and no peer (a world of one's call in place, unscaled): its
        repeats enqueue no work at all, as NCCL's one rank enqueues none."""
        return not self.prepared.program and not self.offers

    def valid(self, layout_epoch: int, generation: int) -> bool:
        """Whether nothing it was built from has changed since."""
        prepared = self.prepared
        return (prepared.epoch == layout_epoch and self.generation == generation
                and prepared.program is not None
                # still bound for the peers' buffers told without asking (a call that
                # asked may have bound it for what its peers described since)
                and (not self.offers or prepared.bound_to is prepared.fast))
