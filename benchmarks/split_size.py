"""Split-size trade-off: step time, throughput, bubble and memory against the number of micro-batches.

    python benchmarks/split_size.py                        # 2 ranks, 1 thread, 8 x Linear(1024), batch 256
    python benchmarks/split_size.py --ranks 4 --microbatches 1 2 4 8 16

For every schedule and split size (as in PyTorch's model-parallel tutorial), fresh ranks
measure the median step time, the measured bubble and peak memory (process RSS), and the
simulator's prediction from the costs measured at that point. Writes
out/bench/split_size.{json,csv,png}: throughput and memory against split size, predicted
dashed beside measured.
"""

from __future__ import annotations

import argparse
import csv
import json

import torch
from common import OUT, arguments, measure, mlp, run_point, save_row, write_json

from pipeengine import PipelineEngine

RANKS, THREADS, WIDTH, LAYERS, BATCH, STEPS = 2, 1, 1024, 8, 256, 4
MICROBATCHES = [1, 2, 4, 8, 16, 32]
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min"]


def worker(schedule: str, m: int, args: argparse.Namespace, path: str) -> None:
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    engine = PipelineEngine(
        mlp(args.width, args.layers),
        torch.nn.functional.mse_loss,
        num_microbatches=m,
        schedule=schedule,
        partition="uniform",
        sample=x,
    )  # (sample: activation bytes)
    row = measure(engine, x, y, args.steps)
    if row is not None:
        save_row(path, {"schedule": schedule, "microbatches": m, **row})


def plot(rows: list[dict[str, float | str]], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    speed, memory = figure.subplots(1, 2)
    held = memory.twinx()  # the engine's bytes are MiB where the process is 100s of MiB: their own scale
    for index, schedule in enumerate(dict.fromkeys(r["schedule"] for r in rows)):
        mine = [r for r in rows if r["schedule"] == schedule]
        ms = [r["microbatches"] for r in mine]
        colour = f"C{index}"
        speed.plot(ms, [r["samples_per_s"] for r in mine], "o-", color=colour, label=f"{schedule} measured")
        speed.plot(
            ms,
            [float(r["samples_per_s"]) * float(r["step_ms"]) / float(r["predicted_ms"]) for r in mine],
            "--",
            color=colour,
            label=f"{schedule} predicted",
        )
        memory.plot(ms, [r["rss_growth_mb"] for r in mine], "o-", color=colour, label=f"{schedule} RSS growth")
        held.plot(ms, [r["peak_mb"] for r in mine], "s:", color=colour, label=f"{schedule} peak held (measured)")
        held.plot(
            ms, [r["predicted_peak_mb"] for r in mine], "--", color=colour, label=f"{schedule} peak held (predicted)"
        )
    for axis, label in ((speed, "throughput (samples/s)"), (memory, "process RSS growth, busiest rank (MiB), solid")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("micro-batches per step (split size)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    held.set_ylabel("most MiB a rank holds (schedules.memory)")
    speed.legend(fontsize=8)
    memory.legend(fontsize=7, loc="upper left")
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = arguments(
        __doc__, SCHEDULES, ranks=RANKS, threads=THREADS, width=WIDTH, layers=LAYERS, batch=BATCH, steps=STEPS
    )
    parser.add_argument("--microbatches", type=int, nargs="+", default=MICROBATCHES)
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the saved JSON, no runs")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((OUT / "split_size.json").read_text()), str(OUT / "split_size.png"))
        print(f"wrote {OUT}/split_size.png")
        return
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for schedule in args.schedules:
        for m in args.microbatches:
            if schedule == "interleaved" and m % args.ranks:
                continue
            r = run_point(worker, args.ranks, (schedule, m, args), args.threads)
            rows.append(r)
            print(
                f"{schedule:12} m={m:3d}  step {r['step_ms']:7.1f} ms (predicted {r['predicted_ms']:7.1f})  "
                f"{r['samples_per_s']:6.0f} samples/s  bubble {r['measured_bubble']:.1%} "
                f"(predicted {r['predicted_bubble']:.1%})  RSS +{r['rss_growth_mb']:.0f} MiB, activations "
                f"{r['peak_mb']:.1f} MiB held ({r['predicted_peak_mb']:.1f} predicted)",
                flush=True,
            )
    for schedule in args.schedules:
        mine = [r for r in rows if r["schedule"] == schedule]
        best = min(mine, key=lambda r: r["step_ms"])["microbatches"]
        predicted = min(mine, key=lambda r: r["predicted_ms"])["microbatches"]
        print(f"{schedule}: fastest split size measured {best}, predicted {predicted}")
    write_json("split_size", rows)
    with (OUT / "split_size.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, str(OUT / "split_size.png"))
    print(f"wrote {OUT}/split_size.json, .csv and .png")


if __name__ == "__main__":
    main()
