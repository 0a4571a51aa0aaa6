"""Simulated timelines of every registered schedule, one figure, on one time axis (no torch needed).

    python examples/plot_schedules.py                       # writes docs/schedules.png
    python examples/plot_schedules.py --ranks 4 --microbatches 8 -o schedules.png

Costs are per stage of the whole model: forward 1, backward 2. A rank with v chunks runs
stages 1/v as large, so each chunk's costs are divided by v and every schedule does the
same total work: the picture compares bubbles, not model sizes. The schedules are the
registry's (schedules.SCHEDULES), in its order, each at its own chunk count; one that does not
run at these ranks and micro-batches (DualPipeV needs m >= 2p) is left out, with the reason.
"""

from __future__ import annotations

import argparse

from schedules import SCHEDULES, Costs, build_schedule, plot_timelines, simulate

RANKS, MICROBATCHES, OUTPUT = 4, 8, "docs/schedules.png"


def main(ranks: int, microbatches: int, output: str) -> None:
    timelines, titles = [], []
    for name, record in SCHEDULES.items():
        chunks = record.default_chunks
        try:
            schedule = build_schedule(name, ranks, microbatches, chunks)
        except ValueError as refused:
            print(f"{name}: left out: {refused}")
            continue
        share = 1.0 / chunks
        timeline = simulate(schedule, Costs(forward=share, backward_input=share, backward_weight=share))
        peak = max(timeline.peak_inflight) * share  # in micro-batches of a whole rank's activations
        timelines.append(timeline)
        titles.append(f"{name} (p={ranks}, m={microbatches}, v={chunks}), peak activations {peak:g} micro-batches")
    plot_timelines(timelines, output, titles=titles)
    for title, timeline in zip(titles, timelines, strict=True):
        print(f"{title}: bubble {timeline.bubble_fraction:.3f}, makespan {timeline.makespan:g}")
    print(f"wrote {output}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=RANKS)
    parser.add_argument("--microbatches", type=int, default=MICROBATCHES)
    parser.add_argument("-o", "--output", default=OUTPUT)
    args = parser.parse_args()
    main(args.ranks, args.microbatches, args.output)
