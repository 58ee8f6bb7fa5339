"""The tensor-parallel benchmark's (``python -m hoccl.bench.tp``) pure parts: how a layer's
rows are cut into chunks, the schedules it runs, and its bit-for-bit checker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, NamedTuple, Sequence

__all__ = ["ASYNC_TP", "COMPUTE", "ChunkViews", "Layout", "Schedule", "schedules",
           "count_mismatches"]

ASYNC_TP = "async-tp"
COMPUTE = "compute"


class ChunkViews(NamedTuple):
    """One chunk's views of a rank's buffers (flat views are what the collectives take)."""
    own: Any            # this rank's rows of the chunk in the gather buffer (all_gather send)
    gathered: Any       # the chunk over all ranks, flat (all_gather recv)
    activations: Any    # the chunk over all ranks, rows x hidden (left of @ W1)
    hidden: Any         # rows x ffn/world_size (= activations @ W1)
    partial: Any        # rows x hidden partial sums (= hidden @ W2)
    partial_flat: Any   # the same, flat (reduce_scatter send)
    result: Any         # this rank's rows of the chunk in the partial-sum buffer (recv)


@dataclass(frozen=True)
class Layout:
    """How one layer's rows are cut: ``chunks`` chunks of ``rows`` rows per rank.

    Buffers are chunk-major: row ``i`` of rank ``r``'s part of chunk ``c`` holds token
    ``r * tokens / world_size + c * rows + i``, so every chunk is one contiguous block
    with the ranks' parts in rank order (what an in-place all_gather writes and an
    in-place reduce_scatter reads) and a rank's own rows, taken chunk by chunk, are its
    tokens in order.  ``chunks=1`` is the unchunked layer."""
    tokens: int
    hidden: int
    ffn: int
    world_size: int
    chunks: int = 1

    def __post_init__(self) -> None:
        problems = []
        for name in ("tokens", "hidden", "ffn", "world_size", "chunks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name} a positive int, got {getattr(self, name)!r}")
        if not problems and self.tokens % (self.world_size * self.chunks):
            problems.append(f"tokens ({self.tokens}) divisible by world_size x chunks "
                            f"({self.world_size} x {self.chunks})")
        if not problems and self.ffn % self.world_size:
            problems.append(f"ffn ({self.ffn}) divisible by world_size ({self.world_size})")
        if problems:
            raise ValueError("Layout: expected " + "; ".join(problems))

    @property
    def rows_per_rank(self) -> int:
        return self.tokens // self.world_size

    @property
    def rows(self) -> int:
        """Rows of one rank in one chunk."""
        return self.tokens // (self.world_size * self.chunks)

    @property
    def ffn_shard(self) -> int:
        return self.ffn // self.world_size

    @property
    def flops(self) -> float:
        """Floating-point operations of one rank's two matmuls in one layer."""
        return 2.0 * 2 * self.tokens * self.hidden * self.ffn_shard

    def token(self, chunk: int, rank: int, row: int) -> int:
        """The token held at row ``row`` of rank ``rank``'s part of chunk ``chunk``."""
        return rank * self.rows_per_rank + chunk * self.rows + row

    def blocks(self, flat: Any, width: int) -> Any:
        """A flat buffer of ``tokens x width`` as [chunks, world_size, rows, width]."""
        return flat.view(self.chunks, self.world_size, self.rows, width)

    def views(self, gather: Any, hidden: Any, partial: Any, rank: int) -> List[ChunkViews]:
        """Per chunk, the views of flat ``gather`` (tokens x hidden), ``hidden``
        (tokens x ffn/world_size) and ``partial`` (tokens x hidden) buffers."""
        wide = self.world_size * self.rows
        gathered = self.blocks(gather, self.hidden)
        partials = self.blocks(partial, self.hidden)
        hiddens = hidden.view(self.chunks, wide, self.ffn_shard)
        # view, never reshape: a copy here would let a collective write into a temporary
        return [ChunkViews(gathered[c, rank].view(-1), gathered[c].view(-1),
                           gathered[c].view(wide, self.hidden), hiddens[c],
                           partials[c].view(wide, self.hidden), partials[c].view(-1),
                           partials[c, rank].view(-1))
                for c in range(self.chunks)]

    def place_input(self, gather: Any, x: Any, rank: int) -> None:
        """Copy this rank's rows ``x`` (rows_per_rank x hidden) into its own slots."""
        self.blocks(gather, self.hidden)[:, rank].copy_(
            x.view(self.chunks, self.rows, self.hidden))

    def output(self, partial: Any, rank: int) -> Any:
        """This rank's rows of the layer's output, in token order (a copy)."""
        return self.blocks(partial, self.hidden)[:, rank].reshape(self.rows_per_rank,
                                                                   self.hidden)


@dataclass(frozen=True)
class Schedule:
    """One way to run the layer: ``library`` ("compute" for no communication) with
    ``chunks`` chunks (1: unchunked); ``overlapped`` puts communication on a side stream;
    async-TP runs its fused ops (``chunks`` 0)."""
    library: str
    chunks: int
    overlapped: bool

    def __post_init__(self) -> None:
        fused = self.library == ASYNC_TP
        if not self.library or self.chunks < (0 if fused else 1) or (fused and self.chunks) \
                or (self.chunks > 1 and not self.overlapped and self.library != COMPUTE):
            raise ValueError(f"Schedule: expected a library name, chunks >= 1 (0 for "
                             f"{ASYNC_TP}) and chunked schedules overlapped, got {self}")

    @property
    def label(self) -> str:
        if self.library == ASYNC_TP:
            return "fused ops (its own pipeline)"
        if self.library == COMPUTE:
            return "matmuls only" + ("" if self.chunks == 1 else f", {self.chunks} chunks")
        return f"{self.chunks} chunks overlapped" if self.overlapped else "sequential"

    @property
    def baseline(self) -> "Schedule":
        """The non-overlapped schedule this one's speedup is measured against."""
        return Schedule("nccl" if self.library == ASYNC_TP else self.library, 1, False)


def schedules(libraries: Sequence[str], chunk_counts: Sequence[int]) -> List[Schedule]:
    """Every schedule of the run: for each communicating library its sequence and its
    overlaps; async-TP's fused ops (and NCCL's sequence, its baseline); the matmuls alone."""
    found: List[Schedule] = []
    names = list(libraries)
    if ASYNC_TP in names and "nccl" not in names:
        names.insert(names.index(ASYNC_TP), "nccl")
    for name in names:
        if name == ASYNC_TP:
            found.append(Schedule(ASYNC_TP, 0, True))
            continue
        found.append(Schedule(name, 1, False))
        if name == "nccl" and "nccl" not in libraries:
            continue  # measured only as async-TP's baseline
        found += [Schedule(name, chunks, True) for chunks in chunk_counts]
    found.append(Schedule(COMPUTE, 1, False))
    found += [Schedule(COMPUTE, chunks, True) for chunks in chunk_counts]
    return found


def count_mismatches(got: Any, want: Any) -> int:
    """Elements of ``got`` that differ from ``want`` bit for bit (16-bit floats compared as
    int16, so a NaN never equals anything and -0 differs from +0)."""
    import torch
    if got.shape != want.shape:
        raise ValueError(f"count_mismatches: shapes differ: {tuple(got.shape)} and "
                         f"{tuple(want.shape)}")
    return int((got.contiguous().view(torch.int16) != want.contiguous().view(torch.int16))
               .sum().item())
