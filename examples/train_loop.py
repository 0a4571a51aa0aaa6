"""A training loop to copy: your model and data on a pipeline (and replicas of it), logged, and resumable.

    python examples/train_loop.py                          # 2 ranks (processes), 1F1B, 100 steps into out/loop
    python examples/train_loop.py --steps 200              # the same --out again: resumes at step 100, goes on
    python examples/train_loop.py --ranks 4 --data-parallel 2 --schedule zb-h1
    python examples/train_loop.py --in-process             # the ranks as threads of one process (debugging, tests)

Every --log-every steps rank 0 prints the loss, the samples and tokens a second since its last line, the most
memory a rank of its pipeline held and the bubble of a traced step (the one just before the line); a progress bar
on stderr (a terminal only) counts the steps between. Every --checkpoint-every steps, and at the end, it saves
into --out in the background (model, optimizer, LR schedule, the data's position): run again with the same --out,
it resumes from the latest checkpoint as if it had never stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

from pipeengine import PipelineEngine, ReplicaLoader, latest_checkpoint, launch
from schedules import SCHEDULES


class Sequences(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """CHANGE: your dataset. Here made-up token sequences: each token is a fixed permutation of the one before (one
    in ten at random), and the target of each position is the next token. The same on every rank (its seed)."""

    def __init__(self, samples: int, length: int, vocab: int, seed: int = 0) -> None:
        draw = torch.Generator().manual_seed(seed)
        follows = torch.randperm(vocab, generator=draw)
        rows = [torch.randint(0, vocab, (samples,), generator=draw)]
        for _ in range(length):
            noise = torch.rand(samples, generator=draw) < 0.1
            rows.append(torch.where(noise, torch.randint(0, vocab, (samples,), generator=draw), follows[rows[-1]]))
        self.tokens = torch.stack(rows, dim=1)  # (samples, length + 1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i, :-1], self.tokens[i, 1:]  # (input, target): the target is the input shifted by one


def model(vocab: int, width: int, layers: int) -> nn.Sequential:
    """CHANGE: your model, as an nn.Sequential: the engine cuts it between its entries into stages."""
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    return nn.Sequential(nn.Embedding(vocab, width), *blocks, nn.Linear(width, vocab))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # CHANGE: your loss (a mean)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train(args: argparse.Namespace) -> None:
    """What every rank runs."""
    data = Sequences(args.samples, args.length, args.vocab)
    torch.manual_seed(0)  # the same model on every rank: each keeps only its stages
    engine = PipelineEngine(
        model(args.vocab, args.width, args.layers),
        loss_fn,
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        data_parallel=args.data_parallel,
    )
    optimizer = torch.optim.AdamW(engine.parameters(), lr=args.lr)  # CHANGE: your optimizer and LR schedule
    # a warmup, then constant: a schedule that does not depend on --steps, so that a run resumed with more steps is
    # the longer run (a cosine over --steps would make the first run's steps another run's)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup))
    # --batch rows a step, all replicas together: each replica reads its share
    loader = ReplicaLoader(data, batch_size=args.batch, replicas=engine.data_parallel, rank=engine.dp_rank)
    state = {"scheduler": scheduler, "data": loader}  # what a checkpoint holds beside the model and optimizer
    start = engine.load(args.out, optimizer, **state)["step"] if latest_checkpoint(args.out) else 0
    talk = engine.dp_rank == 0 and engine.pp_rank == 0  # rank 0: it prints, and it gets the traced timeline
    if talk:
        print(
            f"{engine.data_parallel} replica(s) of a {engine.schedule.num_ranks}-rank pipeline, {args.schedule}, "
            + (f"resumed at step {start}" if start else "from step 0"),
            engine.partition,
            sep="\n",
            flush=True,
        )
    batches = loader.forever()  # from where the run is, epoch after epoch
    since, losses, loss = time.perf_counter(), [], float("nan")
    for step in range(start, args.steps):
        x, y = next(batches)
        traced = (step + 1) % args.log_every == 0 or step + 1 == args.steps  # the step before each line
        with engine.tracing(optimizer) if traced else contextlib.nullcontext():
            loss = engine.train_step(x if engine.first else None, y if engine.last else None)  # the mean loss
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss)
        if talk and traced:
            seconds, timeline = time.perf_counter() - since, engine.timeline()  # this pipeline's (replica 0's)
            samples = len(losses) * args.batch  # every replica's: the global batch (the traced step's time included)
            progress(0, 1, "")  # the bar's line, cleared
            peak = max(timeline.peak_memory) / 2**20  # the most a rank held (weights, gradients, AdamW's, activations)
            print(
                f"step {step + 1:5d}  loss {sum(losses) / len(losses):.4f}  {samples / seconds:8.1f} samples/s  "
                f"{samples * args.length / seconds:9.0f} tokens/s  peak {peak:7.2f} MiB  "
                f"bubble {timeline.bubble_fraction:.1%}",
                flush=True,
            )
        elif talk:
            progress(len(losses), args.log_every, f"step {step + 1} of {args.steps}")
        if traced:
            since, losses = time.perf_counter(), []
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:  # written while the next steps run
            engine.save(args.out, optimizer, background=True, step=step + 1, **state)
    if talk:
        print(
            f"final loss {loss:.6f} at step {args.steps}"
            if start < args.steps
            else f"at step {start} already: nothing to train (--steps {args.steps})",
            flush=True,
        )


def progress(done: int, total: int, label: str) -> None:
    """A bar of the steps between two log lines on stderr, redrawn in place (label "": the line cleared); nothing
    when stderr is not a terminal."""
    if sys.stderr.isatty():
        filled = 30 * done // total
        bar = f"[{'#' * filled}{'.' * (30 - filled)}] {label}" if label else ""
        print(f"\r\033[K{bar}", end="", file=sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    """The command line; --help shows each default."""
    made = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = made.add_argument
    add("--ranks", type=int, default=2, help="ranks: data-parallel replicas x pipeline stages")
    add("--data-parallel", type=int, default=1, help="replicas of the pipeline")
    add("--schedule", default="1f1b", choices=list(SCHEDULES), help="the pipeline schedule")
    add("--microbatches", type=int, default=4, help="micro-batches a step, per replica")
    add("--steps", type=int, default=100, help="optimizer steps in all (a resumed run goes on to it)")
    add("--batch", type=int, default=64, help="samples a step, all replicas together")
    add("--lr", type=float, default=3e-3, help="AdamW's learning rate, after the warmup")
    add("--warmup", type=int, default=10, help="steps of linear LR warmup")
    add("--samples", type=int, default=4096, help="samples in the toy dataset")
    add("--length", type=int, default=32, help="tokens a sample")
    add("--vocab", type=int, default=64, help="the toy language's tokens")
    add("--width", type=int, default=128, help="the model's width")
    add("--layers", type=int, default=6, help="hidden layers (with the embedding and the head: the stages' layers)")
    add("--log-every", type=int, default=10, help="steps between printed lines (the last of each is traced)")
    add("--checkpoint-every", type=int, default=50, help="steps between checkpoints (and one at the end)")
    add("--out", default="out/loop", help="the checkpoints' folder: a run with the same --out resumes")
    add("--device", choices=["cpu", "cuda"], help="default: CUDA when there is a GPU per rank")
    add("--in-process", action="store_true", help="run the ranks as threads of this process (CPU)")
    return made


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    launch(train, args.ranks, args=(args,), device=args.device, in_process=args.in_process)


if __name__ == "__main__":
    main()
