"""The progress bar of hoccl's programs (``python -m hoccl.bench``, ``python -m
hoccl.tune``): tqdm on the reporting rank's stderr; lines said meanwhile go above it."""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

__all__ = ["Progress"]


class Progress:
    """``total`` steps of ``unit``; with a ``budget`` (seconds) the bar shows the time
    used of it.  Only the ``leader`` draws; every rank may call every method."""

    def __init__(self, leader: bool, total: int, unit: str, budget: Optional[float] = None):
        from tqdm import tqdm
        self.leader, self.budget, self.start = leader, budget, time.monotonic()
        self.bar = tqdm(total=total, unit=unit, disable=not leader, file=sys.stderr,
                        dynamic_ncols=True,
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}")

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def step(self, what: str, count: int = 1) -> None:
        """``count`` steps done, the last of them ``what``."""
        used = f"{self.elapsed():.1f}/{self.budget:g} s  " if self.budget is not None else ""
        self.bar.set_postfix_str(used + what, refresh=False)
        self.bar.update(count)

    def say(self, text: str, file: Optional[TextIO] = None) -> None:
        """Print ``text`` (to stderr unless ``file``) above the bar, on the leader."""
        if self.leader:
            self.bar.write(text, file=file or sys.stderr)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
