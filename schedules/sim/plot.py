"""Gantt charts of timelines: one row per rank, forward / backward / weight / wait in their own colours."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from schedules.ir.instructions import Instruction, Kind

if TYPE_CHECKING:  # typing only: timeline.py imports this module lazily, so no import runs back
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from schedules.sim.timeline import Timeline

__all__ = ["plot_timelines", "COLOURS"]

COLOURS = {
    Kind.FORWARD: "#4C72B0",
    Kind.BACKWARD: "#DD8452",
    Kind.BACKWARD_INPUT: "#C44E52",
    Kind.BACKWARD_WEIGHT: "#8172B2",
    "post": "#7F7F7F",
    "wait": "#C8C8C8",
    "memory": "#2CA02C",
}
LABELS = {
    Kind.FORWARD: "forward",
    Kind.BACKWARD: "backward",
    Kind.BACKWARD_INPUT: "backward (input)",
    Kind.BACKWARD_WEIGHT: "backward (weight)",
    "post": "posting sends/recvs",
    "wait": "waiting on a transfer",
    "memory": "memory held (under each rank; its peak labelled)",
}
LATER_CHUNKS = 0.6  # the shade (alpha) of a rank's second and later chunks; its first chunk is drawn full
CHUNK_LABELS = {"chunk-first": "a rank's first chunk (full shade)", "chunk-later": "its later chunks (lighter)"}


def plot_timelines(timelines: Sequence[Timeline], path: str, titles: Sequence[str] | None = None) -> Figure:
    """Draw timelines stacked on one time axis (e.g. GPipe, 1F1B, interleaved; or simulated vs measured); the
    legend names each colour, and, where a rank runs several chunks (stages), which shade is which chunk.

    One unit for the figure: timelines in seconds (measured, or simulated from measured costs:
    ``simulate(schedule, Costs.from_timeline(measured))``) are drawn in milliseconds, their memory in MiB;
    simulated ones in cost units. Timelines in different units are refused (ValueError)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not timelines:
        raise ValueError("plot_timelines needs at least one timeline")
    heights = [max(1, t.num_ranks) for t in timelines]
    figure = Figure(figsize=(12, 1.0 + sum(0.42 * h + 0.7 for h in heights)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(timelines), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    scale, unit = _scale(timelines)
    end = max(t.makespan for t in timelines) * scale
    used: set[Kind | str] = set()
    for index, (axis, timeline) in enumerate(zip(axes, timelines, strict=True)):
        title = titles[index] if titles and index < len(titles) else timeline.label
        axis.set_title(
            f"{title}: bubble {timeline.bubble_fraction:.1%}, makespan {timeline.makespan * scale:.3g} {unit}",
            fontsize=10,
            loc="left",
        )
        used |= _draw(axis, timeline, scale, end)
        if timeline.memory is not None:
            used |= _draw_memory(axis, timeline, scale)
        axis.set_yticks(range(timeline.num_ranks), [f"rank {r}" for r in range(timeline.num_ranks)])
        axis.set_ylim(timeline.num_ranks - 0.5, -0.5)
        axis.set_xlim(0, end)
    axes[-1].set_xlabel(f"time ({unit})")
    order = [k for k in COLOURS if k in used]
    handles, labels = [Patch(color=COLOURS[k]) for k in order], [LABELS[k] for k in order]
    if "chunk-later" in used:  # the shades, in the forward's colour
        handles += [Patch(color=COLOURS[Kind.FORWARD]), Patch(color=COLOURS[Kind.FORWARD], alpha=LATER_CHUNKS)]
        labels += [CHUNK_LABELS["chunk-first"], CHUNK_LABELS["chunk-later"]]
    figure.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 5), fontsize=9, frameon=False)
    if isinstance(path, (str, os.PathLike)):  # a file name: its missing folders made (out/step.png)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return figure


def _scale(timelines: Sequence[Timeline]) -> tuple[float, str]:
    """Seconds are drawn in milliseconds; simulated timelines keep their cost units (or the unit they name)."""
    units = {t.unit for t in timelines}
    if len(units) > 1:
        named = ", ".join(f"{t.label or f'timeline {i}'} in {t.unit or 'cost units'}" for i, t in enumerate(timelines))
        raise ValueError(
            f"plot_timelines draws one time unit on one axis, and these timelines have several ({named}); simulate "
            "with the measured step's costs (Costs.from_timeline(measured): seconds) or plot them apart"
        )
    unit = units.pop()
    if unit == "s":
        return 1e3, "ms"
    return 1.0, unit or "cost units"


def _mib(size: float) -> str:
    """Bytes in MiB: one decimal from 1 MiB up, three significant digits below."""
    mib = size / 2**20
    return f"{mib:.1f} MiB" if mib >= 1 else f"{mib:.3g} MiB"


def _draw(axis: Axes, timeline: Timeline, scale: float, end: float) -> set[Kind | str]:
    origin = timeline.start
    used: set[Kind | str] = set()
    chunk_of = _chunks(timeline)
    measured = timeline.measured  # there a post is host time; simulated comm spans overlap compute
    for span in timeline.spans:
        op = span.action
        if span.is_compute or span.wait:
            key: Kind | str = "wait" if span.wait else op.kind  # type: ignore[union-attr]  # compute: Instruction
        elif measured:
            key = "post"
        else:
            continue
        used.add(key)
        left, width = (span.start - origin) * scale, max(span.duration * scale, end * 1e-4)
        chunk = chunk_of.get((span.rank, op.stage), 0) if isinstance(op, Instruction) else 0
        alpha = 1.0 if chunk == 0 or not span.is_compute else LATER_CHUNKS
        if chunk and span.is_compute:
            used.add("chunk-later")
        height = 0.5 if timeline.memory is not None else 0.8  # room for the memory track under the row
        axis.barh(
            span.rank - (0.15 if timeline.memory is not None else 0.0),
            width,
            left=left,
            height=height,
            color=COLOURS[key],
            alpha=alpha,
            edgecolor="white",
            linewidth=0.4,
        )
        if span.is_compute and isinstance(op, Instruction) and width > end / 90:
            axis.text(
                left + width / 2,
                span.rank - (0.15 if timeline.memory is not None else 0.0),
                str(op.microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    return used


def _draw_memory(axis: Axes, timeline: Timeline, scale: float) -> set[Kind | str]:
    """A track under each rank's row: its bytes over the step, scaled to the largest peak of all ranks."""
    top = max(timeline.peak_memory, default=0.0) or 1.0
    origin = timeline.start
    for rank, samples in enumerate(timeline.memory or []):
        if not samples:
            continue
        xs = [(t - origin) * scale for t, _, _ in samples]
        ys = [rank + 0.48 - 0.36 * b / top for _, b, _ in samples]  # the row's lower part, growing upwards
        axis.step(xs, ys, where="post", color=COLOURS["memory"], linewidth=1.0)
        peak = timeline.peak_memory[rank]
        label = _mib(peak) if timeline.unit == "s" else f"{peak:g}"  # seconds: measured (or from measured) bytes
        axis.text(xs[-1], rank + 0.46, f"peak {label}", ha="right", va="bottom", fontsize=6, color=COLOURS["memory"])
    return {"memory"}


def _chunks(timeline: Timeline) -> dict[tuple[int, int], int]:
    """(rank, stage) -> the stage's position among the rank's stages: chunks are drawn lighter."""
    stages: dict[int, set[int]] = {}
    for span in timeline.spans:
        if isinstance(span.action, Instruction):
            stages.setdefault(span.rank, set()).add(span.action.stage)
    return {(rank, stage): i for rank, owned in stages.items() for i, stage in enumerate(sorted(owned))}
