"""GPT-class models for the tests: a head tied to the embedding, padded batches, a token-mean loss."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from pipeengine import PipelineEngine
from tests.pipeengine import ranks
from tests.pipeengine.models import SEEDED
from tests.pipeengine.workers import (
    check_clipped,
    check_weights,
    close,
    step_both,
    train_replicas_like_one_process,
)

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
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)  # fmt: skip
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


def tied_parity(
    schedule: str, steps: int = 3, data_parallel: int = 1, options: dict[str, object] | None = None
) -> None:
    """Loss, gradients and weights after several AdamW steps equal one process's token-mean, tie and all."""
    options = options or {}
    model = tied_gpt()
    reference = copy.deepcopy(model)
    m = 2 * (ranks.size() // data_parallel)
    engine = PipelineEngine(model, token_sum, num_microbatches=m, schedule=schedule, loss_count=count_tokens,
                            data_parallel=data_parallel, **options)  # type: ignore[arg-type]  # fmt: skip
    names = [name for name, _ in engine.named_parameters()]
    if engine.first or engine.last:  # every holding rank lists the tie under the model's first name
        assert "0.tokens.weight" in names and f"{len(model) - 1}.out.weight" not in names, names
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train_replicas_like_one_process(
        engine, reference, (optimizer, reference_optimizer), one_process_loss, steps,
        f"tied {schedule} dp={data_parallel} {options}",
        lambda step: [padded_batch(2 * m, seed=10 * step + r, microbatches=m) for r in range(data_parallel)],
    )  # fmt: skip
    check_weights(engine, reference, f"tied {schedule} after {steps} steps")
    tied = dict(engine.named_parameters()).get("0.tokens.weight")
    if tied is not None and engine.last:  # the head and the embedding are one tensor on this rank
        assert engine.stages[engine.schedule.num_stages - 1][-1].out.weight is tied


def tied_clipping(schedule: str) -> None:
    """The tied weight counts once in the norm, as torch.nn.utils.clip_grad_norm_ counts it on the whole model."""
    model = tied_gpt()
    reference = copy.deepcopy(model)
    m = 2 * ranks.size()
    engine = PipelineEngine(model, token_sum, num_microbatches=m, schedule=schedule, loss_count=count_tokens)
    x, y = padded_batch(2 * m, seed=3, microbatches=m)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    one_process_loss(reference(x), y).backward()
    check_clipped(engine, reference, 0.05, "the tied model")


def tied_save(directory: str, schedule: str) -> None:
    """Train two steps, save; the reference is saved beside it for the ranks that load."""
    model = tied_gpt()
    reference = copy.deepcopy(model)
    m = 2 * ranks.size()
    engine = PipelineEngine(model, token_sum, num_microbatches=m, schedule=schedule, loss_count=count_tokens)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(2):
        x, y = padded_batch(8, seed=step, microbatches=m)
        engine.train_step(x if engine.first else None, y if engine.last else None)
        one_process_loss(reference(x), y).backward()
        step_both(optimizer, reference_optimizer)
    engine.save(directory, optimizer)
    if ranks.rank() == 0:
        torch.save({"model": reference.state_dict(), "optimizer": reference_optimizer.state_dict()},
                   Path(directory) / "reference.pt")  # fmt: skip


def tied_load(directory: str, schedule: str) -> None:
    """Another partition and schedule loads it: the tie holds, and training goes on exactly as one process."""
    engine = PipelineEngine(tied_gpt(seed=5), token_sum, num_microbatches=ranks.size(), schedule=schedule,
                            loss_count=count_tokens)  # fmt: skip
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    engine.load(directory, optimizer)
    saved = torch.load(Path(directory) / "reference.pt", weights_only=False)
    reference = tied_gpt()
    reference.load_state_dict(saved["model"])
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    reference_optimizer.load_state_dict(saved["optimizer"])
    check_weights(engine, reference, "after load")
    x, y = padded_batch(8, seed=7, microbatches=ranks.size())
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    expected = one_process_loss(reference(x), y)
    expected.backward()
    close(loss, expected.item(), "loss after load")
    step_both(optimizer, reference_optimizer)
    check_weights(engine, reference, "one step after load")


def stored_once(directory: str) -> tuple[int, dict[str, str]]:
    """How many parts hold the tied weight, and the other names the checkpoint records."""
    target = Path(directory) / Path(directory, "latest").read_text()
    meta = json.loads((target / "meta.json").read_text())
    holders = sum("0.tokens.weight" in keys for keys in meta["parts"].values())
    return holders, meta["tied"]


def untieable(case: str) -> None:
    """A tie across ranks that cannot be honoured: refused at construction, naming the layers."""
    model = tied_gpt()
    if case == "buffer":  # the same buffer in the first and the last layer
        shared = torch.zeros(3)
        model[0].register_buffer("seen", shared)
        model[-1].register_buffer("seen", shared)
    elif case == "view":  # memory shared through a view of another shape: not one parameter
        model[-1].out = nn.Linear(WIDTH, VOCAB // 2, bias=False)
        model[-1].out.weight = nn.Parameter(model[0].tokens.weight.data[: VOCAB // 2])
    PipelineEngine(model, token_sum, num_microbatches=2, loss_count=count_tokens)


def nothing_to_count() -> None:
    engine = PipelineEngine(tied_gpt(), token_sum, num_microbatches=2, loss_count=count_tokens)
    x, y = padded_batch(4, seed=0, microbatches=2)
    engine.train_step(x if engine.first else None, torch.full_like(y, IGNORE) if engine.last else None)
