"""Side by side with torch.distributed.pipelining: same model, micro-batches and schedule, alternating.

    python benchmarks/vs_torch.py                          # 2 ranks, 1 thread, 8 x Linear(1024), batch 256, m=8
    python benchmarks/vs_torch.py --ranks 4 --rounds 8

For each schedule, one set of ranks builds this engine and torch's (ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble) from the same weights and split, checks they
compute the same loss, then times them in alternating rounds so both see the same
machine. Rank 0 also times a single process running the whole model (the baseline).
Each round also traces one step of this engine: schedules.replay of it (each compute its
measured time, all else free) is what an engine with no overhead at all would take for these
computes, so torch's time over it bounds the ratio any engine running them could reach.
Reports median step times and the throughput ratio. Writes out/bench/vs_torch.json. A schedule
whose ranks fail is reported and the others still run (torch 2.11's ScheduleZBVZeroBubble fails
on gloo, alone too, with gloo's "Pair is not connected" from a send in its _initialize_stages;
2.13's does not), and the script then exits with status 1.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from common import arguments, median, mlp, run_point, save_row, side_by_side, timed, write_json
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from pipeengine import PipelineEngine
from schedules import replay

RANKS, THREADS, WIDTH, LAYERS, BATCH, MICROBATCHES, ROUNDS, STEPS = 2, 1, 1024, 8, 256, 8, 6, 3
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-v"]
TORCH = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI = {"interleaved": ScheduleInterleaved1F1B, "zb-v": ScheduleZBVZeroBubble}  # several stages per rank


def torch_pipeline(
    schedule: str, args: argparse.Namespace, bounds: list[tuple[int, int]], placement: tuple[int, ...]
) -> object:
    """torch's schedule over the same layers as ours (same split and placement, same initial weights)."""
    rank = dist.get_rank()
    layers = list(mlp(args.width, args.layers))
    stages = [
        PipelineStage(nn.Sequential(*layers[a:b]), s, len(bounds), torch.device("cpu"))
        for s, (a, b) in enumerate(bounds)
        if placement[s] == rank
    ]
    loss = nn.functional.mse_loss
    if schedule in MULTI:
        return MULTI[schedule](stages, args.microbatches, loss_fn=loss)
    return TORCH[schedule](stages[0], args.microbatches, loss_fn=loss)


def worker(schedule: str, args: argparse.Namespace, path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    engine = PipelineEngine(
        mlp(args.width, args.layers),
        nn.functional.mse_loss,
        num_microbatches=args.microbatches,
        schedule=schedule,
        partition="uniform",
    )
    theirs = torch_pipeline(schedule, args, engine.bounds, engine.schedule.placement)
    first, last = rank == 0, rank == engine.schedule.placement[-1]

    ours, torch_step = side_by_side(engine, theirs, x, y, first, last)

    # the same work: the same mean loss on the last rank
    ours_loss, their_loss = ours(), torch_step()
    if their_loss is not None and abs(ours_loss - their_loss) > 1e-4 * abs(ours_loss):
        raise AssertionError(f"{schedule}: this engine's loss {ours_loss} differs from torch's {their_loss}")
    whole = mlp(args.width, args.layers) if rank == 0 else None

    def single() -> None:
        if whole is not None:  # the other ranks wait in the barrier: their cores idle
            nn.functional.mse_loss(whole(x), y).backward()
            whole.zero_grad(set_to_none=True)

    for _ in range(2):
        ours(), torch_step(), single()
    mine, torch_times, single_times, replayed = [], [], [], []
    for _ in range(args.rounds):
        mine += [timed(ours) for _ in range(args.steps)]
        with engine.tracing():  # right after ours, so it finds the machine as they did
            ours()
        if rank == 0:
            replayed.append(replay(engine.schedule, engine.timeline()).makespan)  # type: ignore[arg-type]
        torch_times += [timed(torch_step) for _ in range(args.steps)]
        single_times += [timed(single) for _ in range(args.steps)]
    if rank == 0:
        row = {
            "schedule": schedule,
            "ranks": world,
            "ours_ms": 1e3 * median(mine),
            "torch_ms": 1e3 * median(torch_times),
            "single_process_ms": 1e3 * median(single_times),
            "no_overhead_ms": 1e3 * median(replayed),
        }
        row["speedup_vs_torch"] = row["torch_ms"] / row["ours_ms"]
        row["bound_vs_torch"] = row["torch_ms"] / row["no_overhead_ms"]
        row["speedup_vs_single"] = row["single_process_ms"] / row["ours_ms"]
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
        rounds=ROUNDS,
        steps=STEPS,
    ).parse_args()
    rows = []
    started = time.perf_counter()
    failed = []
    for schedule in args.schedules:
        try:
            r = run_point(worker, args.ranks, (schedule, args), args.threads)
        except Exception as error:  # e.g. torch 2.11's ScheduleZBVZeroBubble on gloo
            failed.append(schedule)
            print(f"{schedule:12} failed: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
            continue
        rows.append(r)
        print(
            f"{schedule:12} pipeengine {r['ours_ms']:7.1f} ms  torch.distributed.pipelining {r['torch_ms']:7.1f} ms  "
            f"-> {r['speedup_vs_torch']:.2f}x (no overhead: {r['bound_vs_torch']:.2f}x)   single process "
            f"{r['single_process_ms']:7.1f} ms -> {r['speedup_vs_single']:.2f}x",
            flush=True,
        )
    print(f"wrote {write_json('vs_torch', rows)} ({time.perf_counter() - started:.0f} s)")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)} (the other schedules' rows are written)")


if __name__ == "__main__":
    main()
