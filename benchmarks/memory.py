"""Memory: each rank's peak bytes in a step, predicted by the simulator and measured, for every schedule.

    python benchmarks/memory.py                            # 2 and 4 ranks, 8 x Linear(256), batch 4096, m=8
    python benchmarks/memory.py --ranks 4 --schedules 1f1b zb-v

Fresh gloo ranks per point train one step with AdamW (so its two moments exist), then trace one:
every rank measures its stages' sizes on the step's first micro-batch and the bytes it holds
after every instruction (schedules.memory's quantities: the weights, their gradients and the
optimizer's copies, activations kept for backward, buffers, gradients in flight). The prediction
is schedules.simulate of the program that ran, fed those sizes. At this width a micro-batch's
activations outweigh the weights, so the peaks are mostly activations. Writes
out/bench/memory.{json,txt,png}.
"""

from __future__ import annotations

import argparse

import torch
from common import OUT, arguments, mlp, run_point, save_row, write_json

from pipeengine import PipelineEngine

RANKS, THREADS, WIDTH, LAYERS, BATCH, MICROBATCHES = [2, 4], 1, 256, 8, 4096, 8
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min"]
CHECKPOINTING = ["never", "always"]


def worker(schedule: str, checkpoint: str, args: argparse.Namespace, path: str) -> None:
    from schedules import Costs, simulate

    torch.manual_seed(0)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    engine = PipelineEngine(mlp(args.width, args.layers), torch.nn.functional.mse_loss,
                            num_microbatches=args.microbatches, schedule=schedule, partition="uniform",
                            checkpoint=checkpoint)  # fmt: skip
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    optimizer.step()
    with engine.tracing(optimizer):
        engine.train_step(x if engine.first else None, y if engine.last else None)
    timeline = engine.timeline()
    if timeline is not None and timeline.sizes is not None:
        predicted = simulate(engine.last_program, Costs.from_timeline(timeline))  # type: ignore[arg-type]
        state = [sum(timeline.sizes.state[s] for s in engine.schedule.stages_of(r))  # type: ignore[index]
                 for r in range(engine.schedule.num_ranks)]  # fmt: skip
        save_row(path, {"schedule": schedule, "ranks": engine.schedule.num_ranks, "checkpoint": checkpoint,
                        "measured": timeline.peak_memory, "predicted": predicted.peak_memory, "state": state,
                        "peak_at": [str(a) for a in timeline.peak_actions]})  # fmt: skip


def plot(rows: list[dict[str, object]], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = sorted({(int(r["ranks"]), str(r["checkpoint"])) for r in rows})  # type: ignore[call-overload]
    figure = Figure(figsize=(12, 3.2 * len(panels)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, squeeze=False)[:, 0]
    for axis, (ranks, checkpoint) in zip(axes, panels, strict=True):
        mine = [r for r in rows if r["ranks"] == ranks and r["checkpoint"] == checkpoint]
        labels, measured, predicted = [], [], []
        for row in mine:
            for rank in range(ranks):
                labels.append(f"{row['schedule']}\nrank {rank}" if rank == 0 else f"rank {rank}")
                measured.append(row["measured"][rank] / 2**20)  # type: ignore[index]
                predicted.append(row["predicted"][rank] / 2**20)  # type: ignore[index]
        places = range(len(labels))
        axis.bar([i - 0.2 for i in places], measured, width=0.4, label="measured", color="#4C72B0")
        axis.bar([i + 0.2 for i in places], predicted, width=0.4, label="predicted", color="#DD8452")
        axis.set_xticks(list(places), labels, fontsize=7)
        axis.set_ylabel("peak MB")
        axis.set_title(f"{ranks} ranks, activation checkpointing: {checkpoint}", fontsize=10, loc="left")
        axis.legend(fontsize=8)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = arguments(__doc__, SCHEDULES, threads=THREADS, width=WIDTH, layers=LAYERS, batch=BATCH,
                       microbatches=MICROBATCHES)  # fmt: skip
    parser.add_argument("--ranks", type=int, nargs="+", default=RANKS)
    parser.add_argument("--checkpoint", nargs="+", default=CHECKPOINTING)
    args = parser.parse_args()
    rows, lines = [], []
    header = f"{'schedule':12} {'ranks':>5} {'checkpoint':>10}  per rank: measured / predicted MB (ratio)"
    print(header, flush=True)
    for ranks in args.ranks:
        for checkpoint in args.checkpoint:
            for schedule in args.schedules:
                row = run_point(worker, ranks, (schedule, checkpoint, args), args.threads)
                rows.append(row)
                cells = "  ".join(f"{m / 2**20:6.2f} / {p / 2**20:6.2f} ({p / m:.3f})"
                                  for m, p in zip(row["measured"], row["predicted"], strict=True))  # type: ignore[index]  # fmt: skip
                line = f"{schedule:12} {ranks:5d} {checkpoint:>10}  {cells}"
                lines.append(line)
                print(line, flush=True)
    write_json("memory", rows)
    (OUT / "memory.txt").write_text("\n".join([header, *lines]) + "\n")
    plot(rows, str(OUT / "memory.png"))
    print(f"wrote {OUT / 'memory.json'}, memory.txt and memory.png")


if __name__ == "__main__":
    main()
