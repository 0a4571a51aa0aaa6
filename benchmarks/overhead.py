"""The engine's own overhead: step time / the simulator's makespan for the costs measured in the same run.

    python benchmarks/overhead.py                         # 2 ranks, 1 thread each, 8 x Linear(1024), batch 256, m=8
    python benchmarks/overhead.py --ranks 4 --steps 20

For each schedule: warm up, then alternate untraced and traced steps (TRACED of each);
the untraced steps give the measured step time (median), the traced ones the per-stage
median cost of each kind, fed to schedules.simulate. From the traces, the dispatch cost:
host time a rank spends neither computing nor waiting (posting, bookkeeping), per
instruction. Writes out/bench/overhead.json.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from common import OUT, median, mlp, run_point, save_row, timed, write_json

from pipeengine import PipelineEngine
from schedules import Costs, Timeline, simulate

RANKS, THREADS, WIDTH, LAYERS, BATCH, MICROBATCHES, STEPS, WARMUP = 2, 1, 1024, 8, 256, 8, 10, 3
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]


def worker(schedule: str, args: argparse.Namespace, path: str) -> None:
    engine = PipelineEngine(mlp(args.width, args.layers), torch.nn.functional.mse_loss,
                            num_microbatches=args.microbatches, schedule=schedule, partition="uniform")  # fmt: skip
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)

    def step() -> None:
        engine.train_step(x if engine.first else None, y if engine.last else None)

    for _ in range(WARMUP):
        step()
    times, timelines = [], []
    for _ in range(args.steps):  # alternate, so both see the same machine
        times.append(timed(step))
        with engine.tracing():
            step()
        timelines.append(engine.timeline())
    if dist.get_rank() != 0:
        return
    traced = [t for t in timelines if t is not None]
    # durations pooled over every traced step (their clocks overlap, only durations are used)
    pooled = Timeline(traced[0].num_ranks, [s for t in traced for s in t.spans], unit="s", measured=True)
    predicted = simulate(engine.schedule, Costs.from_timeline(pooled)).makespan
    dispatch = []
    for timeline in traced:
        for rank in range(timeline.num_ranks):
            mine = [s for s in timeline.spans if s.rank == rank]
            busy = sum(s.duration for s in mine if s.is_compute or s.wait)
            active = max(s.end for s in mine) - min(s.start for s in mine)
            dispatch.append((active - busy) / sum(1 for s in mine if not s.wait))
    timeline = traced[-1]
    row = {
        "schedule": schedule, "ranks": timeline.num_ranks, "step_ms": 1e3 * median(times),
        "simulated_ms": 1e3 * predicted, "ratio": median(times) / predicted,
        "measured_bubble": median([t.bubble_fraction for t in traced]),
        "dispatch_us_per_instruction": 1e6 * median(dispatch),
    }  # fmt: skip
    save_row(path, row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in [("ranks", RANKS), ("threads", THREADS), ("width", WIDTH), ("layers", LAYERS),
                          ("batch", BATCH), ("microbatches", MICROBATCHES), ("steps", STEPS)]:  # fmt: skip
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for schedule in args.schedules:
        r = run_point(worker, args.ranks, (schedule, args), args.threads)
        rows.append(r)
        print(f"{schedule:12} step {r['step_ms']:7.1f} ms  simulated {r['simulated_ms']:7.1f} ms  "
              f"ratio {r['ratio']:.3f}  bubble {r['measured_bubble']:.1%}  "
              f"dispatch {r['dispatch_us_per_instruction']:.0f} us/instruction", flush=True)  # fmt: skip
    print(f"wrote {write_json('overhead', rows)}")


if __name__ == "__main__":
    main()
