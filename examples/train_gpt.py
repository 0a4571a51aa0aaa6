"""Train a small character-level GPT with pipeline parallelism, on the Python standard library's own source.

    python examples/train_gpt.py                                # 4 CPU ranks, 1F1B, a few minutes on 2 cores
    python examples/train_gpt.py --schedule interleaved --steps 100
    torchrun --nproc-per-node 4 examples/train_gpt.py           # the same, launched by torchrun
    python examples/train_gpt.py --tensor-parallel 2            # 2 stages, each split over 2 ranks
    python examples/train_gpt.py --checkpoint-every 50 --max-restarts 2   # survives a crash (see below)

Two machines, two replicas of a 2-rank pipeline (run on each, with its --node-rank):

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 examples/train_gpt.py --data-parallel 2

The model is an nn.Sequential of blocks (embedding, transformer blocks, head), split into
stages by measured time, its output projection tied to the token embedding (as GPT-2's): the
first and the last stage share that weight across ranks. A document is a paragraph of the
source (up to a blank line); each row of a batch is one document, padded to the context, and
the loss is the mean over the real tokens of the whole batch (padding ignored), as one process
would compute it. The first stage's rank feeds the inputs, the last stage's rank the targets.
At the end it samples a few lines and writes the last step's measured timeline (PNG and trace) into --out.

With --checkpoint-every N it saves into --out every N steps (in the background: the write overlaps the next
step) and at the end: the model, AdamW's state, the LR schedule, the data's position and the step. Started again
with the same --out it resumes from the latest checkpoint, and with --max-restarts K the launcher starts every
rank again after a failure, up to K times: the job ends with the weights an uninterrupted run ends with.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from pipeengine import PipelineEngine, ReplicaLoader, latest_checkpoint, launch
from schedules import SCHEDULES, simulate

RANKS, SCHEDULE, STEPS, LAYERS, WIDTH, HEADS, CONTEXT, BATCH, MICROBATCHES = 4, "1f1b", 300, 6, 128, 4, 64, 32, 8
LEARNING_RATE, TRACE_EVERY, CORPUS_BYTES, OUT, IGNORE, LOG_EVERY = 3e-3, 50, 2_000_000, "out/gpt", -100, 10
VOCAB = [chr(c) for c in range(32, 127)] + ["\n"]  # printable ASCII; anything else reads as a space
INDEX = {c: i for i, c in enumerate(VOCAB)}


class Embed(nn.Module):
    def __init__(self, width: int, context: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(len(VOCAB), width), nn.Embedding(context, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, D)
        return self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each with a residual.

    qkv's outputs are laid out head by head (q, k, v of head 0, then of head 1, ...), so that a column shard
    of it (tensor parallelism: TENSOR_PARALLEL_PLAN) holds whole heads; the heads a rank computes follow from
    the width it is given, as torchtitan's blocks do.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_width = width // heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        qkv = self.qkv(self.norm1(x))
        heads = qkv.shape[-1] // (3 * self.head_width)  # this rank's heads (all of them without tensor parallelism)
        q, k, v = qkv.view(batch, length, heads, 3, self.head_width).unbind(3)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (B, heads, T, head width)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, heads * self.head_width))
        return x + self.mlp(self.norm2(x))


def tensor_parallel_plan() -> dict[str, object]:
    """Megatron's split of a block: qkv and the MLP's first layer by columns, proj and its second by rows, so
    each stage's output is whole (replicated) on every rank of its tensor-parallel group."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "*.qkv": ColwiseParallel(),
        "*.proj": RowwiseParallel(),
        "*.mlp.0": ColwiseParallel(),
        "*.mlp.2": RowwiseParallel(),
    }


class Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(width), nn.Linear(width, len(VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, vocab)
        return self.out(self.norm(x))


def gpt(layers: int, width: int, heads: int, context: int) -> nn.Sequential:
    embed, head = Embed(width, context), Head(width)
    head.out.weight = embed.tokens.weight  # tied: (vocab, width) both; on the first and the last stage's ranks
    for table in (embed.tokens, embed.positions):  # GPT-2's: N(0, 1) would make the tied head's logits huge
        nn.init.normal_(table.weight, std=0.02)
    return nn.Sequential(embed, *[Block(width, heads) for _ in range(layers)], head)


def summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The next-character loss summed over the real tokens; the engine divides by their count (loss_count)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def real_tokens(targets: torch.Tensor) -> torch.Tensor:
    return (targets != IGNORE).sum()


def corpus(device: torch.device) -> torch.Tensor:
    """The standard library's .py files as token ids, read on rank 0 and broadcast (every machine agrees)."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    if dist.get_rank() == 0:
        text, total = [], 0
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            text.append(path.read_text(errors="replace"))
            total += len(text[-1])
            if total >= CORPUS_BYTES:
                break
        ids = torch.tensor([INDEX.get(c, 0) for c in "".join(text)[:CORPUS_BYTES]], dtype=torch.uint8, device=device)
        size[0] = ids.numel()
    dist.broadcast(size, src=0)
    if dist.get_rank() != 0:
        ids = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(ids, src=0)
    return ids.long().cpu()


def planning() -> tuple[nn.Sequential, object, torch.Tensor]:
    """The planning problem of this example, for ``python -m pipeengine.tune examples.train_gpt:planning``:
    the model, its loss and an input batch (random tokens: only shapes and costs matter to the planner)."""
    torch.manual_seed(0)
    model = gpt(LAYERS, WIDTH, HEADS, CONTEXT)
    return model, summed_loss, torch.randint(0, len(VOCAB), (BATCH, CONTEXT))


def documents(data: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each paragraph: the text between blank lines, at least a few characters long."""
    newline = INDEX["\n"]
    breaks = ((data[:-1] == newline) & (data[1:] == newline)).nonzero().flatten().tolist()
    edges = [0] + [b + 2 for b in breaks] + [data.numel()]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b - a > 8]


class Rows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """One document per row, cut to the context and padded after it: its padded targets are ignored (causal
    attention: the real tokens never see the padding after them)."""

    def __init__(self, data: torch.Tensor, docs: list[tuple[int, int]], context: int) -> None:
        self.data, self.docs, self.context = data, docs, context

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.docs[index]
        text = self.data[start : min(end, start + self.context + 1)]
        row = torch.zeros(self.context + 1, dtype=torch.int64)
        targets = torch.full((self.context,), IGNORE, dtype=torch.int64)
        row[: len(text)] = text
        targets[: len(text) - 1] = text[1:]
        return row[:-1], targets


def main(args: argparse.Namespace) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    talk = dist.get_rank() == 0  # the first stage of the first replica
    say = print if talk else (lambda *_, **__: None)
    say(f"reading the corpus (the standard library's source, {CORPUS_BYTES / 2**20:.1f} MiB) on rank 0...", flush=True)
    data = corpus(device)
    rows = Rows(data, documents(data), args.context)
    torch.manual_seed(0)  # the same model on every rank; each keeps its stages
    model = gpt(args.layers, args.width, args.heads, args.context)
    sample = torch.stack([rows[i][0] for i in range(args.batch)])
    say(
        "building the pipeline: every rank checks it has the same model, rank 0 times each layer on a sample batch "
        "to cut the stages...",
        flush=True,
    )
    parallel = (
        {"tensor_parallel": args.tensor_parallel, "tp_plan": tensor_parallel_plan()}
        if (args.tensor_parallel > 1)
        else {}
    )
    engine = PipelineEngine(
        model,
        summed_loss,
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        sample=sample,
        data_parallel=args.data_parallel,
        loss_count=real_tokens,
        **parallel,
    )  # type: ignore[arg-type]
    # --batch rows a step in all, each replica its share (the same rows along a pipeline)
    loader = ReplicaLoader(rows, args.batch, replicas=engine.data_parallel, rank=engine.dp_rank)
    if talk:
        print(
            f"{sum(p.numel() for p in model.parameters()):,} parameters (embedding and head tied), "
            f"{len(rows):,} documents in {data.numel():,} characters of stdlib, "
            f"{engine.data_parallel} replica(s) of a {engine.schedule.num_ranks}-rank pipeline, "
            f"{args.tensor_parallel} tensor-parallel rank(s) a stage"
        )
        print(engine.partition, flush=True)
        simulated = simulate(engine.schedule).bubble_fraction
        print(
            f"{args.schedule}: bubble {simulated:.1%} simulated (equal costs, free messages); the measured one, of "
            f"a step traced every {TRACE_EVERY} steps and the last, also counts the waits on messages and the host's "
            "work between instructions, and stages that are not equal",
            flush=True,
        )
    optimizer = torch.optim.AdamW(engine.parameters(), lr=LEARNING_RATE)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps, eta_min=LEARNING_RATE / 10)
    resumable = {"scheduler": schedule, "data": loader}  # what a checkpoint holds beside the model and optimizer
    start = 0
    if args.checkpoint_every and latest_checkpoint(args.out) is not None:
        start = engine.load(args.out, optimizer, **resumable)["step"]
        say(f"resumed from {latest_checkpoint(args.out)} at step {start}", flush=True)
    batches = loader.forever()
    bubble, started, tokens, writing = float("nan"), time.perf_counter(), 0, None
    timeline = None
    for step in range(start, args.steps):
        x, y = next(batches)
        traced = step % TRACE_EVERY == TRACE_EVERY - 1 or step == args.steps - 1
        with engine.tracing() if traced else contextlib.nullcontext():
            loss = engine.train_step(x if engine.first else None, y if engine.last else None)
        if writing is not None:  # the checkpoint written while this step ran: complete (or its failure raised)
            writing.result()
            writing = None
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        tokens += int(real_tokens(y))
        timeline = engine.timeline()
        if traced and timeline is not None:
            bubble = timeline.bubble_fraction
        if talk and (step % args.log_every == 0 or step == args.steps - 1):
            rate = tokens * engine.data_parallel / (time.perf_counter() - started)
            measured = f"  bubble {bubble:.1%} (measured)" if bubble == bubble else ""  # nan until a traced step
            print(f"step {step:4d}  loss {loss:.3f}  {rate:8.0f} tokens/s{measured}", flush=True)
        done = step + 1
        if args.checkpoint_every and (done % args.checkpoint_every == 0 or done == args.steps):
            writing = engine.save(args.out, optimizer, background=done < args.steps, step=done, **resumable)
    say(
        f"sampling {args.sample_chars} characters after 'def ' ({args.sample_chars} eval_steps through the "
        "pipeline)...",
        flush=True,
    )
    generate(engine, args, device)
    if talk and timeline is not None:
        os.makedirs(args.out, exist_ok=True)
        timeline.plot(f"{args.out}/timeline.png", title=f"{args.schedule}, last step, measured")
        timeline.to_chrome_trace(f"{args.out}/timeline.json")
        print(f"wrote {args.out}/timeline.png and {args.out}/timeline.json")


@torch.no_grad()
def generate(engine: PipelineEngine, args: argparse.Namespace, device: torch.device) -> None:
    """Sample one line per micro-batch: each character is an eval_step through the whole pipeline."""
    engine.eval()
    context = torch.tensor([[INDEX[c] for c in "def "]] * args.microbatches)
    draw = torch.Generator(device=device).manual_seed(1)
    last = engine.schedule.placement[-1]
    for _ in range(args.sample_chars):
        logits = engine.eval_step(context[:, -args.context :] if engine.first else None)
        chosen = torch.zeros(args.microbatches, dtype=torch.int64, device=device)
        if logits is not None:
            probabilities = F.softmax(logits[:, -1] / 0.8, dim=-1)
            chosen = torch.multinomial(probabilities, 1, generator=draw).squeeze(1)
        dist.broadcast(chosen, group_src=last, group=engine.group)  # the last stage's choice: everyone's next input
        context = torch.cat([context, chosen.cpu()[:, None]], dim=1)
    engine.train()
    if dist.get_rank() == 0:
        for line in context[:3].tolist():
            print("sample:", repr("".join(VOCAB[i] for i in line)))


def parser() -> argparse.ArgumentParser:
    """The command line; --help shows each default. Under torchrun, --ranks defaults to its processes per node."""
    made = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = made.add_argument
    add(
        "--ranks",
        type=int,
        default=int(os.environ.get("LOCAL_WORLD_SIZE", RANKS)),
        help="processes on this machine (under torchrun: its --nproc-per-node)",
    )
    add("--data-parallel", type=int, default=1, help="replicas of the pipeline")
    add("--tensor-parallel", type=int, default=1, help="ranks a stage's blocks are split over")
    add("--schedule", default=SCHEDULE, choices=list(SCHEDULES), help="the pipeline schedule")
    add("--steps", type=int, default=STEPS, help="optimizer steps")
    add("--layers", type=int, default=LAYERS, help="transformer blocks")
    add("--width", type=int, default=WIDTH, help="the model's width")
    add("--heads", type=int, default=HEADS, help="attention heads")
    add("--context", type=int, default=CONTEXT, help="characters a row")
    add("--batch", type=int, default=BATCH, help="rows a step, all replicas together")
    add("--microbatches", type=int, default=MICROBATCHES, help="micro-batches a step")
    add("--sample-chars", type=int, default=120, help="characters sampled at the end")
    add("--device", choices=["cpu", "cuda"], help="default: CUDA when there is a GPU per rank")
    add("--out", default=OUT, help="folder of the timeline and the checkpoints")
    add("--log-every", type=int, default=LOG_EVERY, help="steps between printed lines")
    add(
        "--checkpoint-every",
        type=int,
        default=0,
        help="steps between checkpoints (0: none); a run with the same --out resumes from the latest",
    )
    add("--max-restarts", type=int, default=0, help="times every rank starts again after a failure")
    return made


if __name__ == "__main__":
    arguments = parser().parse_args()
    launch(main, arguments.ranks, args=(arguments,), device=arguments.device, max_restarts=arguments.max_restarts)
