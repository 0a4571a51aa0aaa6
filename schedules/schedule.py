"""A schedule: placement of stages on ranks and one instruction stream per rank."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from schedules.instructions import Action, Instruction, ops_of

__all__ = ["Schedule", "ScheduleError"]

Cell = tuple[int, int]  # (rank, step)


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rule, the values and shows the grid."""


@dataclass(frozen=True)
class Schedule:
    """Plain data: which rank runs each stage, and what each rank runs, in order.

    ``instructions[r]`` is rank ``r``'s stream. A compiler emits compute only;
    :func:`schedules.lower` adds the sends and receives.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    chunks: int
    placement: tuple[int, ...]  # stage -> rank
    instructions: tuple[tuple[Action, ...], ...]  # rank -> stream

    def __post_init__(self) -> None:
        p, m, v = self.num_ranks, self.num_microbatches, self.chunks
        if p < 1 or m < 1 or v < 1:
            raise ScheduleError(f"{self.name}: ranks, micro-batches and chunks must be >= 1, got p={p} m={m} v={v}")
        if len(self.placement) != p * v:
            raise ScheduleError(
                f"{self.name}: placement lists {len(self.placement)} stages, "
                f"expected ranks x chunks = {p}x{v} = {p * v}"
            )
        if len(self.instructions) != p:
            raise ScheduleError(f"{self.name}: {len(self.instructions)} instruction streams for {p} ranks")
        for rank in range(p):
            hosted = self.placement.count(rank)
            if hosted != v:
                raise ScheduleError(
                    f"{self.name}: rank {rank} hosts {hosted} stages, every rank must host chunks={v} "
                    f"(placement {list(self.placement)})"
                )

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages a rank runs, in stage order."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def with_streams(self, streams: Iterable[Iterable[Action]], name: str | None = None) -> Schedule:
        """The same ranks, micro-batches and placement running other streams (a pass's output)."""
        return replace(self, name=name or self.name, instructions=tuple(tuple(stream) for stream in streams))

    def compute_only(self) -> Schedule:
        """The same schedule without its communication: what a compiler emits."""
        return self.with_streams(
            (a for a in stream if isinstance(a, Instruction) and a.kind.is_compute) for stream in self.instructions
        )

    def ops(self, rank: int) -> Iterator[tuple[int, Instruction]]:
        """Each instruction of a rank with its step, batches opened up."""
        for step, action in enumerate(self.instructions[rank]):
            for op in ops_of(action):
                yield step, op

    def describe(self) -> str:
        return (
            f"{self.name}: {self.num_ranks} ranks, {self.num_microbatches} micro-batches, "
            f"{self.chunks} chunk(s) per rank, {self.num_stages} stages"
        )

    def grid(self, marks: Iterable[Cell] = (), context: int | None = None) -> str:
        """The step x rank grid. ``marks`` are (rank, step) cells shown as ``>cell<``.

        With ``context``, only the steps within that distance of a mark are shown
        (and, past 8 ranks, only the marked ranks), so errors on large schedules stay readable.
        """
        marked = set(marks)
        ranks = list(range(self.num_ranks))
        steps = range(max((len(s) for s in self.instructions), default=0))
        rows: list[int | None] = list(steps)
        if context is not None and marked:
            keep = {t for _, step in marked for t in range(step - context, step + context + 1)}
            rows = []
            for step in steps:
                if step in keep:
                    rows.append(step)
                elif rows and rows[-1] is not None:
                    rows.append(None)  # elided steps
            if self.num_ranks > 8:
                ranks = sorted({rank for rank, _ in marked})

        def cell(rank: int, step: int) -> str:
            stream = self.instructions[rank]
            text = str(stream[step]) if step < len(stream) else ""
            return f">{text}<" if (rank, step) in marked else text

        header = ["step"] + [f"rank {r}" for r in ranks]
        table = [[str(step)] + [cell(r, step) for r in ranks] if step is not None else ["..."] for step in rows]
        widths = [max(len(row[i]) for row in [header] + table if i < len(row)) for i in range(len(header))]
        lines = []
        for row in [header] + table:
            cells = [text.rjust(widths[0]) if i == 0 else text.ljust(widths[i]) for i, text in enumerate(row)]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        stages = " ".join(str(r) for r in self.placement)
        return f"{self.describe()}; stage->rank: {stages}\n{self.grid()}"

    def error(self, rule: str, detail: str, marks: Iterable[Cell] = ()) -> ScheduleError:
        """A ScheduleError naming the rule and the values, with the marked cells shown in the grid."""
        marks = list(marks)
        small = self.num_ranks <= 8 and max(len(s) for s in self.instructions) <= 64
        where = self.grid(marks, context=4) if marks else (self.grid() if small else "")
        return ScheduleError(f"{self.describe()}\nrule broken: {rule}\n{detail}\n\n{where}".rstrip())
