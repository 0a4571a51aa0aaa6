"""The code blocks of README.md and docs/, and the contexts a fragment runs in (tests/test_docs.py runs them).

Each ```python or ```bash block is preceded by a comment saying how it is tested:

    <!-- test: run -->                 run as it is (python: executed; bash: each `python -m` line, in one folder)
    <!-- test: in-process -->          a whole program, its launch(...) on in-process ranks (threads)
    <!-- test: in CONTEXT -->          a fragment, executed on every rank inside CONTEXT (below)
    <!-- test: tests/F.py::NAME -->    run by that test: each `python examples/X.py ...` line's script and options
                                       appear in that test's module
    <!-- test: skip REASON -->         not run, for the reason given (tests/test_docs.py lists the ones allowed)
    <!-- test: is FILE -->             the whole of FILE, copied in (GitHub shows no includes), kept equal to it

```text blocks are output, not code. A context is a function that builds the names a fragment uses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).parent.parent
DIRECTIVE = re.compile(r"<!-- test: (.*?) -->")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    code: str
    directive: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one page, each with the directive on the line before it (or None)."""
    lines, found, index = path.read_text().splitlines(), [], 0
    while index < len(lines):
        fence = re.match(r"^(\s*)```(\w*)\s*$", lines[index])
        if not fence:
            index += 1
            continue
        indent, language, start = fence.group(1), fence.group(2), index
        index += 1
        body = []
        while not lines[index].strip().startswith("```"):
            body.append(lines[index][len(indent) :])
            index += 1
        index += 1
        before = lines[start - 1].strip() if start else ""
        directive = DIRECTIVE.fullmatch(before)
        code = "\n".join(body) + "\n"
        found.append(Block(path, start + 1, language, code, directive.group(1) if directive else None))
    return found


def every_block() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


# the contexts: the names a fragment uses, built the same on every rank (seeded)


def ranks() -> dict[str, object]:
    """A small MLP, its loss and one batch: what most fragments train."""
    from pipeengine import PipelineEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=data), torch.randn(8, 1, generator=data)
    return {
        "torch": torch,
        "nn": nn,
        "F": F,
        "PipelineEngine": PipelineEngine,
        "model": model,
        "loss_fn": F.mse_loss,
        "x": x,
        "y": y,
    }


def engine() -> dict[str, object]:
    """ranks(), with an engine (1F1B, 4 micro-batches) and AdamW over it."""
    names = ranks()
    built = names["PipelineEngine"](names["model"], names["loss_fn"], num_microbatches=4)  # type: ignore[operator]
    return {**names, "engine": built, "optimizer": torch.optim.AdamW(built.parameters(), lr=1e-3)}


def gpt() -> dict[str, object]:
    """examples/train_gpt.py's GPT, small, and a batch of tokens whose padding targets are ignored (-100)."""
    from examples.train_gpt import IGNORE, VOCAB
    from examples.train_gpt import gpt as build

    names = ranks()
    torch.manual_seed(0)
    model = build(2, 32, 2, 16)
    tokens = torch.randint(0, len(VOCAB), (4, 17), generator=torch.Generator().manual_seed(1))
    y = tokens[:, 1:].clone()
    y[:, -3:] = IGNORE
    return {**names, "model": model, "x": tokens[:, :-1], "y": y}


def gloo() -> dict[str, object]:
    """gpt() with the head untied (one stage holds both: FSDP2 cannot shard one parameter in two units), a summed
    loss over the real tokens."""
    names = gpt()
    model = names["model"]
    model[-1].out.weight = nn.Parameter(model[0].tokens.weight.detach().clone())  # type: ignore[index, union-attr]
    names["loss_fn"] = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)
    return names


def hf() -> dict[str, object]:
    """A tiny Llama from a config, a batch of ids and their labels (HF's: unshifted, -100 ignored)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    names = ranks()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :2] = -100
    return {**names, "model": model, "input_ids": ids, "labels": labels}


def finetuned(folder: Path) -> dict[str, object]:
    """A folder as examples/finetune_hf.py leaves it: the tiny Llama and its character tokenizer."""
    from examples.finetune_hf import characters, load

    torch.manual_seed(0)
    model, _ = load(None)
    model.save_pretrained(folder)  # type: ignore[attr-defined]
    characters().save_pretrained(folder)  # type: ignore[attr-defined]
    return {"finetuned": str(folder)}


CONTEXTS = {"ranks": ranks, "engine": engine, "gpt": gpt, "gloo": gloo, "hf": hf}
