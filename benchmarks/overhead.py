"""The engine's own overhead: step time / the simulator's makespan for the costs measured in the same run.

    python benchmarks/overhead.py                         # 2 ranks, 1 thread each, 8 x Linear(1024), batch 256, m=8
    python benchmarks/overhead.py --ranks 4 --steps 20

For each schedule, common.measure: warm up, then alternate untraced and traced steps
(--steps of each); the untraced steps give the measured step time (median), the traced
ones the per-stage median cost of each kind, fed to schedules.simulate. The replay ratio: a traced
step's makespan over schedules.replay of it (each compute charged its own measured time, not its
kind's median), so it leaves out compute that ran slow on a busy machine. The dispatch cost:
host time a rank spends neither computing nor waiting (posting, bookkeeping), per
instruction. Writes out/bench/overhead.json.
"""

from __future__ import annotations

import argparse

import torch
from common import arguments, measure, median, mlp, run_point, save_row, write_json

from pipeengine import PipelineEngine

RANKS, THREADS, WIDTH, LAYERS, BATCH, MICROBATCHES, STEPS, WARMUP = 2, 1, 1024, 8, 256, 8, 10, 3
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min"]


def worker(schedule: str, args: argparse.Namespace, path: str) -> None:
    engine = PipelineEngine(
        mlp(args.width, args.layers),
        torch.nn.functional.mse_loss,
        num_microbatches=args.microbatches,
        schedule=schedule,
        partition="uniform",
    )
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    measured = measure(engine, x, y, args.steps, warmup=WARMUP)
    if measured is None:  # not rank 0
        return
    traced = engine.last_timelines  # type: ignore[attr-defined]
    dispatch = []
    for timeline in traced:
        for rank in range(timeline.num_ranks):
            mine = [s for s in timeline.spans if s.rank == rank]
            busy = sum(s.duration for s in mine if s.is_compute or s.wait)
            active = max(s.end for s in mine) - min(s.start for s in mine)
            dispatch.append((active - busy) / sum(1 for s in mine if not s.wait))
    row = {
        "schedule": schedule,
        "ranks": traced[-1].num_ranks,
        "step_ms": measured["step_ms"],
        "simulated_ms": measured["predicted_ms"],
        "ratio": measured["step_ms"] / measured["predicted_ms"],
        "replay_ratio": measured["replay_ratio"],
        "measured_bubble": measured["measured_bubble"],
        "dispatch_us_per_instruction": 1e6 * median(dispatch),
    }
    save_row(path, row)


def main() -> None:
    args = arguments(
        __doc__,
        SCHEDULES,
        ranks=RANKS,
        threads=THREADS,
        width=WIDTH,
        layers=LAYERS,
        batch=BATCH,
        microbatches=MICROBATCHES,
        steps=STEPS,
    ).parse_args()
    rows = []
    for schedule in args.schedules:
        r = run_point(worker, args.ranks, (schedule, args), args.threads)
        rows.append(r)
        print(
            f"{schedule:12} step {r['step_ms']:7.1f} ms  simulated {r['simulated_ms']:7.1f} ms  "
            f"ratio {r['ratio']:.3f}  replay ratio {r['replay_ratio']:.3f}  bubble {r['measured_bubble']:.1%}  "
            f"dispatch {r['dispatch_us_per_instruction']:.0f} us/instruction",
            flush=True,
        )
    print(f"wrote {write_json('overhead', rows)}")


if __name__ == "__main__":
    main()
