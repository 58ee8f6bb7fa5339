"""Sends and receives inside ``hoccl.group()`` on a communicator across hosts.

A send or receive made inside a group is held (``HeldPair``, after the argument checks
of any call) until the outermost ``group_end``, which hands the communicator's held
pairs to its ``PairGroup``; the batch then runs as one batch per level, each on its
level's engine (``InterHostEngine.batch``)::

    held:     send(a, 1)  recv(b, 3)  send(c, 2)  recv(d, 1)     (rank 0; hosts of 2)
    host:     batch[send(a, 1), recv(d, 1)]  on the engine inside the host
    world:    batch[recv(b, 3), send(c, 2)]  on the engine over every rank

The levels run side by side (one worker each, ``PhaseRunner.pipelined``) and every
engine posts a batch's pairs before it waits for any, so no batch waits in a cycle:
not one that sends to and receives from the same peer, nor a ring in either direction,
nor ranks that batch the same pairs differently.  A pair of ranks on one host still
moves its bytes on that host's engine, one along a rail on the rail engine.

The calls of one group on one communicator take one stream (or None on the host
backend): the batch is ordered after the work on it so far, and the work enqueued on it
later after the batch.  A pair left unmatched ends in the engines' timeout, which names
this rank and the peers of the batch with their hosts; the communicator is then aborted,
as after any step across hosts left in flight.  Collectives are not held: inside a
group a communicator across hosts refuses them at once.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

__all__ = ["HeldPair", "PairGroup"]


class HeldPair:
    """A send (``kind="send"``) or receive of ``array`` with ``peer`` made inside a group,
    on ``stream`` (the caller's argument).  ``signature`` is set when the group's body
    raised (``hoccl.group()`` abandons what it held): the pair is then not run."""

    __slots__ = ("kind", "array", "peer", "stream", "signature")

    def __init__(self, kind: str, array: Any, peer: int, stream: Any):
        self.kind, self.array, self.peer, self.stream = kind, array, peer, stream
        self.signature: Optional[Tuple[Any, ...]] = None

    def __repr__(self) -> str:
        return f"{self.kind} with rank {self.peer}"


class PairGroup:
    """What ``hoccl.group()`` hands a communicator's held calls to (its ``post`` for
    every communicator of the group, then its ``complete``): ``post`` starts nothing,
    ``complete`` runs the pairs not abandoned as one batch (``run``).  ``exported``:
    the batch orders itself on the caller's stream, with no fence of the group's."""

    exported = True

    def __init__(self, run: Callable[[List[HeldPair]], None]):
        self._run = run

    def post(self, calls: List[HeldPair]) -> None:
        """Nothing to start before ``complete``: the batch goes out whole."""

    def complete(self, calls: List[HeldPair]) -> None:
        self._run([call for call in calls if call.signature is None])
