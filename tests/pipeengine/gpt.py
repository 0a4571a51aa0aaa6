"""GPT-class models for the tests: a head tied to the embedding, padded batches, a token-mean loss; and the same GPT
laid out head by head for tensor parallelism, with its plan."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tests.pipeengine.models import SEEDED

VOCAB, WIDTH, HEADS, LENGTH, IGNORE = 24, 16, 2, 6, -100


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, D)
        return self.tokens(tokens) + self.position


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        # no bias on q, k, v: a key bias has a zero gradient (softmax ignores it), whose rounding noise AdamW
        # would blow up to lr-sized steps that differ between any two summation orders
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH, bias=False), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, d // HEADS).unbind(2)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def tied_gpt(seed: int = 0, blocks: int = 6) -> nn.Sequential:
    """Embedding, blocks, head; the head's projection is the embedding's weight (as in GPT-2)."""
    with SEEDED:
        torch.manual_seed(seed)
        embed, head = Embed(), Head()
        head.out.weight = embed.tokens.weight
        return nn.Sequential(embed, *[Block() for _ in range(blocks)], head)


def token_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss summed over the tokens that count: loss_count below divides by their number."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def count_tokens(targets: torch.Tensor) -> torch.Tensor:
    return (targets != IGNORE).sum()


def one_process_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What one process computes over the whole batch: the mean over its valid tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def padded_batch(size: int, seed: int, microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents of random lengths padded to LENGTH; the first micro-batch is nearly all padding."""
    generator = torch.Generator().manual_seed(2000 + seed)
    tokens = torch.randint(1, VOCAB, (size, LENGTH), generator=generator)
    targets = torch.randint(0, VOCAB, (size, LENGTH), generator=generator)
    lengths = torch.randint(1, LENGTH + 1, (size,), generator=generator)
    lengths[: size // microbatches] = 1  # one valid token per row in the first micro-batch
    pad = torch.arange(LENGTH)[None, :] >= lengths[:, None]
    tokens[pad], targets[pad] = 0, IGNORE
    return tokens, targets


# ---- for tensor parallelism (tests/pipeengine/test_tensor_parallel.py, test_compile.py, the composition matrix)

HEAD_DIM = 4  # 4 heads of the width: 2 per rank at tp=2


class HeadwiseBlock(Block):
    """Block with qkv laid out head by head ([heads][q, k, v][head_dim]), so that a column shard holds whole heads;
    the head count is the local width's (torchtitan's blocks do the same)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(self.norm1(x))
        heads = qkv.shape[-1] // (3 * HEAD_DIM)  # this rank's heads
        q, k, v = qkv.view(b, t, heads, 3, HEAD_DIM).unbind(3)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, heads * HEAD_DIM))
        return x + self.mlp(self.norm2(x))


def headwise_gpt(tied: bool = False, blocks: int = 4) -> nn.Sequential:
    with SEEDED:
        torch.manual_seed(0)
        embed, head = Embed(), Head()
        if tied:
            head.out.weight = embed.tokens.weight
        return nn.Sequential(embed, *[HeadwiseBlock() for _ in range(blocks)], head)


def tp_plan(tied: bool = False) -> dict[str, object]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles: dict[str, object] = {
        "*.qkv": ColwiseParallel(),
        "*.proj": RowwiseParallel(),
        "*.mlp.0": ColwiseParallel(),
        "*.mlp.2": RowwiseParallel(),
    }
    if tied:  # the tie holds with one placement on both sides: the vocabulary dim, sharded
        from torch.distributed.tensor import Replicate

        styles["0.tokens"] = RowwiseParallel(input_layouts=Replicate())
        styles["*.out"] = ColwiseParallel(use_local_output=False)  # gathered below: the loss takes whole logits
    return styles


def whole_token_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """token_sum of logits that may be a DTensor sharded on the vocabulary (the tie's plan): gathered whole."""
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def tp_batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3000 + seed)
    tokens = torch.randint(0, VOCAB, (size, LENGTH), generator=generator)
    targets = torch.randint(0, VOCAB, (size, LENGTH), generator=generator)
    targets[: size // 2, -2:] = IGNORE  # padding in some rows
    return tokens, targets
