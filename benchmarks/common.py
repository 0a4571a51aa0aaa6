"""Shared by the benchmarks: the MLP of the targets, timing a step across ranks, memory, output."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

OUT = Path(os.environ.get("PIPEENGINE_BENCH_OUT", "out/bench"))


def arguments(doc: str, schedules: list[str], **knobs: int) -> argparse.ArgumentParser:
    """The command line every benchmark shares: ``--schedules`` and one int flag per knob (its default)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    for flag, default in knobs.items():
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--schedules", nargs="+", default=schedules)
    return parser


def mlp(width: int, layers: int, seed: int = 0) -> nn.Sequential:
    """The benchmark model: ``layers`` Linear(width, width) layers."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def timed(step: Callable[[], object]) -> float:
    """Seconds from a common start (a barrier) until the slowest rank is done: one step of the pipeline."""
    dist.barrier()
    start = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def median(values: list[float]) -> float:
    return statistics.median(values)


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gather_max(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def run_point(worker: Callable[..., None], ranks: int, args: tuple[object, ...], threads: int) -> object:
    """Launch fresh ranks for one measurement; rank 0 of the worker saves its result with save_row."""
    from pipeengine import launch

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "row.pickle"
        launch(worker, ranks, args=(*args, str(path)), threads=threads)
        with path.open("rb") as data:
            return pickle.load(data)


def save_row(path: str, row: object) -> None:
    with open(path, "wb") as out:
        pickle.dump(row, out)


def write_json(name: str, rows: object) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(rows, indent=2))
    return path


def measure(engine: object, x: torch.Tensor, y: torch.Tensor, steps: int, warmup: int = 2) -> dict[str, float] | None:
    """Alternate untraced and traced steps; on rank 0 return step time, bubble, prediction and memory.

    The prediction is schedules.simulate fed the per-stage median costs of the traced steps
    (communication free), so measured / predicted is the engine's own overhead. Also, per traced
    step, its makespan over schedules.replay's (each compute its own measured time): the overhead
    net of compute that ran slower than its median.
    """
    from schedules import Costs, Timeline, replay, simulate

    baseline = peak_rss_mb()
    run = engine.train_step  # type: ignore[attr-defined]

    def step() -> None:
        run(x if engine.first else None, y if engine.last else None)  # type: ignore[attr-defined]

    for _ in range(warmup):
        step()
    times, traced = [], []
    for _ in range(steps):
        times.append(timed(step))
        with engine.tracing():  # type: ignore[attr-defined]
            step()
        traced.append(engine.timeline())  # type: ignore[attr-defined]
    peak = gather_max(peak_rss_mb())
    growth = gather_max(peak_rss_mb() - baseline)
    if dist.get_rank() != 0:
        return None
    timelines = [t for t in traced if t is not None]
    engine.last_timelines = timelines  # type: ignore[attr-defined]  # for scripts that draw them
    pooled = Timeline(timelines[0].num_ranks, [s for t in timelines for s in t.spans], unit="s", measured=True)
    schedule = engine.schedule  # type: ignore[attr-defined]
    predicted = simulate(schedule, Costs.from_timeline(pooled))
    # memory: each rank's peak in the last traced step, and the simulator's for the program that ran
    last = timelines[-1]
    memory = simulate(engine.last_program, Costs.from_timeline(last))  # type: ignore[attr-defined]
    return {
        "step_ms": 1e3 * median(times),
        "samples_per_s": x.shape[0] / median(times),
        "measured_bubble": median([t.bubble_fraction for t in timelines]),
        "predicted_ms": 1e3 * predicted.makespan,
        "predicted_bubble": predicted.bubble_fraction,
        "replay_ratio": median([t.makespan / replay(schedule, t).makespan for t in timelines]),
        "peak_rss_mb": peak,
        "rss_growth_mb": growth,
        "peak_mb": max(last.peak_memory) / 2**20,
        "predicted_peak_mb": max(memory.peak_memory) / 2**20,
    }
