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


def arguments(doc: str, schedules: list[str], choices: bool = False, **knobs: int) -> argparse.ArgumentParser:
    """The command line every benchmark shares: ``--schedules`` (``choices``: only those) and one int flag per knob
    (its default)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    for flag, default in knobs.items():
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--schedules", nargs="+", default=schedules, choices=schedules if choices else None)
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
    """This process's peak resident memory, MiB (Linux reports KiB)."""
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


def write_report(name: str, rows: object, lines: list[str]) -> None:
    """The rows as OUT/<name>.json and the printed lines as OUT/<name>.txt."""
    write_json(name, rows)
    (OUT / f"{name}.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT / name}.json and {name}.txt")


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


def side_by_side(
    engine: object, theirs: object, x: object, y: object, first: bool, last: bool
) -> tuple[Callable[[], float], Callable[[], float | None]]:
    """One training step of this engine and one of torch.distributed.pipelining's schedule ``theirs`` on the same
    batch, each zeroing its gradients after: (ours, torch's). ``first`` / ``last``: whether this rank holds torch's
    first / last stage. Ours returns the mean loss; torch's its mean loss on the last stage's rank, else None."""

    def ours() -> float:
        loss = engine.train_step(x if engine.first else None, y if engine.last else None)  # type: ignore[attr-defined]
        engine.zero_grad()  # type: ignore[attr-defined]
        return loss  # type: ignore[no-any-return]

    def torch_step() -> float | None:
        losses: list[torch.Tensor] = []
        if first:
            theirs.step(x, target=y, losses=losses) if last else theirs.step(x)  # type: ignore[attr-defined]
        elif last:
            theirs.step(target=y, losses=losses)  # type: ignore[attr-defined]
        else:
            theirs.step()  # type: ignore[attr-defined]
        for stage in getattr(theirs, "_stages", [getattr(theirs, "_stage", None)]):
            if stage is not None:
                stage.submod.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if losses else None

    return ours, torch_step


def allocator_peak(step: Callable[[], object], params: list[torch.Tensor]) -> float:
    """The allocator's peak in one step: what was live at its start (weights, gradients), plus the most it took."""
    from pipeengine.observe.allocator import AllocatorWatch, live_bytes

    live = live_bytes([*params, *(p.grad for p in params if p.grad is not None)])
    with AllocatorWatch(torch.device("cpu")) as watch:
        step()
    return float(live + watch.peak)


def time_and_watch(
    ours: Callable[[], object],
    torch_step: Callable[[], object],
    mine: list[torch.Tensor],
    theirs: list[torch.Tensor],
    rounds: int,
    steps: int,
) -> dict[str, object]:
    """After 2 warm-up steps each: ``rounds`` rounds of ``steps`` steps of ours then torch's (medians), then one
    step of each under the allocator; every rank calls it, the figures (ms, MiB per rank) come back on all."""
    for _ in range(2):
        ours(), torch_step()
    mine_ms: list[float] = []
    theirs_ms: list[float] = []
    for _ in range(rounds):
        mine_ms += [timed(ours) for _ in range(steps)]
        theirs_ms += [timed(torch_step) for _ in range(steps)]
    peaks = [allocator_peak(ours, mine), allocator_peak(torch_step, theirs)]
    everyone: list[list[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, peaks)
    return {
        "ours_ms": 1e3 * median(mine_ms),
        "torch_ms": 1e3 * median(theirs_ms),
        "ratio": median(theirs_ms) / median(mine_ms),
        "ours_peak_mib": [p[0] / 2**20 for p in everyone],
        "torch_peak_mib": [p[1] / 2**20 for p in everyone],
    }


def side_by_side_line(label: str, row: dict[str, object]) -> str:
    """One printed line of a side-by-side row: both step times, the ratio, each rank's peaks."""
    return (
        f"{label}  pipeengine {row['ours_ms']:7.1f} ms  torch.distributed.pipelining {row['torch_ms']:7.1f} ms  "
        f"-> {row['ratio']:.2f}x   peak MiB per rank, pipeengine "
        f"{' '.join(f'{p:.1f}' for p in row['ours_peak_mib'])}, torch "  # type: ignore[attr-defined]
        f"{' '.join(f'{p:.1f}' for p in row['torch_peak_mib'])}"
    )  # type: ignore[attr-defined]
