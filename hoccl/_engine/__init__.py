"""The engine: one per rank, everything a call needs below the public API.

A call flows one way::

    Communicator (API, checks)  ──►  Engine.prepare   the PreparedCall, from the one cache
                                                      or made now (plan from the selector,
                                                      addresses, what the peers are told)
                                ──►  Engine.enqueue   number it, mark (and in one process
                                                      fence) the caller's stream
                                ──►  Group            match it with the peers' calls
                                ──►  Engine.issue     one pass down: the engine's own work,
                                                      then Executor → StreamManager / Device

* ``prepare`` (``prepared.Preparer``): everything that can fail happens here; nothing
  is enqueued.  A repeated call (same shape, same buffers) takes its ``PreparedCall``
  from the cache (``prepared.CallCache``, the engine's only cache; its policy is stated
  in ``prepared``).
* ``enqueue``: number it and mark the caller's position (``StreamManager.fence_in``); in
  one process (the call is held until every rank made it) also fence the caller's
  stream: from then on, its later work waits for the call's completion value.  Across
  processes the fence comes in ``issue``, once the peers' buffers are mapped (mapping may
  synchronize the context, which must not happen while a caller waits for the call).
* ``issue``: with the peers' buffers known (from the group), check every byte the plan
  touches in a peer's buffer lies inside what that peer registered (once per prepared
  call and peers), then hand the bound program to the executor.  ``release`` completes
  a call unrun instead (a mismatch, a close).

The engine never calls the group or the API; the health monitor (``hoccl._health``)
reads its state and aborts it.  Modules: ``signals`` (the pad), ``calls`` (a call),
``memory`` (scratch, ring, the shared device), ``prepared`` (prepared calls and their
cache), ``engine`` (numbering, fencing, issuing, teardown).
"""

from .calls import Call, PeerBuffer, digest
from .engine import Engine
from .memory import DeviceShare
from .prepared import PREPARED_CALLS, CallCache, PreparedCall, ShapePlan
from .signals import ABORT_VALUE, SignalPad

__all__ = ["ABORT_VALUE", "SignalPad", "Call", "PreparedCall", "ShapePlan", "CallCache",
           "PREPARED_CALLS", "Engine", "PeerBuffer", "DeviceShare", "digest"]
