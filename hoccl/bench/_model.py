"""The model of ``python -m hoccl.bench.train``: a Llama-style decoder (RMSNorm, rotary
causal attention through SDPA, SwiGLU MLP), its shapes, FSDP2 sharding, batches and one
training step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelShape", "SHAPES", "Decoder", "shard", "batch", "train_step", "optimizer_for"]

@dataclass(frozen=True)
class ModelShape:
    """A decoder and the batch it trains on (per rank)."""
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int
    vocab: int = 32000

    @property
    def hidden(self) -> int:
        """SwiGLU width: 8/3 of ``dim``, rounded up to a multiple of 64."""
        return -(-(8 * self.dim // 3) // 64) * 64

    def parameters(self) -> int:
        per_layer = 4 * self.dim * self.dim + 3 * self.dim * self.hidden + 2 * self.dim
        return self.layers * per_layer + 2 * self.vocab * self.dim + self.dim

    def label(self) -> str:
        return f"d{self.dim} L{self.layers} s{self.seq} b{self.batch}"


#: the sweep, from compute-bound to communication-heavy, and a tiny one for CPUs
SHAPES = {
    "compute": ModelShape(dim=4096, layers=16, heads=32, seq=2048, batch=2),
    "comm": ModelShape(dim=4096, layers=16, heads=32, seq=512, batch=1),
    "large": ModelShape(dim=5120, layers=12, heads=40, seq=1024, batch=1),
    # few wide layers: the same parameters as "comm" in a quarter of the calls, each four
    # times larger, so the step is bound by the GPUs' communication, not by the host
    "wide": ModelShape(dim=8192, layers=4, heads=64, seq=512, batch=1),
    "tiny": ModelShape(dim=64, layers=2, heads=4, seq=32, batch=2, vocab=256),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.heads = shape.heads
        self.qkv = nn.Linear(shape.dim, 3 * shape.dim, bias=False)
        self.out = nn.Linear(shape.dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, dim))


class SwiGLU(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.gate = nn.Linear(shape.dim, shape.hidden, bias=False)
        self.up = nn.Linear(shape.dim, shape.hidden, bias=False)
        self.down = nn.Linear(shape.hidden, shape.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(shape.dim), Attention(shape)
        self.mlp_norm, self.mlp = RMSNorm(shape.dim), SwiGLU(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Token embedding, ``layers`` blocks, a final RMSNorm and the output projection."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        self.embedding = nn.Embedding(shape.vocab, shape.dim)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.dim)
        self.output = nn.Linear(shape.dim, shape.vocab, bias=False)
        head_dim = shape.dim // shape.heads
        frequencies = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(shape.seq).float(), frequencies)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.output(self.norm(x))


def shard(shape: ModelShape, mesh: Any, device: torch.device, seed: int = 0) -> nn.Module:
    """The decoder with the same initial weights on every rank and for every library,
    each block and then the whole model sharded with FSDP2 over ``mesh``: bf16 compute,
    fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(seed)
    with torch.device(device):
        model = Decoder(shape)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def batch(shape: ModelShape, step: int, rank: int, device: torch.device):
    """(tokens, targets) of ``rank`` at ``step``, the same for every library: sequences
    that follow ``next = (5 * token + 1) mod vocab`` from a random start, with one token
    in eight replaced by a random one, so that the loss has something to learn."""
    generator = torch.Generator().manual_seed(step * 100003 + rank)
    size = (shape.batch, shape.seq + 1)
    tokens = torch.empty(size, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, shape.vocab, (shape.batch,), generator=generator)
    for position in range(1, shape.seq + 1):
        tokens[:, position] = (5 * tokens[:, position - 1] + 1) % shape.vocab
    noise = torch.rand(size, generator=generator) < 0.125
    tokens[noise] = torch.randint(0, shape.vocab, (int(noise.sum()),), generator=generator)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model: nn.Module, optimizer: Any, tokens: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
    """One step: forward, next-token cross-entropy, backward, optimizer.  Returns the loss."""
    logits = model(tokens)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def optimizer_for(model: nn.Module, device: torch.device, lr: float = 3e-4) -> Any:
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
