"""GPipe vs 1F1B vs interleaved 1F1B on 2 and 4 ranks: throughput, bubble, memory, and each one's timeline.

    python benchmarks/compare_schedules.py                 # 8 x Linear(1024), batch 256, m=8, 1 thread per rank
    python benchmarks/compare_schedules.py --ranks 2 --steps 6

(Not named schedules.py: a script of that name in benchmarks/ would shadow the schedules
package for every script run from this directory.)

Fresh ranks per point. Writes out/bench/schedules.json and one figure per rank count with
the measured timeline of each schedule on one time axis (out/bench/schedules_p{N}.png).
"""

from __future__ import annotations

import argparse

import torch
from common import OUT, arguments, measure, mlp, run_point, save_row, write_json

from pipeengine import PipelineEngine
from schedules import plot_timelines

RANKS, THREADS, WIDTH, LAYERS, BATCH, MICROBATCHES, STEPS = [2, 4], 1, 1024, 8, 256, 8, 4
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min"]


def worker(schedule: str, args: argparse.Namespace, path: str) -> None:
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    engine = PipelineEngine(
        mlp(args.width, args.layers),
        torch.nn.functional.mse_loss,
        num_microbatches=args.microbatches,
        schedule=schedule,
        partition="uniform",
        sample=x,
    )
    row = measure(engine, x, y, args.steps)
    if row is not None:
        timeline = min(engine.last_timelines, key=lambda t: t.makespan)  # type: ignore[attr-defined]
        save_row(path, ({"schedule": schedule, "ranks": engine.schedule.num_ranks, **row}, timeline))


def main() -> None:
    parser = arguments(
        __doc__,
        SCHEDULES,
        threads=THREADS,
        width=WIDTH,
        layers=LAYERS,
        batch=BATCH,
        microbatches=MICROBATCHES,
        steps=STEPS,
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=RANKS)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for ranks in args.ranks:
        timelines, titles = [], []
        for schedule in args.schedules:
            row, timeline = run_point(worker, ranks, (schedule, args), args.threads)  # type: ignore[misc]
            rows.append(row)
            timelines.append(timeline)
            titles.append(f"{schedule}, {ranks} ranks, measured (the fastest traced step)")
            print(
                f"{ranks} ranks {schedule:12} step {row['step_ms']:7.1f} ms  {row['samples_per_s']:6.0f} samples/s  "
                f"bubble {row['measured_bubble']:.1%} (simulated {row['predicted_bubble']:.1%})  "
                f"peak memory {row['peak_mb']:.1f} MiB (predicted {row['predicted_peak_mb']:.1f}), "
                f"peak RSS {row['peak_rss_mb']:.0f} MiB",
                flush=True,
            )
        plot_timelines(timelines, str(OUT / f"schedules_p{ranks}.png"), titles=titles)
    print(f"wrote {write_json('schedules', rows)} and {OUT}/schedules_p*.png")


if __name__ == "__main__":
    main()
