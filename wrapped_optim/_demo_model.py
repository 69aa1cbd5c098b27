"""A tiny GPT-style language model and a deterministic data stream, for the demo and tests.

Small enough to train a few hundred steps on two CPU cores in seconds, real enough (embedding,
causal self-attention, MLP, tied output head, bf16 weights) that optimizer bugs show up in the
loss the way they do in real runs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["TinyGPT", "batch_for_step", "lm_loss"]


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(width // self.heads)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        mixed = (attention @ v).transpose(1, 2).reshape(batch, length, width)
        x = x + self.proj(mixed)
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A decoder-only transformer with a tied embedding / output head.

    Example:
        >>> import torch
        >>> model = TinyGPT(vocab=32, width=16, depth=1, heads=2, context=8)
        >>> tokens = torch.zeros(2, 8, dtype=torch.long)
        >>> model(tokens).shape
        torch.Size([2, 8, 32])
    """

    def __init__(
        self, vocab: int = 64, width: int = 48, depth: int = 2, heads: int = 4, context: int = 32
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits; the head reuses the embedding, so it adds no parameters.

        Sequences may be shorter than ``context`` (the positions are cut to fit).

        Example:
            >>> import torch
            >>> model = TinyGPT(vocab=32, width=16, depth=1, heads=2, context=8)
            >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
            torch.Size([2, 5, 32])
        """
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()


def batch_for_step(
    step: int, *, batch: int = 16, context: int = 32, vocab: int = 64, device: str = "cpu"
) -> torch.Tensor:
    """Token sequences for one step: noisy arithmetic progressions, learnable but not trivial.

    The same step always gives the same batch, so two runs see identical data.

    Example:
        >>> torch.equal(batch_for_step(3), batch_for_step(3))
        True
    """
    gen = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    tokens = (start + stride * torch.arange(context + 1)) % vocab
    noise = torch.rand(batch, context + 1, generator=gen) < 0.05
    tokens = torch.where(noise, torch.randint(0, vocab, tokens.shape, generator=gen), tokens)
    return tokens.to(device)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, computed in FP32 whatever the model's dtype.

    Example:
        >>> model = TinyGPT(vocab=64, width=16, depth=1, heads=2, context=32)
        >>> float(lm_loss(model, batch_for_step(0)).detach()) > 0
        True
    """
    logits = model(tokens[:, :-1]).float()
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
