"""Models for the runtime tests, built the same way on every rank (same seed).

In-process ranks (threads) share torch's random state: each model is seeded and built under
one lock, so every rank still gets the same weights.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, HEADS, LENGTH = 32, 16, 2, 6
SEEDED = threading.Lock()  # torch.manual_seed and the initialisers that follow run as one


def mlp(seed: int = 0, layers: int = 5, width: int = 16) -> nn.Sequential:
    """Linear/Tanh pairs and a head: 2 * layers + 1 layers in the Sequential."""
    with SEEDED:
        torch.manual_seed(seed)
        body: list[nn.Module] = []
        for _ in range(layers):
            body += [nn.Linear(width, width), nn.Tanh()]
        return nn.Sequential(*body, nn.Linear(width, 4))


class Embed(nn.Module):
    """tokens (B, T) int64 -> (hidden (B, T, D), padding mask (B, T) bool): a tuple boundary, half without grad."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.1)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens(tokens) + self.position, tokens == 0  # token 0 is padding


class Block(nn.Module):
    """Pre-norm transformer block with residuals; passes the padding mask on."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, padding = value
        h = self.norm1(x)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        attended, _ = self.attn(h, h, h, attn_mask=causal, key_padding_mask=padding, need_weights=False)
        x = x + attended
        return x + self.mlp(self.norm2(x)), padding


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.out(self.norm(value[0]))


def transformer(seed: int = 0, blocks: int = 7) -> nn.Sequential:
    with SEEDED:
        torch.manual_seed(seed)
        return nn.Sequential(Embed(), *[Block() for _ in range(blocks)], Head())


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


MODELS = {"mlp": (mlp, mse), "transformer": (transformer, token_loss)}


def batch(model: str, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same data on every rank."""
    generator = torch.Generator().manual_seed(1000 + seed)
    if model == "mlp":
        return torch.randn(size, 16, generator=generator), torch.randn(size, 4, generator=generator)
    tokens = torch.randint(1, VOCAB, (size, LENGTH), generator=generator)
    tokens[:, -1] = torch.where(torch.arange(size) % 3 == 0, 0, tokens[:, -1])  # some padding, never a whole row
    return tokens, torch.randint(0, VOCAB, (size, LENGTH), generator=generator)


def planning() -> tuple[nn.Sequential, object, torch.Tensor]:
    """A planning problem for ``python -m pipeengine.tune tests.pipeengine.models:planning``: model, loss, batch."""
    return mlp(), mse, batch("mlp", 16, seed=0)[0]
