"""Device backends behind one interface (``_base.Device``): ``cuda`` and ``host``.

Only ``hoccl.backends.cuda`` imports the CUDA driver bindings, and only when a
CUDA device is asked for or probed.
"""

from __future__ import annotations

from typing import Any, Optional

from .._errors import InvalidArgumentError

__all__ = ["BACKENDS", "cuda_device_count", "pick_backend", "open_device"]

BACKENDS = ("cuda", "host")


def cuda_device_count() -> int:
    """Visible CUDA devices; 0 when the driver or its Python bindings are missing."""
    try:
        from . import cuda
    except ImportError:
        return 0
    return cuda.device_count()


def pick_backend(call: str, backend: Optional[str]) -> str:
    if backend is None:
        return "cuda" if cuda_device_count() > 0 else "host"
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"{call}: backend must be one of {BACKENDS} or None; "
                                   f"got {backend!r}")
    if backend == "cuda" and cuda_device_count() == 0:
        raise InvalidArgumentError(f"{call}: backend 'cuda' asked for, but no CUDA device is "
                                   f"visible (or cuda-python is not installed)")
    return backend


def open_device(backend: str, ordinal: Any, *, max_sms: int, copy_sms: int) -> Any:
    """Rank's device on ``backend``: ``max_sms`` caps reductions, ``copy_sms`` the one
    same-GPU copy of out-of-place forms."""
    if backend == "cuda":
        from . import cuda
        return cuda.open_device(ordinal, max_sms=max_sms, copy_sms=copy_sms)
    from . import host
    return host.open_device(ordinal, max_sms=max_sms, copy_sms=copy_sms)
