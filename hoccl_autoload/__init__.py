"""torch.distributed's "hoccl" backend, registered when torch is imported.

hoccl's distribution declares ``register`` as a "torch.backends" entry point, which
``import torch`` calls (torch >= 2.5; off with TORCH_DEVICE_BACKEND_AUTOLOAD=0), so that
``dist.init_process_group("hoccl")`` works without ``import hoccl.torch``.

This package stands outside ``hoccl`` because torch calls it in every process that
imports torch: it imports neither hoccl (140 ms) nor hoccl.torch, whose import fills
the rendezvous variables from mpirun's or srun's and may initialise MPI.  hoccl.torch
is imported by the creator, when the first hoccl group is made (its rendezvous done,
so that import then leaves the environment alone: ``_backend.creating``).
"""

from __future__ import annotations

from typing import Any

from . import _backend
from ._backend import BACKEND

__all__ = ["register", "BACKEND"]


def register() -> None:
    """Register the backend with torch.distributed, unless it is registered already.

    Nothing is imported: from inside ``import torch`` (torch 2.5 to 2.13 import
    torch.distributed before they load entry points) an import could run into a torch
    half made, and a failure here would fail ``import torch`` itself.  Where
    torch.distributed is not loaded yet, or not built, ``import hoccl.torch`` registers
    the backend instead."""
    _backend.register(_create)


def _create(backend_options: Any, pg_options: Any) -> Any:
    """torch.distributed's creator: hoccl.torch's, imported now."""
    with _backend.creating():
        from hoccl.torch import _create as create
    return create(backend_options, pg_options)
