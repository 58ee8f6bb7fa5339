"""Calls repeated on arrays that resolve alike: their checks are made once.

A public call's arguments decide everything its checks find (the buffers' addresses,
counts, dtypes and devices, in place or not, the op, root, peer and scale): given the
same arguments again, the same checks pass and describe the same call.  So the first
call of an argument list is checked in full (``hoccl._api``), and what the checks made of
it (the call's ``Shape`` and its buffers by role) is kept under a key read cheaply from
the arguments (``key``: ``hoccl._buffers.repeat_key`` for each array, the value itself
for an op, a root or a scale).  A later call whose arguments have the same key takes that
shape and those buffers, on its own arrays, and goes straight to the communicator's
``_run``: no array is resolved again.  A torch tensor from the caching allocator at the
same address, of the same size and dtype, is a repeat, as a registered buffer is.

What a key cannot tell is left to the full checks: arrays that are not numpy arrays,
torch tensors or cupy arrays, and torch tensors that require grad (grad mode decides
their verdict).
The stream is not part of the key: every call resolves its own (``_run``).

The cache holds at most ``REPEATS`` argument lists a communicator, the oldest going first.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ._buffers import Buffer, repeat_key
from .sched import Shape

__all__ = ["REPEATS", "Repeats"]

#: the most argument lists a communicator keeps (``Repeats``)
REPEATS = 1024

#: values that key as themselves (an op's name, a root, a scale, an absent buffer)
_PLAIN = (str, int, float, type(None))


class Repeats:
    """One communicator's checked calls, by the key of their arguments."""

    def __init__(self, size: int = REPEATS):
        self.size = size
        #: key -> (shape, ((buffer name, (address, count, dtype, device), where its array is
        #: among the arguments)))
        self._entries: Dict[tuple, Tuple[Shape, tuple]] = {}
        #: (key, args, kwargs) of the call being checked now (``remember`` keeps what its
        #: checks made of it)
        self.pending: Optional[Tuple[tuple, tuple, Dict[str, Any]]] = None
        self.hits = 0  # calls that took their checks from here
        #: key -> what a communicator keeps to replay the call (``hoccl._engine.replay``)
        self.replays: Dict[tuple, Any] = {}
        #: the key of the call running now (None: its arguments cannot be keyed)
        self.current: Optional[tuple] = None

    @staticmethod
    def key(name: str, args: tuple, kwargs: Dict[str, Any]) -> Optional[tuple]:
        """The key of a call's arguments (``stream`` aside), or None if one of them cannot be
        keyed cheaply."""
        parts: list = [name]
        last: Any = None  # an array given twice in a row (in place) is keyed once
        for value in args:
            if isinstance(value, _PLAIN):
                parts.append((type(value), value))
                last = None
            else:
                found = parts[-1] if value is last else repeat_key(value)
                if found is None:
                    return None
                last = value
                parts.append(found)
        for argument, value in kwargs.items():
            if argument == "stream":
                continue
            if isinstance(value, _PLAIN):
                parts.append((argument, type(value), value))
            else:
                found = repeat_key(value)
                if found is None:
                    return None
                parts.append((argument, found))
        return tuple(parts)

    def remember(self, shape: Shape, buffers: Dict[str, Optional[Buffer]]) -> None:
        """Keep what the checks of the pending call made of it; each buffer is found again
        among its arguments as its ``owner``."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        key, args, kwargs = pending
        roles: list = []
        for role, buffer in buffers.items():
            if buffer is None:
                roles.append((role, None, None))
                continue
            where = _where(buffer.owner, args, kwargs)
            if where is None:  # not one of the arguments: resolve every time
                return
            # the numbers only: an entry must not keep the first call's array alive
            roles.append((role, (buffer.address, buffer.count, buffer.dtype, buffer.device),
                          where))
        if len(self._entries) >= self.size:
            gone = next(iter(self._entries))
            del self._entries[gone]
            self.replays.pop(gone, None)
        self._entries[key] = (shape, tuple(roles))

    def take(self, key: tuple, args: tuple, kwargs: Dict[str, Any]
             ) -> Optional[Tuple[Shape, Dict[str, Optional[Buffer]]]]:
        """The shape and buffers (on this call's arrays) of a call checked before under
        ``key``, or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        shape, roles = entry
        buffers: Dict[str, Optional[Buffer]] = {}
        for role, buffer, where in roles:
            if buffer is None:
                buffers[role] = None
            else:
                array = args[where] if isinstance(where, int) else kwargs[where]
                address, count, dtype, device = buffer
                buffers[role] = Buffer(address, count, dtype, device, array)
        self.hits += 1
        return shape, buffers

    def keep_replay(self, replay: Any) -> None:
        """Keep ``replay`` for the later calls of the current call's arguments."""
        key = self.current
        if key is None or key not in self._entries:
            return
        if key not in self.replays and len(self.replays) >= self.size:
            del self.replays[next(iter(self.replays))]
        self.replays[key] = replay

    def clear(self) -> None:
        self._entries.clear()
        self.replays.clear()


def _where(array: Any, args: tuple, kwargs: Dict[str, Any]) -> Any:
    """The position (or keyword) of ``array`` among a call's arguments, or None."""
    for index, value in enumerate(args):
        if value is array:
            return index
    for argument, value in kwargs.items():
        if value is array:
            return argument
    return None
