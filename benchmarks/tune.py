"""The planner against measurement: where the measured best ranks in pipeengine.tune's table, and memory limits kept.

    python benchmarks/tune.py                          # the benchmark MLP and the example GPT, 2 ranks
    python benchmarks/tune.py --models mlp --rounds 9

For each model, tune() prices every candidate for 2 ranks (1 thread each), with a memory limit at
the median of their predicted peaks. Then 2 fresh gloo ranks build the top 3 candidates and 9 more
spread over the table, each its own engine, and time them in turn (a round steps every engine once,
in a rotated order; medians over the rounds), then trace one step of each with AdamW and watch its
optimizer step, for the allocator's peak memory per rank (the larger of the two, as the planner
prices it). Reports the measured best's place in the prediction, how much slower the
predicted best measured than the measured best, and whether every measured candidate the limit
kept stayed under it. Writes out/bench/tune_<model>.{json,txt} and tune_<model>.png (predicted step
time against peak memory for every candidate: the frontier, with the measured points).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from common import OUT, mlp, run_point, save_row, timed, write_json

from pipeengine import PipelineEngine
from pipeengine.tune import Candidate, TuneResult, tune

RANKS, THREADS, ROUNDS, MEASURED = 2, 1, 7, 12
MODELS = ["mlp", "gpt"]


def problem(name: str, width: int) -> tuple[torch.nn.Sequential, object, torch.Tensor, torch.Tensor, object]:
    """(model, loss, inputs, targets, loss_count) of a model the benchmark plans for."""
    torch.manual_seed(0)
    if name == "mlp":  # the benchmarks' MLP: 8 x Linear(width), batch 256
        x = torch.randn(256, width)
        return mlp(width, 8), torch.nn.functional.mse_loss, x, torch.randn(256, width), None
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    import train_gpt  # the example's GPT, its token-mean loss, a batch of its shape

    model, loss, tokens = train_gpt.planning()
    targets = torch.randint(0, len(train_gpt.VOCAB), tokens.shape)
    return model, loss, tokens, targets, train_gpt.real_tokens


def chosen(result: TuneResult, count: int) -> list[Candidate]:
    """The top 3, and the rest spread evenly over the table."""
    rows = result.rows
    top = rows[:3]
    rest = rows[3:]
    step = max(1, len(rest) // max(1, count - 3))
    return top + rest[::step][: count - 3]


def worker(name: str, width: int, candidates: list[Candidate], rounds: int, path: str) -> None:
    import torch.distributed as dist

    engines = []
    model, loss, x, y, count = problem(name, width)
    for candidate in candidates:
        torch.manual_seed(0)
        fresh, _, _, _, _ = problem(name, width)
        engines.append(PipelineEngine(fresh, loss, loss_count=count, **candidate.engine_kwargs()))  # type: ignore[arg-type]

    def step(engine: PipelineEngine) -> None:
        engine.train_step(x if engine.first else None, y if engine.last else None)

    for engine in engines:  # warm up
        step(engine)
        step(engine)
    times: list[list[float]] = [[] for _ in engines]
    for r in range(rounds):
        for k in range(len(engines)):
            index = (k + r) % len(engines)  # a rotated order: no candidate always runs first
            times[index].append(timed(lambda engine=engines[index]: step(engine)))
    from pipeengine.observe.allocator import optimizer_step_peak

    peaks = []
    for engine in engines:
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
        engine.zero_grad()
        step(engine)
        optimizer.step()  # AdamW's moments exist: the state the planner counted
        optimizer.zero_grad()  # gradients None, as training leaves them between steps
        with engine.tracing(optimizer):
            step(engine)
        stepped = [0.0] * dist.get_world_size()  # the optimizer step after it, as the allocator sees it
        dist.all_gather_object(stepped, optimizer_step_peak(optimizer, engine.parameters()))
        timeline = engine.timeline()  # the allocator's: the larger of the step's peak and the optimizer step's
        if timeline is not None and timeline.allocated_peak is not None:
            peaks.append([max(a, b) for a, b in zip(timeline.allocated_peak, stepped, strict=True)])
        else:
            peaks.append(None)
        optimizer.zero_grad()
    if dist.get_rank() == 0:
        save_row(
            path,
            [
                {"measured_ms": 1e3 * statistics.median(t), "measured_peak": p}
                for t, p in zip(times, peaks, strict=True)
            ],
        )


def plot(result: TuneResult, measured: list[dict[str, object]], name: str, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(figure)
    axis = figure.subplots()
    every = result.rows + result.dropped
    axis.scatter(
        [max(c.peak_memory) / 2**20 for c in every],
        [c.step_time * 1e3 for c in every],
        s=12,
        color="#BBBBBB",
        label="every candidate (predicted)",
    )
    frontier, best = [], float("inf")
    for c in sorted(every, key=lambda c: max(c.peak_memory)):
        if c.step_time < best:
            best = c.step_time
            frontier.append(c)
    axis.plot(
        [max(c.peak_memory) / 2**20 for c in frontier],
        [c.step_time * 1e3 for c in frontier],
        "-",
        color="#4C72B0",
        label="the frontier (predicted)",
    )
    for row in measured:
        axis.plot(
            [row["predicted_peak_mb"], row["measured_peak_mb"]],
            [row["predicted_ms"], row["measured_ms"]],
            ":",
            color="#DD8452",
            linewidth=0.8,
        )
    axis.scatter(
        [r["measured_peak_mb"] for r in measured],
        [r["measured_ms"] for r in measured],
        s=24,
        color="#DD8452",
        marker="s",
        label="measured (joined to its prediction)",
    )
    if result.memory_limit is not None:
        axis.axvline(result.memory_limit / 2**20, color="#C44E52", linestyle="--", linewidth=1, label="memory limit")
    axis.set_xlabel("peak memory of the fullest rank (MiB)")
    axis.set_ylabel("step time (ms)")
    axis.set_title(f"{name}, 2 ranks: predicted step time against peak memory", fontsize=10, loc="left")
    axis.legend(fontsize=8)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--measured", type=int, default=MEASURED, help="candidates measured: the top 3 and the rest")
    parser.add_argument("--microbatches", type=int, nargs="+", help="the candidates' micro-batch counts")
    parser.add_argument("--width", type=int, default=1024, help="the MLP's width")
    args = parser.parse_args()
    for name in args.models:
        model, loss, x, y, _ = problem(name, args.width)
        probe = tune(
            model,
            loss,
            x,
            RANKS,
            target=y,
            threads=THREADS,
            microbatches=args.microbatches,
            data_parallel=1,
            checkpoint=["never"],
        )  # type: ignore[arg-type]
        limit = statistics.median(max(c.peak_memory) for c in probe.rows)
        result = tune(
            model,
            loss,
            x,
            RANKS,
            target=y,
            threads=THREADS,
            memory_limit=limit,
            data_parallel=1,  # type: ignore[arg-type]
            microbatches=args.microbatches,
            checkpoint=["never"],
        )
        print(result, flush=True)
        candidates = chosen(result, args.measured)
        rows = run_point(worker, RANKS, (name, args.width, candidates, args.rounds), THREADS)
        table = []
        for candidate, row in zip(candidates, rows, strict=True):  # type: ignore[call-overload]
            table.append(
                {
                    **candidate.engine_kwargs(),
                    "predicted_rank": result.rows.index(candidate),
                    "predicted_ms": candidate.step_time * 1e3,
                    "measured_ms": row["measured_ms"],
                    "predicted_peak_mb": max(candidate.peak_memory) / 2**20,
                    "measured_peak_mb": max(row["measured_peak"]) / 2**20,
                    "under_limit": max(row["measured_peak"]) <= limit,
                }
            )
        fastest = min(table, key=lambda r: r["measured_ms"])
        slower = table[0]["measured_ms"] / fastest["measured_ms"] - 1
        lines = [
            f"{name}: {len(result.rows) + len(result.dropped)} candidates priced in {result.search_seconds:.2f} s "
            f"({result.measure_seconds:.1f} s measuring layers); memory limit {limit / 2**20:.1f} MiB per rank "
            f"kept {len(result.rows)}",
            f"{'pred#':>5}  {'schedule':11} {'m':>3} {'v':>2}  {'predicted ms':>12}  {'measured ms':>11}  "
            f"{'peak MiB pred / meas':>20}  partition",
        ]
        for r in table:
            lines.append(
                f"{r['predicted_rank']:5d}  {r['schedule']:11} {r['num_microbatches']:3d} {r['chunks']:2d}  "
                f"{r['predicted_ms']:12.1f}  {r['measured_ms']:11.1f}  "
                f"{r['predicted_peak_mb']:9.1f} / {r['measured_peak_mb']:8.1f}  {r['partition']}"
            )
        measured_order = sorted(table, key=lambda r: r["measured_ms"])
        lines.append(
            f"the measured best is #{fastest['predicted_rank']} of the prediction; the predicted best "
            f"measured {slower:+.1%} against it; measured ranks of the predicted top 3: "
            f"{[measured_order.index(r) for r in table[:3]]}"
        )
        lines.append(
            "every measured candidate the memory limit kept stayed under it: "
            f"{all(r['under_limit'] for r in table)} (worst: measured / predicted peak "
            f"{max(r['measured_peak_mb'] / r['predicted_peak_mb'] for r in table):.3f})"
        )
        text = "\n".join(lines)
        print(text, flush=True)
        write_json(f"tune_{name}", {"rows": table, "limit_mb": limit / 2**20, "slower": slower})
        (OUT / f"tune_{name}.txt").write_text(text + "\n")
        plot(result, table, name, str(OUT / f"tune_{name}.png"))


if __name__ == "__main__":
    main()
