"""The smallest complete pipeengine program: an MLP on 2 CPU ranks learns a function, its loss printed falling.

python examples/quickstart.py
python examples/quickstart.py --ranks 4 --schedule interleaved --steps 20
python examples/quickstart.py --in-process      # the ranks as threads of one process: one debugger for all
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
from torch import nn

from pipeengine import PipelineEngine, launch
from schedules import SCHEDULES

RANKS, SCHEDULE, MICROBATCHES, STEPS, BATCH, WIDTH, BATCHES, LEARNING_RATE = 2, "1f1b", 4, 10, 64, 64, 4, 1e-2


def main(schedule: str, microbatches: int, steps: int, timeline: str | None) -> None:
    torch.manual_seed(0)  # the same model on every rank; each keeps only its stages
    model = nn.Sequential(
        *(layer for _ in range(4) for layer in (nn.Linear(WIDTH, WIDTH), nn.ReLU())), nn.Linear(WIDTH, 1)
    )
    data = torch.Generator().manual_seed(1)  # the same data on every rank: a small training set, a function of it
    inputs = torch.randn(BATCHES * BATCH, WIDTH, generator=data)
    targets = inputs @ torch.randn(WIDTH, 1, generator=data) / WIDTH**0.5  # a linear function to learn
    engine = PipelineEngine(
        model, nn.functional.mse_loss, num_microbatches=microbatches, schedule=schedule, sample=inputs[:BATCH]
    )  # sample: an example batch, on which the layers are timed to cut the stages
    if engine.pp_rank == 0:
        print(engine.partition, flush=True)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=LEARNING_RATE)
    for step in range(steps):
        x, y = inputs.split(BATCH)[step % BATCHES], targets.split(BATCH)[step % BATCHES]
        with engine.tracing() if timeline and step == steps - 1 else contextlib.nullcontext():
            loss = engine.train_step(x if engine.first else None, y if engine.last else None)
        optimizer.step()
        optimizer.zero_grad()
        if engine.pp_rank == 0:
            print(f"step {step:3d}  loss {loss:.4f}  ({schedule}, {engine.schedule.num_ranks} ranks)", flush=True)
    measured = engine.timeline()  # rank 0 only, and only after a traced step
    if timeline and measured is not None:
        os.makedirs(os.path.dirname(timeline) or ".", exist_ok=True)
        measured.plot(f"{timeline}.png")
        measured.to_chrome_trace(f"{timeline}.json")
        print(f"measured bubble {measured.bubble_fraction:.1%}: wrote {timeline}.png and {timeline}.json")


def parser() -> argparse.ArgumentParser:
    """The command line; --help shows each default."""
    made = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    made.add_argument("--ranks", type=int, default=RANKS, help="processes, one stage each")
    made.add_argument("--schedule", default=SCHEDULE, choices=list(SCHEDULES), help="the pipeline schedule")
    made.add_argument("--microbatches", type=int, default=MICROBATCHES, help="micro-batches a step")
    made.add_argument("--steps", type=int, default=STEPS, help="optimizer steps")
    made.add_argument("--timeline", help="write the last step's measured timeline to PATH.png and PATH.json")
    made.add_argument("--in-process", action="store_true", help="run the ranks as threads of this process (debugging)")
    return made


def cli(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    launch(
        main, args.ranks, args=(args.schedule, args.microbatches, args.steps, args.timeline), in_process=args.in_process
    )


if __name__ == "__main__":
    cli()
