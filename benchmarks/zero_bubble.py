"""Do the zero-bubble schedules pay? ZB-H1 and ZB-V against 1F1B, alternating in one set of ranks (issue 61).

    python benchmarks/zero_bubble.py                       # 8 x Linear(1024), batch 256, m=8, 2 and 4 ranks
    python benchmarks/zero_bubble.py --ranks 2 --rounds 5 --width 256

compare_schedules.py launches fresh ranks per schedule, one after the other, so a slow minute of this shared machine
falls on whichever schedule ran then (four of its runs put 1F1B at 142-168 ms a step on 2 ranks). Here one set of
ranks builds an engine per schedule on the same weights and batch, and each round runs ``--steps`` steps of each, the
order rotated from one round to the next; the figure is each schedule's median step and its ratio to 1F1B's in the
same rounds (above 1: faster than 1F1B). Writes out/bench/zero_bubble.{json,txt}.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from common import OUT, arguments, median, mlp, run_point, save_row, timed, write_report

from pipeengine import PipelineEngine

RANKS, THREADS, WIDTH, LAYERS, BATCH, MICROBATCHES, ROUNDS, STEPS = [2, 4], 1, 1024, 8, 256, 8, 9, 3
SCHEDULES = ["1f1b", "zb-h1", "zb-v"]


def worker(args: argparse.Namespace, path: str) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    engines = {
        name: PipelineEngine(
            mlp(args.width, args.layers),
            torch.nn.functional.mse_loss,
            num_microbatches=args.microbatches,
            schedule=name,
            partition="uniform",
        )
        for name in args.schedules
    }

    def step(engine: PipelineEngine) -> float:
        loss = engine.train_step(x if engine.first else None, y if engine.last else None)
        engine.zero_grad()
        return loss

    losses = {name: step(engine) for name, engine in engines.items()}  # the first step of each warms it up too
    if len({round(loss, 5) for loss in losses.values()}) != 1:
        raise RuntimeError(f"the schedules' losses differ on the same weights and batch: {losses}")
    for engine in engines.values():  # warm-up
        step(engine)
    times: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            times[name] += [timed(lambda e=engines[name]: step(e)) for _ in range(args.steps)]
    if dist.get_rank() == 0:
        save_row(path, {name: median(values) for name, values in times.items()})


def main() -> None:
    parser = arguments(
        __doc__,
        SCHEDULES,
        threads=THREADS,
        width=WIDTH,
        layers=LAYERS,
        batch=BATCH,
        microbatches=MICROBATCHES,
        rounds=ROUNDS,
        steps=STEPS,
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=RANKS)
    args = parser.parse_args()
    if "1f1b" not in args.schedules:
        parser.error("--schedules must include 1f1b: the others are measured against it")
    OUT.mkdir(parents=True, exist_ok=True)
    rows, lines = [], []
    for ranks in args.ranks:
        medians = run_point(worker, ranks, (args,), args.threads)
        for name, seconds in medians.items():  # type: ignore[attr-defined]
            ratio = medians["1f1b"] / seconds  # type: ignore[index]
            rows.append(
                {
                    "ranks": ranks,
                    "schedule": name,
                    "step_ms": round(seconds * 1e3, 2),
                    "speed_over_1f1b": round(ratio, 3),
                    "width": args.width,
                    "rounds": args.rounds,
                    "steps": args.steps,
                }
            )
            lines.append(f"{ranks} ranks {name:6} step {seconds * 1e3:7.1f} ms  {ratio:.3f}x 1F1B's speed")
            print(lines[-1], flush=True)
    write_report("zero_bubble", rows, lines)


if __name__ == "__main__":
    main()
