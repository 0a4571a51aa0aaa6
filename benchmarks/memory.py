"""Memory: each rank's peak bytes, as the ledger counts them, as the allocator sees them, and as predicted.

    python benchmarks/memory.py                            # both models, 2 and 4 ranks, every schedule, m=8
    python benchmarks/memory.py --models activations --ranks 4 --schedules 1f1b zb-v

Fresh gloo ranks per point train one step with AdamW (its two moments exist), zero the gradients
(set to None, as training does), then trace one step and run the optimizer step under the allocator:

    ledger      what the engine holds between instructions (schedules.sim.memory_model's quantities),
                the traced step's peak
    allocator   every allocation (torch.profiler's memory events on CPU, the caching allocator on CUDA):
                the larger of the step's peak and the optimizer step's, each on what was live at its start
    predicted   schedules.simulate of the program that ran, fed the sizes the step measured (the
                computes' transients, the sync buffers, late gradients and the optimizer step included):
                the larger of the step's peak and the optimizer step's

Two models: "activations" (the issue's blocks, 8 of Linear(256, 1024), GELU, Linear(1024, 256), batch
4096), where activations dominate, and "state" (8 blocks of Linear(1024, 1024), Tanh, batch 512), where
the weights, gradients and AdamW's moments do. Writes out/bench/memory.{json,txt,png,md} (md: docs/benchmarks.md's
tables; `--tables out/bench/memory.json` prints them again without a run). With --data-parallel 2 and
--sharding none fsdp fsdp-reshard, the first replica's pipeline reports (out/bench/memory_dp.{json,txt}), with
each rank's state (weights, gradients, AdamW's moments: sharded with fsdp):

    python benchmarks/memory.py --models state --scale 4 --ranks 4 --data-parallel 2 --checkpoint never \
        --schedules 1f1b zb-h1 --sharding none fsdp fsdp-reshard
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from common import OUT, run_point, save_row, write_json
from torch import nn

from pipeengine import PipelineEngine

RANKS, THREADS, MICROBATCHES, BLOCKS = [2, 4], 1, 8, 8
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min"]
CHECKPOINTING = ["never", "always"]
MODELS = {"activations": (256, 1024, 4096), "state": (1024, 0, 512)}  # width, hidden (0: one Linear + Tanh), batch


def model(kind: str, blocks: int, scale: int) -> tuple[nn.Sequential, int, int]:
    width, hidden, batch = MODELS[kind]
    width, hidden, batch = width // scale, hidden // scale, batch // scale
    torch.manual_seed(0)
    if hidden:
        body = [nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(blocks)]
    else:
        body = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)]
    return nn.Sequential(*body), width, batch


SHARDING = {"none": {}, "fsdp": {"fsdp": True}, "fsdp-reshard": {"fsdp": True, "reshard_after_forward": True}}


def worker(kind: str, schedule: str, checkpoint: str, sharding: str, args: argparse.Namespace, path: str) -> None:

    from pipeengine.observe.allocator import optimizer_step_peak
    from schedules import Costs, simulate

    network, width, batch = model(kind, args.blocks, args.scale)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    engine = PipelineEngine(
        network,
        nn.functional.mse_loss,
        num_microbatches=args.microbatches,
        schedule=schedule,
        partition="uniform",
        checkpoint=checkpoint,
        data_parallel=args.data_parallel,
        **SHARDING[sharding],
    )  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    optimizer.step()
    optimizer.zero_grad()
    with engine.tracing(optimizer):
        engine.train_step(x if engine.first else None, y if engine.last else None)
    stepped = engine.topology.pipeline.all_gather_object(
        optimizer_step_peak(optimizer, engine.parameters()), "the optimizer step's peak"
    )  # this pipeline's ranks
    timeline = engine.timeline()
    if (
        timeline is not None
        and timeline.sizes is not None
        and timeline.allocated_peak is not None
        and (engine.dp_rank == 0)
    ):  # (the first replica's pipeline reports)
        predicted = simulate(engine.last_program, Costs.from_timeline(timeline))  # type: ignore[arg-type]
        allocator = [max(a, b) for a, b in zip(timeline.allocated_peak, stepped, strict=True)]  # type: ignore[type-var]
        save_row(
            path,
            {
                "model": kind,
                "schedule": schedule,
                "ranks": engine.schedule.num_ranks,
                "sharding": sharding,
                "checkpoint": checkpoint,
                "ledger": timeline.peak_memory,
                "allocator": allocator,
                "predicted": predicted.required_memory,
                "step_allocator": timeline.allocated_peak,
                "optimizer_allocator": stepped,
                "state": [
                    sum(
                        timeline.sizes.state[s]  # type: ignore[index]
                        for s in engine.schedule.stages_of(r)
                    )
                    for r in range(engine.schedule.num_ranks)
                ],
            },
        )


def plot(rows: list[dict[str, object]], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = sorted({(str(r["model"]), int(r["ranks"]), str(r["checkpoint"])) for r in rows})  # type: ignore[call-overload]
    figure = Figure(figsize=(13, 3.0 * len(panels)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, squeeze=False)[:, 0]
    for axis, (kind, ranks, checkpoint) in zip(axes, panels, strict=True):
        mine = [r for r in rows if (r["model"], r["ranks"], r["checkpoint"]) == (kind, ranks, checkpoint)]
        labels, bars = [], {"ledger": [], "allocator": [], "predicted": []}  # type: ignore[var-annotated]
        for row in mine:
            for rank in range(ranks):
                labels.append(f"{row['schedule']}\nrank {rank}" if rank == 0 else f"rank {rank}")
                for name, values in bars.items():
                    values.append(row[name][rank] / 2**20)  # type: ignore[index]
        places = range(len(labels))
        for offset, (name, colour) in zip(
            (-0.27, 0.0, 0.27), (("ledger", "#8C8C8C"), ("allocator", "#4C72B0"), ("predicted", "#DD8452")), strict=True
        ):
            axis.bar([i + offset for i in places], bars[name], width=0.27, label=name, color=colour)
        axis.set_xticks(list(places), labels, fontsize=7)
        axis.set_ylabel("peak MiB")
        axis.set_title(f"{kind} model, {ranks} ranks, activation checkpointing: {checkpoint}", fontsize=10, loc="left")
        axis.legend(fontsize=8)
    figure.savefig(path, dpi=110)


def tables(rows: list[dict[str, object]], ranks: int = 4) -> str:
    """docs/benchmarks.md's tables: per model, schedule and checkpointing, each rank's allocator / predicted MiB."""
    out = []
    for kind in MODELS:
        mine = [r for r in rows if r["model"] == kind and r["ranks"] == ranks]
        if not mine:
            continue
        out += [f"{kind}:", "", '| schedule | no checkpointing | `checkpoint="always"` |', "|-|-|-|"]
        for schedule in dict.fromkeys(str(r["schedule"]) for r in mine):
            cells = []
            for checkpoint in CHECKPOINTING:
                row = next((r for r in mine if r["schedule"] == schedule and r["checkpoint"] == checkpoint), None)
                cells.append(
                    " ".join(
                        f"{a / 2**20:.1f}/{p / 2**20:.1f}"
                        for a, p in zip(row["allocator"], row["predicted"], strict=True)  # type: ignore[call-overload]
                    )
                    if row
                    else ""
                )  # type: ignore[index]
            out.append(f"| {schedule} | {cells[0]} | {cells[1]} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES)
    parser.add_argument("--ranks", type=int, nargs="+", default=RANKS)
    parser.add_argument("--checkpoint", nargs="+", default=CHECKPOINTING)
    parser.add_argument("--microbatches", type=int, default=MICROBATCHES)
    parser.add_argument("--blocks", type=int, default=BLOCKS)
    parser.add_argument("--scale", type=int, default=1, help="divide widths and batch by this (a quick run)")
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--data-parallel", type=int, default=1, help="replicas: --ranks counts them all")
    parser.add_argument(
        "--sharding",
        nargs="+",
        default=["none"],
        choices=list(SHARDING),
        help="with --data-parallel 2 or more: fsdp=True, and with reshard_after_forward",
    )
    parser.add_argument(
        "--tables", metavar="JSON", help="print docs/benchmarks.md's tables from a run's memory.json; no run"
    )
    args = parser.parse_args()
    if args.tables:
        print(tables(json.loads(Path(args.tables).read_text())))
        return
    rows, lines = [], []
    header = (
        f"{'model':11} {'schedule':12} {'ranks':>5} {'ckpt':>6}  per rank MiB: ledger / allocator / predicted "
        "(predicted / allocator)"
    )
    print(header, flush=True)
    name = "memory" if args.data_parallel == 1 else "memory_dp"
    for kind, ranks, checkpoint, sharding, schedule in itertools.product(
        args.models, args.ranks, args.checkpoint, args.sharding, args.schedules
    ):
        row = run_point(worker, ranks, (kind, schedule, checkpoint, sharding, args), args.threads)
        rows.append(row)
        cells = "  ".join(
            f"{g / 2**20:5.1f} / {a / 2**20:5.1f} / {p / 2**20:5.1f} ({p / a:.3f})"
            for g, a, p in zip(row["ledger"], row["allocator"], row["predicted"], strict=True)  # type: ignore[index]
        )
        state = " ".join(f"{v / 2**20:.2f}" for v in row["state"])  # type: ignore[index]
        shown = "" if args.data_parallel == 1 else f" {sharding} state {state}"
        line = f"{kind:11} {schedule:12} {ranks:5d} {checkpoint:>6}  {cells}{shown}"
        lines.append(line)
        print(line, flush=True)
    ratios = [p / a for row in rows for a, p in zip(row["allocator"], row["predicted"], strict=True)]  # type: ignore[index]
    summary = f"predicted / allocator over {len(ratios)} rank peaks: {min(ratios):.3f} .. {max(ratios):.3f}"
    print(summary)
    write_json(name, rows)
    within = sum(abs(r - 1) <= 0.05 for r in ratios)
    summary += f"; {within} within 5%"
    (OUT / f"{name}.txt").write_text("\n".join([header, *lines, summary]) + "\n")
    if name == "memory":
        (OUT / "memory.md").write_text(tables(rows))
        plot(rows, str(OUT / "memory.png"))
    print(f"wrote {OUT / name}.json and {name}.txt")


if __name__ == "__main__":
    main()
