"""The "hoccl" backend's registration with torch.distributed, which the entry point
(``hoccl_autoload``) and ``hoccl.torch`` share: each registers its creator, whichever
runs first.  Imports neither hoccl nor torch."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

__all__ = ["BACKEND", "register", "creating", "is_creating"]

#: the name under which torch.distributed knows the backend
BACKEND = "hoccl"
#: True while the creator imports hoccl.torch (``creating``)
_CREATING = False


def register(create: Callable[[Any, Any], Any]) -> None:
    """Register ``create`` as the backend's creator with torch.distributed, unless the
    backend is registered already or torch.distributed is not loaded (or not built)."""
    distributed = sys.modules.get("torch.distributed")
    backend = getattr(distributed, "Backend", None)
    if backend is None or hasattr(backend, BACKEND.upper()):
        return
    backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])


@contextlib.contextmanager
def creating() -> Iterator[None]:
    """While the creator imports hoccl.torch: its rendezvous is done, so that import leaves
    the environment alone (``is_creating``)."""
    global _CREATING
    _CREATING = True
    try:
        yield
    finally:
        _CREATING = False


def is_creating() -> bool:
    return _CREATING
