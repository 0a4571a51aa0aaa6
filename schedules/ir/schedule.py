"""A schedule: placement of stages on ranks and one instruction stream per rank."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace

from schedules.ir.instructions import Action, Instruction, ops_of, parse

__all__ = ["Schedule", "ScheduleError"]

Cell = tuple[int, int]  # (rank, index of the instruction in the rank's stream)


_ONE_NUMBER = ("ranks", "microbatches", "chunks")  # schedule-file fields that hold one integer


def _numbers(name: str, text: str, one: bool = False) -> list[int]:
    """The integers of a schedule-file field (exactly one where ``one``): a ValueError saying what is wrong."""
    try:
        values = [int(x) for x in text.split()]
    except ValueError:
        raise ValueError(f"{name} takes integers, got {text.strip()!r}") from None
    if one and len(values) != 1:
        raise ValueError(f"{name} takes one integer, got {len(values)}: {text.strip()!r}")
    return values


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rule, the values and shows the grid."""


@dataclass(frozen=True)
class Schedule:
    """Plain data: which rank runs each stage, and what each rank runs, in order.

    ``instructions[r]`` is rank ``r``'s stream. A compiler emits compute only;
    ``schedules.lower`` adds the sends and receives. ``no_gradient`` lists the stage
    boundaries (boundary b lies between stage b and b+1) that carry no gradient, e.g.
    behind frozen stages: lowering sends no gradient across them (see schedules.ir.dataflow).
    """

    name: str
    num_ranks: int
    num_microbatches: int
    chunks: int
    placement: tuple[int, ...]  # stage -> rank
    instructions: tuple[tuple[Action, ...], ...]  # rank -> stream
    no_gradient: frozenset[int] = field(default=frozenset())
    tied: tuple[tuple[int, ...], ...] = ()  # per tie group: the stages that hold its weights (schedules.passes.sync)

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
        for group, stages in enumerate(self.tied):
            if len(stages) < 2 or list(stages) != sorted(set(stages)) or not all(0 <= s < p * v for s in stages):
                raise ScheduleError(
                    f"{self.name}: tie group {group} lists stages {list(stages)}; a tie group is two or more "
                    f"stages, in order, among 0..{p * v - 1}"
                )
        outside = sorted(b for b in self.no_gradient if not 0 <= b < p * v - 1)
        if outside:
            raise ScheduleError(
                f"{self.name}: no_gradient names boundaries {outside}; the boundaries of {p * v} stages are "
                f"0..{p * v - 2} (boundary b lies between stage b and stage b+1)"
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

    def without_gradient(self, boundaries: Collection[int]) -> Schedule:
        """The compute order with ``boundaries`` gradient-free: lower it to get the streams without those messages."""
        return replace(self.compute_only(), no_gradient=frozenset(boundaries))

    def compute_only(self) -> Schedule:
        """The same schedule without its communication: what a compiler emits."""
        return self.with_streams(
            (a for a in stream if isinstance(a, Instruction) and a.kind.is_compute) for stream in self.instructions
        )

    def ops(self, rank: int) -> Iterator[tuple[int, Instruction]]:
        """Each instruction of a rank with its index in the stream, posts opened up."""
        for index, action in enumerate(self.instructions[rank]):
            for op in ops_of(action):
                yield index, op

    def describe(self) -> str:
        return (
            f"{self.name}: {self.num_ranks} ranks, {self.num_microbatches} micro-batches, "
            f"{self.chunks} chunk(s) per rank, {self.num_stages} stages"
        )

    def grid(self, marks: Iterable[Cell] = (), context: int | None = None) -> str:
        """The instruction x rank grid (row ``#`` i: each rank's i-th action). ``marks`` are (rank, index)
        cells shown as ``>cell<``.

        With ``context``, only the rows within that distance of a mark are shown
        (and, past 8 ranks, only the marked ranks), so errors on large schedules stay readable.
        """
        marked = set(marks)
        ranks = list(range(self.num_ranks))
        indices = range(max((len(s) for s in self.instructions), default=0))
        rows: list[int | None] = list(indices)
        if context is not None and marked:
            keep = {t for _, index in marked for t in range(index - context, index + context + 1)}
            rows = []
            for index in indices:
                if index in keep:
                    rows.append(index)
                elif rows and rows[-1] is not None:
                    rows.append(None)  # elided rows
            if self.num_ranks > 8:
                ranks = sorted({rank for rank, _ in marked})

        def cell(rank: int, index: int) -> str:
            stream = self.instructions[rank]
            text = str(stream[index]) if index < len(stream) else ""
            return f">{text}<" if (rank, index) in marked else text

        header = ["#"] + [f"rank {r}" for r in ranks]
        table = [[str(index)] + [cell(r, index) for r in ranks] if index is not None else ["..."] for index in rows]
        widths = [max(len(row[i]) for row in [header] + table if i < len(row)) for i in range(len(header))]
        lines = []
        for row in [header] + table:
            cells = [text.rjust(widths[0]) if i == 0 else text.ljust(widths[i]) for i, text in enumerate(row)]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        stages = " ".join(str(r) for r in self.placement)
        return f"{self.describe()}; stage->rank: {stages}\n{self.grid()}"

    def to_text(self) -> str:
        """The whole schedule as text that ``from_text`` reads back: a file a user can write or edit::

            schedule 1f1b
            ranks 2
            microbatches 2
            chunks 1
            placement 0 1
            rank 0: 0F0 0SF0 0F1 0SF1+0RB0 0B0 0RB1 0B1
            rank 1: 1RF0 1F0 1RF1 1B0 1SB0 1F1 1B1 1SB1

        (and ``no-gradient 0 2`` when boundaries carry no gradient, ``tied 0 7`` per group of stages that
        share a weight). Lines starting with ``#`` are comments.
        """
        lines = [
            f"schedule {self.name}",
            f"ranks {self.num_ranks}",
            f"microbatches {self.num_microbatches}",
            f"chunks {self.chunks}",
            "placement " + " ".join(map(str, self.placement)),
        ]
        if self.no_gradient:
            lines.append("no-gradient " + " ".join(map(str, sorted(self.no_gradient))))
        lines += ["tied " + " ".join(map(str, stages)) for stages in self.tied]
        lines += [f"rank {r}: " + " ".join(map(str, stream)) for r, stream in enumerate(self.instructions)]
        return "\n".join(line.rstrip() for line in lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Read the form ``to_text`` writes. Raises ScheduleError naming the line that is wrong."""
        fields: dict[str, tuple[int, str]] = {}  # field -> (line number, its text)
        tied: list[tuple[int, ...]] = []
        streams: dict[int, tuple[int, tuple[Action, ...]]] = {}  # rank -> (line number, stream)
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            word, _, rest = line.partition(" ")
            try:
                if word == "rank":
                    rank, colon, ops = rest.partition(":")
                    if not colon or not rank.strip().isdigit():
                        raise ValueError("a stream line reads 'rank <r>: <action> <action> ...'")
                    if int(rank) in streams:
                        given = streams[int(rank)][0]
                        raise ValueError(f"rank {int(rank)}'s stream was given already, on line {given}")
                    streams[int(rank)] = (number, tuple(parse(op) for op in ops.split()))
                elif word in ("schedule", "ranks", "microbatches", "chunks", "placement", "no-gradient"):
                    if word in fields:
                        raise ValueError(f"{word!r} was given already, on line {fields[word][0]}")
                    fields[word] = (number, rest.strip())
                    if word in _ONE_NUMBER:
                        _numbers(word, rest, one=True)
                    elif word != "schedule":
                        _numbers(word, rest)
                elif word == "tied":
                    tied.append(tuple(_numbers("tied", rest)))
                else:
                    raise ValueError(
                        f"unknown field {word!r}; the fields are schedule, ranks, microbatches, chunks, placement, "
                        "no-gradient, tied and 'rank <r>:' lines"
                    )
            except ValueError as error:
                raise ScheduleError(f"line {number}: {raw.strip()!r}: {error}") from None
        missing = [f for f in ("ranks", "microbatches", "placement") if f not in fields]
        if missing:
            raise ScheduleError(f"the schedule text has no {', '.join(missing)} line; see Schedule.to_text's form")

        def numbers(name: str) -> list[int]:
            return _numbers(name, fields[name][1]) if name in fields else []

        (p,), (m,) = numbers("ranks"), numbers("microbatches")
        placement = tuple(numbers("placement"))
        chunks = numbers("chunks") or [len(placement) // max(p, 1)]
        if sorted(streams) != list(range(p)):
            raise ScheduleError(
                f"the schedule has ranks {p}, so it needs lines 'rank 0:' .. 'rank {p - 1}:', "
                f"got ranks {sorted(streams)}"
            )
        name = fields["schedule"][1] if "schedule" in fields else "custom"
        return cls(
            name,
            p,
            m,
            chunks[0],
            placement,
            tuple(streams[r][1] for r in range(p)),
            frozenset(numbers("no-gradient")),
            tuple(tied),
        )

    def error(self, rule: str, detail: str, marks: Iterable[Cell] = ()) -> ScheduleError:
        """A ScheduleError naming the rule and the values, with the marked cells shown in the grid."""
        marks = list(marks)
        small = self.num_ranks <= 8 and max((len(s) for s in self.instructions), default=0) <= 64
        where = self.grid(marks, context=4) if marks else (self.grid() if small else "")
        return ScheduleError(f"{self.describe()}\nrule broken: {rule}\n{detail}\n\n{where}".rstrip())
