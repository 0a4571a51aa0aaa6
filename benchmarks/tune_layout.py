"""The layout planner against measurement: dp x pp x tp and FSDP on 4 gloo ranks, priced at this machine's prices.

    python benchmarks/tune_layout.py                      # 6 MLP blocks of width 256, batch 64, 18 layouts, 3 rounds
    python benchmarks/tune_layout.py --layouts 16 --rounds 5 --steps 7
    python benchmarks/tune_layout.py --quick              # a tiny smoke run
    python benchmarks/tune_layout.py --prices FILE        # at a calibration file's prices (no calibration first)

First the machine is calibrated on 4 fresh ranks (calibration.measure_machine, the file under out/bench/), and
tune() plans the model (blocks Linear(D, 4D), GELU, Linear(4D, D), tp_plan {"*.0": colwise, "*.2": rowwise}, mse
loss) for 4 ranks at those prices, searching every dp x pp x tp, FSDP on and off, schedule, micro-batch count,
chunks, partition and checkpointing; the sample is the whole step's batch (each replica trains on batch/dp rows).
The memory limit is the 75th percentile of the candidates' predicted peaks (it drops the heaviest quarter), applied
to tune's ranking as tune applies it. Then --layouts candidates spread over the ranking (the predicted best, the
best of every other layout, the best of every other schedule in the best's layout, the next two, then rows spread
down the list, of those predicted within --slowest x the best) are built with PipelineEngine(model, loss,
**candidate.engine_kwargs()) and timed in rounds: a round launches fresh ranks for each candidate in turn (rotated
order), warms up, and times --steps steps; the figure quoted is the median over every round's steps. The predicted
best and every row measured within 10% of the fastest then run --final (6) more rounds among themselves (rotated),
so that which of the near-equal rows at the top is the fastest is decided on more launches (a launch's median moves
by up to 10% from the next one's: where the operating system puts 4 ranks on 2 cores; pinned, [1, 2, 2, 1] 1F1B
m2 took 19.1 ms with neighbouring stages on different cores, 23.1 ms with them on one). In the first
round each rank's peak is watched by the allocator after the timed steps (what training holds at a step's start:
weights, gradients, AdamW's moments; plus the most the step allocates; or the optimizer step's, if larger), the
figure the planner's limit guards. The search is also timed for 8 ranks (--wider; tune's search_seconds, after
measuring the layers; --repeats: tune's timings of each layer).
Writes out/bench/tune_layout.{json,txt}, tune_layout.md (the measured rows as a markdown table: the README's) and
tune_layout.png (predicted against measured step time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import OUT, run_point, save_row, timed, write_json
from torch import nn

from pipeengine import PipelineEngine
from pipeengine.planner.calibration import load, measure_machine
from pipeengine.planner.result import Candidate, TuneResult
from pipeengine.planner.search import tune

RANKS, THREADS, WIDTH, BLOCKS, BATCH, LAYOUTS, ROUNDS, STEPS, WARMUP, REPEATS = 4, 1, 256, 6, 64, 18, 3, 15, 2, 3
QUICK = {
    "width": 32,
    "blocks": 4,
    "batch": 8,
    "layouts": 2,
    "rounds": 1,
    "steps": 1,
    "warmup": 1,
    "repeats": 1,
    "microbatches": 1,
    "final": 0,
    "wider": [],
}
FINAL, CONTEND = 6, 0.10  # more rounds for the rows measured within 10% of the fastest (and the predicted best)
LIMIT_QUANTILE = 0.75
SLOWEST = 10.0  # the tail of the ranking (m=64, checkpointed: seconds a step) is not worth minutes of launches


def problem(width: int, blocks: int, batch: int) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """The model (same weights every call) and the whole step's batch and targets."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(blocks)]
    )
    generator = torch.Generator().manual_seed(1)
    return model, torch.randn(batch, width, generator=generator), torch.randn(batch, width, generator=generator)


def tp_plan() -> dict[str, object]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"*.0": ColwiseParallel(), "*.2": RowwiseParallel()}


def chosen(result: TuneResult, count: int, slowest: float) -> list[Candidate]:
    """The predicted best, the best of each other layout (dp, pp, tp, fsdp), the best of each other schedule in the
    best's layout (where a near miss hides: timed only the top rows, one run's pick measured 12% slower than a
    ZB-H1 row ranked lower), the next two, then rows spread evenly down the rest, of those predicted at most
    ``slowest`` x the best's step time; in ranking order."""
    rows = [c for c in result.rows if c.step_time <= slowest * result.rows[0].step_time]
    picked = [0]
    for layout in dict.fromkeys(c.layout for c in rows):
        picked.append(next(i for i, c in enumerate(rows) if c.layout == layout))
    for schedule in dict.fromkeys(c.schedule for c in rows if c.layout == rows[0].layout):
        picked.append(next(i for i, c in enumerate(rows) if c.layout == rows[0].layout and c.schedule == schedule))
    picked = list(dict.fromkeys([*picked, 1, 2]))[:count]
    rest = [i for i in range(len(rows)) if i not in picked]
    want = min(count - len(picked), len(rest))
    if want > 0:
        picked += [rest[round(k * (len(rest) - 1) / max(1, want - 1))] for k in range(want)]
    return [rows[i] for i in sorted(i for i in set(picked) if i < len(rows))]


def worker(args: argparse.Namespace, candidate: Candidate, watch: bool, path: str) -> None:
    """One candidate on fresh ranks: warm up, time ``args.steps`` steps, then (``watch``) each rank's peak."""
    from pipeengine.observe.allocator import AllocatorWatch, optimizer_step_peak, training_bytes

    model, x, y = problem(args.width, args.blocks, args.batch)
    engine = PipelineEngine(model, nn.functional.mse_loss, **candidate.engine_kwargs())  # type: ignore[arg-type]
    share = args.batch // candidate.data_parallel  # each replica trains on its rows of the step's batch
    rows = slice(engine.dp_rank * share, (engine.dp_rank + 1) * share)
    mine_x, mine_y = x[rows], y[rows]

    def step() -> None:
        engine.train_step(mine_x if engine.first else None, mine_y if engine.last else None)

    for _ in range(args.warmup):
        step()
    times = [timed(step) for _ in range(args.steps)]
    peak = 0.0
    if watch:  # as the planner prices it: AdamW's moments held, gradients None between steps
        params = list(engine.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        optimizer.step()
        optimizer.zero_grad()
        live = training_bytes(params, optimizer)
        with AllocatorWatch(torch.device("cpu")) as allocator:
            step()
        peak = max(live + allocator.peak, optimizer_step_peak(optimizer, params))
    peaks: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() == 0:
        save_row(path, {"times": times, "peaks": peaks})


def plot(table: list[dict[str, object]], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.5, 6), layout="constrained")
    FigureCanvasAgg(figure)
    axis = figure.subplots()
    predicted = [float(r["predicted_ms"]) for r in table]  # type: ignore[arg-type]
    measured = [float(r["measured_ms"]) for r in table]  # type: ignore[arg-type]
    top = 1.08 * max(predicted + measured)
    axis.plot([0, top], [0, top], "--", color="#8C8C8C", linewidth=1, label="y = x")
    axis.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="#DDDDDD", alpha=0.5, label="within 10%")
    for layout, colour in zip(dict.fromkeys(str(r["layout"]) for r in table), _colours(), strict=False):
        mine = [r for r in table if r["layout"] == layout]
        axis.scatter(
            [r["predicted_ms"] for r in mine],
            [r["measured_ms"] for r in mine],
            s=30,
            color=colour,
            label=layout,
            zorder=3,
        )
    for r in table:
        axis.annotate(
            f"#{r['predicted_rank']}",
            (r["predicted_ms"], r["measured_ms"]),
            fontsize=7,  # type: ignore[arg-type]
            xytext=(3, 3),
            textcoords="offset points",
        )
    axis.set_xlim(0, top)
    axis.set_ylim(0, top)
    axis.set_xlabel("predicted step time (ms)")
    axis.set_ylabel("measured step time (ms, median)")
    axis.set_title(
        "tune's layouts on 4 gloo ranks: predicted against measured (#: predicted rank)", fontsize=9, loc="left"
    )
    axis.legend(fontsize=7)
    figure.savefig(path, dpi=110)


def _colours() -> list[str]:
    return [
        "#4C72B0",
        "#DD8452",
        "#55A868",
        "#C44E52",
        "#8172B3",
        "#937860",
        "#DA8BC3",
        "#8C8C8C",
        "#CCB974",
        "#64B5CD",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (
        ("width", WIDTH),
        ("blocks", BLOCKS),
        ("batch", BATCH),
        ("layouts", LAYOUTS),
        ("rounds", ROUNDS),
        ("steps", STEPS),
        ("warmup", WARMUP),
        ("repeats", REPEATS),
        ("microbatches", 64),
        ("final", FINAL),
    ):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--wider", type=int, nargs="*", default=[2 * RANKS], help="world sizes to time the search at")
    parser.add_argument("--slowest", type=float, default=SLOWEST, help="measure rows predicted at most this x the best")
    parser.add_argument(
        "--contend",
        type=float,
        default=CONTEND,
        help="rows measured within this fraction of the fastest run the --final rounds",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run: " + str(QUICK))
    parser.add_argument("--prices", help="a calibration file to price at, in place of calibrating 4 ranks first")
    args = parser.parse_args()
    if args.quick:  # its sizes, but for the flags given beside it
        given = {flag.split("=")[0][2:] for flag in sys.argv[1:] if flag.startswith("--")}
        vars(args).update({key: value for key, value in QUICK.items() if key not in given})
    model, x, y = problem(args.width, args.blocks, args.batch)
    started = time.perf_counter()
    if args.prices:
        path, prices = Path(args.prices), load(args.prices)
    else:
        path, prices = measure_machine(RANKS, PipelineEngine, "gloo", OUT / "tune_layout_calibration.json")
    calibrating = time.perf_counter() - started
    print(f"prices of {path} ({calibrating:.1f} s)", flush=True)
    plan = tp_plan()

    def planned(world: int) -> TuneResult:
        """tune's rows for ``world`` ranks, at the prices just kept."""
        return tune(
            model,
            nn.functional.mse_loss,
            x,
            world,
            target=y,
            tp_plan=plan,
            prices=path,
            threads=THREADS,
            repeats=args.repeats,
            max_microbatches=args.microbatches,
        )

    found = planned(RANKS)
    peaks = sorted(max(c.peak_memory) for c in found.rows)
    limit = peaks[min(len(peaks) - 1, int(LIMIT_QUANTILE * len(peaks)))]
    # tune's own filter (it drops what passes memory_limit after ranking), with the limit read off its ranking
    result = TuneResult(
        [c for c in found.rows if c.fits(limit)],
        [c for c in found.rows if not c.fits(limit)],
        limit,
        found.search_seconds,
        found.measure_seconds,
        found.prices,
        found.refused,
    )
    print(result, flush=True)
    search = {RANKS: (len(found.rows), found.search_seconds, found.measure_seconds)}
    for world in args.wider:  # priced only: the search's time at more ranks
        wide = planned(world)
        search[world] = (len(wide.rows), wide.search_seconds, wide.measure_seconds)
    candidates = chosen(result, args.layouts, args.slowest)
    times: list[list[float]] = [[] for _ in candidates]
    measured_peaks: list[list[float]] = [[] for _ in candidates]
    for r in range(args.rounds):
        for k in range(len(candidates)):
            index = (k + r) % len(candidates)  # rotated: no candidate always runs first
            row = run_point(worker, RANKS, (args, candidates[index], r == 0), THREADS)
            times[index] += row["times"]  # type: ignore[index]
            if r == 0:
                measured_peaks[index] = row["peaks"]  # type: ignore[index]
        print(f"round {r + 1} of {args.rounds} done", flush=True)
    # the race at the top: the predicted best and every row measured within --contend of the fastest run --final more
    # rounds among themselves, where launch-to-launch noise (a few % on this machine) decides which is the best
    medians = [statistics.median(mine) for mine in times]
    contenders = [k for k, m in enumerate(medians) if k == 0 or m <= (1 + args.contend) * min(medians)]
    for r in range(args.final if len(contenders) > 1 else 0):
        for j in range(len(contenders)):
            index = contenders[(j + r) % len(contenders)]
            times[index] += run_point(worker, RANKS, (args, candidates[index], False), THREADS)["times"]  # type: ignore[index]
        print(f"final round {r + 1} of {args.final} done ({len(contenders)} rows)", flush=True)
    table = []
    for k, (candidate, mine, peaks_of) in enumerate(zip(candidates, times, measured_peaks, strict=True)):
        measured = 1e3 * statistics.median(mine)
        table.append(
            {
                "layout": candidate.layout,
                "data_parallel": candidate.data_parallel,
                "pipeline": len(candidate.partition) // candidate.chunks,
                "tensor_parallel": candidate.tensor_parallel,
                "fsdp": candidate.fsdp,
                "schedule": candidate.schedule,
                "num_microbatches": candidate.num_microbatches,
                "chunks": candidate.chunks,
                "checkpoint": candidate.checkpoint,
                "partition": list(candidate.partition),
                "predicted_rank": result.rows.index(candidate),
                "predicted_ms": candidate.step_time * 1e3,
                "measured_ms": measured,
                "measured_steps_ms": [1e3 * t for t in mine],
                "contender": k in contenders,
                "error": measured / (candidate.step_time * 1e3) - 1,
                "predicted_peak_mib": max(candidate.peak_memory) / 2**20,
                "predicted_peaks_mib": [p / 2**20 for p in candidate.peak_memory],
                "measured_peak_mib": max(peaks_of) / 2**20,
                "measured_peaks_mib": [p / 2**20 for p in peaks_of],
                "under_limit": max(peaks_of) <= limit,
            }
        )
    fastest = min(table, key=lambda r: r["measured_ms"])
    best = table[0]  # the predicted best: rank 0 is always measured
    slower = best["measured_ms"] / fastest["measured_ms"] - 1
    errors = [abs(r["error"]) for r in table]
    lines = [f"{RANKS} ranks of {THREADS} thread on {os.cpu_count()} cores; prices: {found.prices}"]
    lines += [
        f"{world} ranks: {n} candidates priced in {took:.2f} s after {measuring:.1f} s measuring the layers"
        for world, (n, took, measuring) in search.items()
    ]
    lines += [
        f"memory limit {limit / 2**20:.1f} MiB per rank (the {LIMIT_QUANTILE:.0%} quantile of the predicted "
        f"peaks) kept {len(result.rows)}, dropped {len(result.dropped)}",
        f"{'pred#':>5}  {'layout':20} {'schedule':11} {'m':>3} {'v':>2} {'ckpt':11} {'pred ms':>8} {'meas ms':>8} "
        f"{'error':>7}  {'peak MiB pred / meas':>20}  partition",
    ]
    for r in table:
        lines.append(
            f"{r['predicted_rank']:5d}  {r['layout']:20} {r['schedule']:11} {r['num_microbatches']:3d} "
            f"{r['chunks']:2d} {r['checkpoint']:11} {r['predicted_ms']:8.2f} {r['measured_ms']:8.2f} "
            f"{r['error']:+7.1%}  {r['predicted_peak_mib']:9.2f} / {r['measured_peak_mib']:8.2f}  "
            f"{r['partition']}"
        )
    order = sorted(table, key=lambda r: r["measured_ms"])
    lines += [
        f"the predicted best ({best['layout']}, {best['schedule']}) measured {slower:+.1%} against the measured "
        f"best (#{fastest['predicted_rank']}, {fastest['layout']}, {fastest['schedule']}): within 5%: "
        f"{slower <= 0.05}; measured places of the predicted top 3: {[order.index(r) for r in table[:3]]} "
        f"({len(contenders)} rows within {args.contend:.0%} of the fastest after {args.rounds} rounds, with the "
        f"predicted best, ran {args.final if len(contenders) > 1 else 0} more: "
        f"#{', #'.join(str(table[k]['predicted_rank']) for k in contenders)})",
        f"step-time error |measured / predicted - 1|: median {statistics.median(errors):.1%} (target < 10%), "
        f"max {max(errors):.1%}",
        f"every measured peak under the limit: {all(r['under_limit'] for r in table)} (measured / predicted "
        f"peak: {min(r['measured_peak_mib'] / r['predicted_peak_mib'] for r in table):.3f} to "
        f"{max(r['measured_peak_mib'] / r['predicted_peak_mib'] for r in table):.3f})",
        "search (after measuring; target < 2 s): "
        + ", ".join(f"{took:.2f} s for {world} ranks" for world, (_, took, _) in search.items()),
    ]
    text = "\n".join(lines)
    print(text, flush=True)
    write_json(
        "tune_layout",
        {
            "model": {"width": args.width, "blocks": args.blocks, "batch": args.batch},
            "ranks": RANKS,
            "cores": os.cpu_count(),
            "rounds": args.rounds,
            "final_rounds": args.final,
            "steps": args.steps,
            "calibration": str(path),
            "calibration_seconds": calibrating,
            "prices": found.prices,
            "prices_calibrated": prices.calibrated,
            "memory_limit_mib": limit / 2**20,
            "limit_rule": f"the {LIMIT_QUANTILE:.0%} quantile of the predicted peaks",
            "candidates": len(found.rows),
            "kept": len(result.rows),
            "search_seconds": {str(k): v[1] for k, v in search.items()},
            "measure_seconds": found.measure_seconds,
            "rows": table,
            "predicted_best_slower": slower,
            "predicted_best_within_5pct": slower <= 0.05,
            "median_abs_error": statistics.median(errors),
            "all_under_limit": all(r["under_limit"] for r in table),
        },
    )
    (OUT / "tune_layout.txt").write_text(str(result) + "\n\n" + text + "\n")
    (OUT / "tune_layout.md").write_text(markdown(table))
    plot(table, str(OUT / "tune_layout.png"))


def markdown(table: list[dict[str, object]]) -> str:
    """The measured rows as the README's and docs/benchmarks.md's table."""
    lines = [
        "| predicted rank | layout | schedule | m | v | checkpoint | predicted ms | measured ms | error | "
        "peak MiB predicted / measured |",
        "|-|-|-|-|-|-|-|-|-|-|",
    ]
    for r in table:
        lines.append(
            f"| {r['predicted_rank']} | {r['layout']} | {r['schedule']} | {r['num_microbatches']} | "
            f"{r['chunks']} | {r['checkpoint']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | "
            f"{r['error']:+.0%} | {r['predicted_peak_mib']:.2f} / {r['measured_peak_mib']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
