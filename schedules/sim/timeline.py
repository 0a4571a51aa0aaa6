"""Timeline: when each instruction ran on each rank, simulated or measured."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from schedules.ir.instructions import Action, Instruction, Kind

if TYPE_CHECKING:
    from schedules.sim.memory_model import Memory

__all__ = ["Span", "Timeline"]

MemorySample = tuple[float, float, Action | None]  # (time, bytes held from then on, the action that changed it)


@dataclass(frozen=True, slots=True)
class Span:
    """One instruction on one rank, from start to end (same unit as the costs, or seconds).

    ``wait`` marks time a measured rank spent blocked on a transfer; its action is the
    send or recv it waited for.
    """

    rank: int
    action: Action
    start: float
    end: float
    wait: bool = False

    @property
    def is_compute(self) -> bool:
        return not self.wait and isinstance(self.action, Instruction) and self.action.kind.is_compute

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """Spans of every rank. Compute spans count as busy time; communication spans overlap them."""

    num_ranks: int
    spans: list[Span]
    label: str = ""
    unit: str = ""  # "s" for seconds (measured, or simulated from measured costs); else cost units
    measured: bool = False  # spans are host time on each rank (so posting communication is drawn)
    clock_error: float = 0.0  # measured: how far another rank's span may be off rank 0's clock (half a ping)
    memory: list[list[MemorySample]] | None = None  # per rank, its bytes over the step (simulated or measured)
    sizes: Memory | None = None  # the per-stage bytes behind it (simulated: given; measured: on the step's data)
    # measured where the allocator can be watched (CUDA; CPU ranks that are processes): per rank, what was live at
    # the step's start (weights, gradients, optimizer state) plus the most the step allocated above it
    allocated_peak: list[float] | None = None
    optimizer_peak: list[float] | None = None  # per rank, the optimizer step's peak after the step (state, temporaries)
    _compute: list[list[Span]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._compute = [[] for _ in range(self.num_ranks)]
        for span in self.spans:
            action = span.action
            if not span.wait and isinstance(action, Instruction) and action.kind.is_compute:
                self._compute[span.rank].append(span)
        for spans in self._compute:
            spans.sort(key=lambda s: s.start)

    def compute_spans(self, rank: int) -> Sequence[Span]:
        """The compute spans of a rank, in time order."""
        return self._compute[rank]

    @property
    def start(self) -> float:
        return min((s.start for s in self.spans), default=0.0)

    @property
    def end(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    @property
    def makespan(self) -> float:
        return self.end - self.start

    def busy(self, rank: int) -> float:
        return sum(s.duration for s in self._compute[rank])

    @property
    def bubble_fractions(self) -> list[float]:
        """Per rank: the share of the makespan the rank spends not computing."""
        makespan = self.makespan
        if makespan <= 0:
            return [0.0] * self.num_ranks
        return [1.0 - self.busy(rank) / makespan for rank in range(self.num_ranks)]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks together: 1 - total compute / (ranks x makespan)."""
        makespan = self.makespan
        if makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(self.num_ranks)) / (self.num_ranks * makespan)

    @property
    def peak_inflight(self) -> list[int]:
        """Per rank: most (stage, micro-batch) activations held at once.

        Held from the forward until the backward that ends them: the full backward,
        or the weight pass when the backward is split.
        """
        peaks = []
        for spans in self._compute:
            held = peak = 0
            for span in spans:
                kind = span.action.kind  # type: ignore[union-attr]  # compute spans hold Instructions
                if kind is Kind.FORWARD:
                    held += 1
                    peak = max(peak, held)
                elif kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
                    held -= 1
            peaks.append(peak)
        return peaks

    @property
    def peak_memory(self) -> list[float]:
        """Per rank, the most bytes held at once in the step (an empty list without a memory track)."""
        return [max((b for _, b, _ in samples), default=0.0) for samples in self.memory or []]

    @property
    def required_memory(self) -> list[float]:
        """Per rank, what must fit: the step's peak, or the optimizer step's after it, whichever is larger."""
        step = self.peak_memory
        after = self.optimizer_peak or [0.0] * len(step)
        return [max(a, b) for a, b in zip(step, after, strict=True)]

    @property
    def peak_actions(self) -> list[Action | None]:
        """Per rank, the action after which it held its peak (the first to reach it)."""
        peaks = []
        for samples in self.memory or []:
            top = max((b for _, b, _ in samples), default=0.0)
            peaks.append(next((a for _, b, a in samples if b == top), None))
        return peaks

    def diagram(self, unit: float = 1.0) -> str:
        """Text Gantt chart, one row per rank, one column per ``unit`` of time; ``.`` is idle.

        Needs spans that start and end on multiples of ``unit`` (unit-cost simulations do).
        """
        origin = self.start
        columns = round(self.makespan / unit)
        labels = [str(s.action) for spans in self._compute for s in spans]
        width = max((len(label) for label in labels), default=1)
        rows = []
        for rank in range(self.num_ranks):
            cells = ["." * 1] * columns
            for span in self._compute[rank]:
                first, last = (span.start - origin) / unit, (span.end - origin) / unit
                if abs(first - round(first)) > 1e-9 or abs(last - round(last)) > 1e-9:
                    raise ValueError(f"span {span} is not aligned to unit={unit}; pass a unit that divides every cost")
                for column in range(round(first), round(last)):
                    cells[column] = str(span.action)
            rows.append(f"rank {rank}: " + " ".join(cell.ljust(width) for cell in cells).rstrip())
        return "\n".join(rows)

    def waits(self, rank: int) -> list[Span]:
        """The spans a rank spent blocked on communication, in time order (measured timelines)."""
        return sorted((s for s in self.spans if s.wait and s.rank == rank), key=lambda s: s.start)

    def plot(self, path: str, title: str | None = None) -> None:
        """Write a PNG Gantt chart: one row per rank, micro-batch numbers on the boxes (needs matplotlib)."""
        from schedules.sim.plot import plot_timelines

        plot_timelines([self], path, titles=[title] if title else None)

    def to_chrome_trace(self, path: str) -> None:
        """Write JSON for chrome://tracing and Perfetto: one process per rank (times in microseconds)."""
        from schedules.sim.chrome import write_chrome_trace

        write_chrome_trace(self, path)

    def summary(self) -> str:
        per_rank = " ".join(f"{b:.3f}" for b in self.bubble_fractions)
        peaks = " ".join(str(n) for n in self.peak_inflight)
        text = (
            f"makespan {self.makespan:g}\n"
            f"bubble fraction {self.bubble_fraction:.4f} (per rank: {per_rank})\n"
            f"peak in-flight micro-batches per rank: {peaks}"
        )
        if self.memory is not None:
            held = ", ".join(
                f"rank {r}: {b:g} after {a}"
                for r, (b, a) in enumerate(zip(self.peak_memory, self.peak_actions, strict=True))
            )
            text += f"\npeak memory per rank: {held}"
        return text
