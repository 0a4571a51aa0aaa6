"""Tensor parallel inside the pipeline, side by side with torch.distributed.pipelining: pp=2 x tp=2 on 4 gloo ranks.

    python benchmarks/vs_torch_tp.py                       # 1f1b and gpipe, GPT blocks of width 256, m=8
    python benchmarks/vs_torch_tp.py --schedules 1f1b --rounds 9

torch's side is torchtitan's recipe: each stage module (the same layers this engine's partition gives the
rank) parallelized with parallelize_module on the tensor-parallel sub-mesh with the same plan, then a
PipelineStage over the pipeline group and torch's schedule. Both start from the same weights; their losses
are checked equal, then they are timed in alternating rounds (medians) so both see the same machine, and
each rank's peak memory in a step is watched by the allocator (what was live at its start, plus the most it
allocated). Reports the step-time ratio (torch / pipeengine: above 1.0, this engine is faster) and the
peaks. Writes out/bench/vs_torch_tp.{json,txt}.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from common import arguments, run_point, save_row, side_by_side, side_by_side_line, time_and_watch, write_report
from torch import nn
from torch.nn import functional as F

from pipeengine import PipelineEngine

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import train_gpt  # noqa: E402  (the example's GPT: its blocks lay qkv out head by head, and its TP plan)
from train_gpt import Block, Embed, Head, tensor_parallel_plan  # noqa: E402

RANKS, THREADS, WIDTH, HEADS, BLOCKS, LENGTH, BATCH, MICROBATCHES, ROUNDS, STEPS = 4, 1, 256, 8, 4, 64, 32, 8, 7, 2
VOCAB = len(train_gpt.VOCAB)
SCHEDULES = ["gpipe", "1f1b"]


def gpt(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        Embed(args.width, LENGTH), *[Block(args.width, HEADS) for _ in range(args.blocks)], Head(args.width)
    )


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def torch_pipeline(schedule: str, engine: PipelineEngine, model: nn.Sequential, args: argparse.Namespace) -> object:
    """torchtitan's recipe over the same stages: parallelize_module, then PipelineStage and torch's schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor.parallel import parallelize_module

    from pipeengine.core.bounds import stage_module
    from pipeengine.parallel.tensor import plan_matches

    stage = engine.pp_rank
    module = stage_module(model, *engine.bounds[stage])  # the model's names, as the engine's stages have them
    names = {name for name, _ in module.named_modules()}
    mine = {name: style for name, style in plan_matches(model, tensor_parallel_plan()).items() if name in names}
    parallelize_module(module, engine.mesh["tp"], mine)  # type: ignore[index, arg-type]
    pipe = PipelineStage(module, stage, len(engine.bounds), torch.device("cpu"), group=engine.group)
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](pipe, args.microbatches, loss_fn=loss_fn)


def worker(schedule: str, args: argparse.Namespace, path: str) -> None:
    model = gpt(args)
    theirs_model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (args.batch, LENGTH), generator=generator)
    y = torch.randint(0, VOCAB, (args.batch, LENGTH), generator=generator)
    engine = PipelineEngine(
        model,
        loss_fn,
        num_microbatches=args.microbatches,
        schedule=schedule,
        partition="uniform",
        tensor_parallel=2,
        tp_plan=tensor_parallel_plan(),
    )
    theirs = torch_pipeline(schedule, engine, theirs_model, args)
    mine = list(engine.parameters())
    their_params = [p for p in theirs._stage.submod.parameters()]  # type: ignore[attr-defined]

    ours, torch_step = side_by_side(engine, theirs, x, y, engine.first, engine.last)

    ours_loss, their_loss = ours(), torch_step()
    if their_loss is not None and abs(ours_loss - their_loss) > 1e-4 * abs(ours_loss):
        raise AssertionError(f"{schedule}: this engine's loss {ours_loss} differs from torch's {their_loss}")
    row = time_and_watch(ours, torch_step, mine, their_params, args.rounds, args.steps)
    if dist.get_rank() == 0:
        save_row(path, {"schedule": schedule, **row})


def main() -> None:
    args = arguments(
        __doc__,
        SCHEDULES,
        choices=True,
        width=WIDTH,
        blocks=BLOCKS,
        batch=BATCH,
        microbatches=MICROBATCHES,
        rounds=ROUNDS,
        steps=STEPS,
        threads=THREADS,
    ).parse_args()
    rows, lines = [], []
    for schedule in args.schedules:
        row = run_point(worker, RANKS, (schedule, args), args.threads)
        rows.append(row)
        line = side_by_side_line(f"{schedule:6}", row)
        lines.append(line)
        print(line, flush=True)
    write_report("vs_torch_tp", rows, lines)


if __name__ == "__main__":
    main()
