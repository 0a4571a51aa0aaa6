"""Eager against torch.compile'd stages (compile=True) for the GPT example, on 2 and 4 gloo ranks.

    python benchmarks/compile.py                              # 1f1b and zb-h1, 2 and 4 ranks, width 256, m=8
    python benchmarks/compile.py --ranks 2 --schedules zb-h1 --rounds 9

Per point, one world of fresh ranks builds two engines over the same weights: eager, and compile=True (inductor,
each layer of every stage compiled in place). Their losses are checked equal (to float32 rounding). The compiled
engine's first step, which compiles, is timed apart (the compile time, less an eager step); then both are timed
in alternating rounds of steps (medians), so both see the same machine. Reports the step times and their ratio
(eager / compiled: above 1.0, compiling gains). Writes out/bench/compile.{json,txt}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import arguments, median, run_point, save_row, timed, write_report

from pipeengine import PipelineEngine

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import train_gpt  # noqa: E402  (the example's GPT: embedding, pre-norm blocks, head)

THREADS, WIDTH, HEADS, BLOCKS, LENGTH, BATCH, MICROBATCHES, ROUNDS, STEPS = 1, 256, 8, 4, 64, 32, 8, 5, 2
SCHEDULES = ["1f1b", "zb-h1"]


def worker(schedule: str, args: argparse.Namespace, path: str) -> None:
    def build(compile: bool) -> PipelineEngine:
        torch.manual_seed(0)  # the same weights on every rank, and for both engines
        model = train_gpt.gpt(args.blocks, args.width, HEADS, LENGTH)
        return PipelineEngine(
            model,
            train_gpt.summed_loss,
            num_microbatches=args.microbatches,
            schedule=schedule,
            partition="uniform",
            loss_count=train_gpt.real_tokens,
            compile={"backend": args.backend} if compile else False,
        )

    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, len(train_gpt.VOCAB), (args.batch, LENGTH), generator=generator)
    y = torch.randint(0, len(train_gpt.VOCAB), (args.batch, LENGTH), generator=generator)
    eager, compiled = build(False), build(True)

    def stepper(engine: PipelineEngine) -> object:
        def step() -> float:
            loss = engine.train_step(x if engine.first else None, y if engine.last else None)
            engine.zero_grad()
            return loss

        return step

    eager_step, compiled_step = stepper(eager), stepper(compiled)
    eager_loss = eager_step()  # type: ignore[operator]
    started = time.perf_counter()
    compiled_loss = compiled_step()  # type: ignore[operator]
    first = _slowest(time.perf_counter() - started)
    if abs(eager_loss - compiled_loss) > 1e-4 * abs(eager_loss):
        raise AssertionError(f"{schedule}: the compiled stages' loss {compiled_loss} differs from eager {eager_loss}")
    for _ in range(2):
        eager_step(), compiled_step()  # type: ignore[operator]
    eager_s: list[float] = []
    compiled_s: list[float] = []
    for _ in range(args.rounds):
        eager_s += [timed(eager_step) for _ in range(args.steps)]  # type: ignore[arg-type]
        compiled_s += [timed(compiled_step) for _ in range(args.steps)]  # type: ignore[arg-type]
    if dist.get_rank() == 0:
        save_row(
            path,
            {
                "schedule": schedule,
                "ranks": dist.get_world_size(),
                "eager_ms": 1e3 * median(eager_s),
                "compiled_ms": 1e3 * median(compiled_s),
                "ratio": median(eager_s) / median(compiled_s),
                "compile_s": first - median(eager_s),
                "backend": args.backend,
            },
        )


def _slowest(seconds: float) -> float:
    tensor = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def main() -> None:
    parser = arguments(
        __doc__,
        SCHEDULES,
        width=WIDTH,
        blocks=BLOCKS,
        batch=BATCH,
        microbatches=MICROBATCHES,
        rounds=ROUNDS,
        steps=STEPS,
        threads=THREADS,
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (default: %(default)s)")
    args = parser.parse_args()
    rows, lines = [], []
    for ranks in args.ranks:
        for schedule in args.schedules:
            row = run_point(worker, ranks, (schedule, args), args.threads)
            rows.append(row)
            line = (
                f"{ranks} ranks {schedule:6}  eager {row['eager_ms']:7.1f} ms  compiled {row['compiled_ms']:7.1f} "  # type: ignore[index]
                f"ms  -> {row['ratio']:.2f}x   compile {row['compile_s']:.1f} s (first step, less an eager one)"
            )  # type: ignore[index]
            lines.append(line)
            print(line, flush=True)
    write_report("compile", rows, lines)


if __name__ == "__main__":
    main()
