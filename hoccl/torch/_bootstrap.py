"""Rendezvous through a torch.distributed Store (what a process-group creator is given)."""

from __future__ import annotations

import pickle
from typing import Any, List

__all__ = ["StoreBootstrap"]


class StoreBootstrap:
    """``hoccl.init(bootstrap=StoreBootstrap(store, rank, world_size))``: the ranks meet
    through ``store`` (a TCPStore, a PrefixStore of one, a FileStore ...) instead of MPI.

    Every exchange has its own sequence number in its keys (``prefix/seq/rank``), so
    exchanges never see each other's values.  The last rank to read an exchange deletes
    its keys.  Waits are bounded by the store's timeout.
    """

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str = "hoccl"):
        if not 0 <= rank < world_size:
            raise ValueError(f"StoreBootstrap: rank must be in [0, {world_size}); got {rank}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self._seq = 0

    def allgather(self, value: Any) -> List[Any]:
        """Every rank's ``value`` (any picklable object), in rank order."""
        base = f"{self.prefix}/{self._seq}"
        self._seq += 1
        self.store.set(f"{base}/{self.rank}", pickle.dumps(value))
        keys = [f"{base}/{rank}" for rank in range(self.world_size)]
        self.store.wait(keys)
        values = [pickle.loads(self.store.get(key)) for key in keys]
        if self.store.add(f"{base}/read", 1) == self.world_size:
            for key in keys + [f"{base}/read"]:
                self.store.delete_key(key)
        return values

    def barrier(self) -> None:
        self.allgather(None)

    def close(self) -> None:
        """Nothing to release: the store belongs to its creator."""
