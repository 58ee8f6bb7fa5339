"""Registered buffers (``Communicator.register``; ``hoccl.empty`` makes one,
``hoccl._arrays``): windows.

A window is a range of one rank's memory that every rank of the communicator registered
at the same point (``register`` is collective, like ``ncclCommWindowRegister``), so each
rank knows every peer's window of the same index: where it is (mapped once, at
registration) and how large.  A call whose buffers lie inside windows is then
*symmetric*: each peer's buffer is taken to be at the same offset of the peer's window
of the same index, so the call needs no descriptor exchange and no waiting on the host
for the peers' calls (``ProcessGroup.complete`` issues it at once).

What keeps that safe:

* every byte a plan touches in a peer's window is checked against the size that peer
  registered before anything is enqueued: a call on registered buffers never writes
  outside a peer's window, whatever the peers pass;
* each rank still posts its call's description; the peers check it after the fact (at
  their next call, ``synchronize``, ``deregister`` or ``close``), and a rank whose call
  differed (another size, another offset, an unregistered buffer) makes every rank raise
  ``DivergedError`` and aborts the communicator: its output is undefined, nothing beyond
  the windows was written;
* the device-side protocol is unchanged: a peer's copies into this rank's buffer wait
  for this rank's READY signal, sent when its caller's stream reached the call.

The window's array is kept alive by the registry until ``deregister``.
"""

from __future__ import annotations

import bisect
from typing import Any, Dict, List, Optional, Tuple

from ._buffers import as_buffer
from ._errors import InvalidArgumentError

__all__ = ["Window", "Windows", "WINDOW", "window_ref"]

#: the first element of a window reference ``(WINDOW, index, offset)``, the form a
#: registered buffer takes in a call's description (peers resolve it in their own table)
WINDOW = "window"


def window_ref(where: Any) -> Optional[Tuple[int, int]]:
    """(window index, offset) of a window reference, or None for any other ``where`` (an
    export descriptor, an address)."""
    if type(where) is tuple and where and where[0] == WINDOW:
        return where[1], where[2]
    return None


class Window:
    """One registered range: this rank's ``address`` and ``nbytes``, and every rank's
    window of the same index as this process addresses it (``bases``) and its size
    (``sizes``); ``bases`` is None where the peers live in this process (``init_local``:
    buffers travel by address anyway)."""

    __slots__ = ("index", "address", "nbytes", "owner", "bases", "sizes", "imports")

    def __init__(self, index: int, address: int, nbytes: int, owner: Any,
                 bases: Optional[List[Any]], sizes: Optional[List[int]]):
        #: the peers' export descriptors this rank mapped (released by deregister)
        self.imports: List[Any] = []
        self.index = index
        self.address = address
        self.nbytes = nbytes
        self.owner = owner
        self.bases = bases
        self.sizes = sizes

    def __repr__(self) -> str:
        return (f"<hoccl.Window #{self.index} at {self.address:#x}, {self.nbytes} bytes>")


class Windows:
    """A rank's windows, found by address.  Windows never overlap (``register`` refuses
    it), so the one that may hold an address is the last that starts at or below it."""

    def __init__(self) -> None:
        self._by_index: Dict[int, Window] = {}
        self._starts: List[int] = []
        self._sorted: List[Window] = []
        self.next_index = 0

    def __len__(self) -> int:
        return len(self._by_index)

    def __iter__(self):
        return iter(list(self._sorted))

    def get(self, index: int) -> Optional[Window]:
        return self._by_index.get(index)

    def overlapping(self, address: int, nbytes: int) -> Optional[Window]:
        """A window sharing a byte with ``[address, address + nbytes)``, if one does."""
        at = bisect.bisect_right(self._starts, address + nbytes - 1)
        if at and self._sorted[at - 1].address + self._sorted[at - 1].nbytes > address:
            return self._sorted[at - 1]
        return None

    def find(self, address: int, nbytes: int) -> Optional[Tuple[Window, int]]:
        """(window, offset) of the window holding all of ``[address, address + nbytes)``."""
        at = bisect.bisect_right(self._starts, address)
        if not at:
            return None
        window = self._sorted[at - 1]
        offset = address - window.address
        if offset + nbytes > window.nbytes:
            return None
        return window, offset

    def of(self, call: str, window: Any) -> Optional[Window]:
        """The registered window ``window`` names: a ``Window`` of this registry, or the
        array registered as a whole; None if it names none."""
        if isinstance(window, Window):
            return window if self._by_index.get(window.index) is window else None
        try:
            buffer = as_buffer(call, "window", window, writable=False, reduction=False)
        except InvalidArgumentError:
            return None
        found = self.find(buffer.address, max(buffer.nbytes, 1))
        if found is None or found[1] or found[0].nbytes != buffer.nbytes:
            return None
        return found[0]

    def add(self, address: int, nbytes: int, owner: Any, bases: Optional[List[Any]],
            sizes: Optional[List[int]]) -> Window:
        window = Window(self.next_index, address, nbytes, owner, bases, sizes)
        self.next_index += 1
        self._by_index[window.index] = window
        at = bisect.bisect_right(self._starts, address)
        self._starts.insert(at, address)
        self._sorted.insert(at, window)
        return window

    def remove(self, window: Window) -> None:
        del self._by_index[window.index]
        at = self._sorted.index(window)
        del self._starts[at]
        del self._sorted[at]

    def clear(self) -> None:
        self._by_index.clear()
        self._starts.clear()
        self._sorted.clear()
