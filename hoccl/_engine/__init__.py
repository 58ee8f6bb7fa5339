"""The engine: one per rank, everything a call needs below the public API.

A call flows one way, driven from one place (``Engine.submit``)::

    Communicator (API, checks)  ──►  Engine.prepare   the PreparedCall, from the one cache
                                                      or made now (plan from the selector,
                                                      addresses, what the peers are told)
                                ──►  Engine.submit    the one place that drives the call:
                                ──►  Engine.enqueue   number it, mark (and in one process
                                                      fence) the caller's stream
                                ──►  Group            match it with the peers' calls
                                                      (``calls.Matcher``, attached by the
                                                      Communicator)
                                ──►  Engine.issue     one pass down: the engine's own work,
                                                      then Executor → StreamManager / Device

* ``prepare`` (``prepared.Preparer``): everything that can fail happens here; nothing
  is enqueued.  A repeated call (same shape, same buffers) takes its ``PreparedCall``
  from the cache (``prepared.CallCache``, the engine's only cache; its policy is stated
  in ``prepared``).
* ``submit``: where the call's steps run (on its caller's stream, or on lanes), then
  ``enqueue``, then the group's ``post`` and ``complete``, which end in ``issue`` or
  ``release``; inside ``hoccl.group()`` only ``enqueue`` (the group's end offers and
  matches its calls).  A failure that leaves nothing to match aborts the communicator
  (through what the Communicator attached).  One place: a repeated call's shortcut
  belongs here.
* ``enqueue``: number it and mark the caller's position (``StreamManager.fence_in``); in
  one process (the call is held until every rank made it) also fence the caller's
  stream: from then on, its later work waits for the call's completion value.  Across
  processes the fence comes in ``issue``, once the peers' buffers are mapped (mapping may
  synchronize the context, which must not happen while a caller waits for the call).
* ``replay`` (``replay.Replay``): a repeat of a call whose peers' buffers are known
  without asking, on the same caller's stream, skips ``prepare`` and the matching: the
  Communicator hands it from the public call (its arguments keyed, ``hoccl._repeats``)
  to ``Engine.replay``, which numbers it, offers it to the group (folded) and ends in
  ``issue`` or ``issue_on_caller`` with the bound program.
* ``issue``: with the peers' buffers known (from the group), check every byte the plan
  touches in a peer's buffer lies inside what that peer registered (once per prepared
  call and peers), then hand the bound program to the executor.  ``release`` completes
  a call unrun instead (a mismatch, a close).

The engine calls its group only through ``Matcher`` (``post``, ``complete``) and never
the monitor or the API; the group, the health monitor (``hoccl._health``) and the
builder change its state only through its methods.  Modules: ``signals`` (the pad),
``calls`` (a call, its prepared part, and the interfaces ``Matcher`` and ``CallEngine``),
``memory`` (scratch, ring, the shared device), ``prepared`` (the preparer and its
cache), ``sequences`` (matching keys, signal bases), ``inflight`` (the calls in
flight), ``order`` (what callers' streams and lanes are ordered after), ``replay`` (a
repeat's record), ``issue`` (the issue stage), ``engine`` (submitting, replaying,
numbering, fencing, state, teardown).
"""

from .calls import (ABANDONED, Call, CallEngine, Matcher, PeerBuffer, PreparedCall, ShapePlan,
                    digest)
from .engine import Engine
from .memory import DeviceShare
from .prepared import PREPARED_CALLS, CallCache
from .signals import ABORT_VALUE, SignalPad

__all__ = ["ABORT_VALUE", "SignalPad", "Call", "PreparedCall", "ShapePlan", "CallCache",
           "PREPARED_CALLS", "Engine", "CallEngine", "Matcher", "PeerBuffer", "DeviceShare",
           "digest", "ABANDONED"]
