"""Cost-model simulator: replays each rank's stream and returns a Timeline."""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from schedules.gcpause import gc_paused
from schedules.instructions import Action, Batch, Instruction, Kind, message_key, ops_of
from schedules.schedule import Schedule
from schedules.timeline import Span, Timeline

__all__ = ["Costs", "replay", "simulate"]

PerStage = float | Sequence[float]


@dataclass(frozen=True)
class Costs:
    """Time of each instruction kind, one number or one per stage.

    ``backward`` (the full backward) defaults to ``backward_input + backward_weight``.
    A message between stages s and s+1 takes ``latency + per_byte * message_bytes[s]``,
    where ``message_bytes[s]`` is the size of stage s's output (and of its gradient).
    """

    forward: PerStage = 1.0
    backward: PerStage | None = None
    backward_input: PerStage = 1.0
    backward_weight: PerStage = 1.0
    latency: float = 0.0
    per_byte: float = 0.0
    message_bytes: PerStage = 0.0

    @classmethod
    def from_timeline(cls, timeline: Timeline) -> Costs:
        """A cost model from a (measured) timeline: the median time of each compute kind on each stage.

        Communication is taken as free; kinds a stage never ran cost 0.
        """
        durations: dict[tuple[Kind, int], list[float]] = {}
        for rank in range(timeline.num_ranks):
            for span in timeline.compute_spans(rank):
                op = span.action
                if isinstance(op, Instruction):  # always, for compute spans
                    durations.setdefault((op.kind, op.stage), []).append(span.duration)
        if not durations:
            raise ValueError(f"timeline {timeline.label!r} has no compute spans to take costs from")
        stages = 1 + max(stage for _, stage in durations)

        def medians(kind: Kind) -> list[float]:
            return [statistics.median(durations.get((kind, s), [0.0])) for s in range(stages)]

        split = any(kind is Kind.BACKWARD_INPUT for kind, _ in durations)
        return cls(
            forward=medians(Kind.FORWARD),
            backward=None if split else medians(Kind.BACKWARD),
            backward_input=medians(Kind.BACKWARD_INPUT),
            backward_weight=medians(Kind.BACKWARD_WEIGHT),
        )

    def per_stage(self, num_stages: int) -> dict[Kind, list[float]]:
        """Expand to one list per kind (compute kinds, and the message time under SEND_ACTIVATION)."""

        def expand(name: str, value: PerStage) -> list[float]:
            if isinstance(value, (int, float)):
                values = [float(value)] * num_stages
            else:
                values = [float(x) for x in value]
                if len(values) != num_stages:
                    raise ValueError(f"Costs.{name} has {len(values)} values, the schedule has {num_stages} stages")
            if any(x < 0 for x in values):
                raise ValueError(f"Costs.{name} must not be negative, got {values}")
            return values

        weight = expand("backward_weight", self.backward_weight)
        grad_input = expand("backward_input", self.backward_input)
        if self.backward is None:
            backward = [i + w for i, w in zip(grad_input, weight, strict=True)]
        else:
            backward = expand("backward", self.backward)
        size = expand("message_bytes", self.message_bytes)
        return {
            Kind.FORWARD: expand("forward", self.forward),
            Kind.BACKWARD: backward,
            Kind.BACKWARD_INPUT: grad_input,
            Kind.BACKWARD_WEIGHT: weight,
            Kind.SEND_ACTIVATION: [self.latency + self.per_byte * b for b in size],
        }


@gc_paused()
def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Replay every rank's stream under a cost model (default: unit costs, free communication).

    Posting communication takes no time on the rank; a compute waits until its input
    has arrived: max(send posted, recv posted) + message time. A compute-only schedule
    (not lowered) is simulated too, with each message leaving when its producer ends.
    Communication spans run from posting to completion, beside the compute spans.
    Raises ScheduleError if the streams cannot make progress.
    """
    return _timeline(schedule, run(schedule, costs or Costs()), schedule.name)


@gc_paused()
def replay(schedule: Schedule, measured: Timeline) -> Timeline:
    """Replay the streams with every compute taking exactly its time in ``measured``, messages free.

    ``simulate(schedule, Costs.from_timeline(measured))`` charges each instruction its kind's
    median, so a run whose computes vary (a shared machine) looks slower than its model. Here each
    keeps its own time, so ``measured.makespan / replay(...).makespan`` measures what the run lost
    to everything but compute: posting, waiting on messages, bookkeeping.
    ``measured`` must hold, rank by rank and in order, the compute of ``schedule``'s streams (a
    gloo run's timeline qualifies: ``receives_first`` moves only recvs).
    """
    durations = []
    for rank, stream in enumerate(schedule.compute_only().instructions):
        spans = measured.compute_spans(rank)
        ran, wanted = [span.action for span in spans], list(stream)
        if ran != wanted:
            at = next((i for i, (a, b) in enumerate(zip(ran, wanted, strict=False)) if a != b), None)
            where = "" if at is None else f"; compute {at} is {ran[at]} where the stream has {wanted[at]}"
            raise ValueError(
                f"replay needs each rank's measured compute in its stream's order: rank {rank} ran {len(ran)} "
                f"computes, its stream of {schedule.name!r} has {len(wanted)}{where}; "
                "pass the timeline of a run of this same schedule"
            )
        durations.append([span.duration for span in spans])
    return _timeline(schedule, run(schedule, Costs(), durations), f"{schedule.name} replayed", measured.unit)


def _timeline(schedule: Schedule, times: list[list[tuple[float, float]]], label: str, unit: str = "") -> Timeline:
    spans = [
        Span(rank, action, start, end)
        for rank, stream in enumerate(schedule.instructions)
        for action, (start, end) in zip(stream, times[rank], strict=True)
    ]
    return Timeline(schedule.num_ranks, spans, label=label, unit=unit)


def run(
    schedule: Schedule, costs: Costs, durations: Sequence[Sequence[float]] | None = None
) -> list[list[tuple[float, float]]]:
    """(start, end) of every action of every rank, in program order.

    ``durations``: per rank, the time of each of its computes in stream order, in place of ``costs``'.
    """
    p, S, M = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    table = costs.per_stage(S)
    message = table[Kind.SEND_ACTIVATION]
    placement = schedule.placement
    # messages are keyed by message_key(): boundary s|s+1, micro-batch, and bit 0 set for gradients
    forward_end: list[float | None] = [None] * (S * M)  # stage*M + mb -> when its output exists
    grad_end: list[float | None] = [None] * (S * M)  # stage*M + mb -> when its input's gradient exists
    sent: list[float | None] = [None] * (2 * S * M)  # message -> when its send was posted
    received: list[float | None] = [None] * (2 * S * M)  # message -> when its recv was posted
    has_recv = [False] * (2 * S * M)  # lowered schedules wait for their recvs, compute-only ones do not
    programs = [
        _compile(stream, table, M, has_recv, None if durations is None else iter(durations[rank]))
        for rank, stream in enumerate(schedule.instructions)
    ]

    def arrival(key: int, produced: float | None, boundary: int) -> float | None:
        if produced is None:
            return None
        if not has_recv[key]:
            return produced + message[boundary]
        posted, wanted = sent[key], received[key]
        if posted is None or wanted is None:
            return None
        return (posted if posted > wanted else wanted) + message[boundary]

    times: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    pcs, clocks = [0] * p, [0.0] * p
    remaining = sum(len(program) for program in programs)
    while remaining:
        progress = False
        for rank in range(p):
            program, pc, clock, out = programs[rank], pcs[rank], clocks[rank], times[rank]
            while pc < len(program):
                kind, s, mb, cost, keys = program[pc]
                if kind is None:  # communication: post and go on; completion is filled in below
                    for key, is_send in keys:
                        if is_send:
                            sent[key] = clock
                        else:
                            received[key] = clock
                    out.append((clock, clock))
                    pc += 1
                    continue
                index = s * M + mb
                if kind is _F:
                    if s == 0:
                        start: float | None = 0.0
                    elif placement[s - 1] == rank:
                        start = forward_end[index - M]
                    else:
                        start = arrival((index - M) << 1, forward_end[index - M], s - 1)
                elif kind is _W:
                    start = grad_end[index]
                else:
                    start = forward_end[index]
                    if start is not None and s < S - 1:
                        produced = grad_end[index + M]
                        if placement[s + 1] != rank:
                            produced = arrival(index << 1 | 1, produced, s)
                        start = None if produced is None else (start if start > produced else produced)
                if start is None:
                    break
                if clock > start:
                    start = clock
                clock = start + cost
                out.append((start, clock))
                if kind is _F:
                    forward_end[index] = clock
                elif kind is not _W:
                    grad_end[index] = clock
                pc += 1
            if pc != pcs[rank]:
                progress = True
                remaining -= pc - pcs[rank]
                pcs[rank], clocks[rank] = pc, clock
        if not progress:
            stuck = [(r, pcs[r]) for r in range(p) if pcs[r] < len(programs[r])]
            waits = ", ".join(f"rank {r} at step {pc} ({schedule.instructions[r][pc]})" for r, pc in stuck)
            raise schedule.error("every rank can make progress", f"the simulation is stuck: {waits}", stuck)

    for program, out in zip(programs, times, strict=True):
        for step, (kind, _, _, _, keys) in enumerate(program):
            if kind is None:
                end = posted_at = out[step][0]
                for key, _ in keys:
                    posted, wanted = sent[key], received[key]
                    if posted is not None and wanted is not None:
                        end = max(end, max(posted, wanted) + message[(key >> 1) // M])
                out[step] = (posted_at, end)
    return times


_F, _W = Kind.FORWARD, Kind.BACKWARD_WEIGHT
# per action: compute (kind, stage, mb, cost, ()) or communication (None, 0, 0, 0.0, ((message, is_send), ...))
Entry = tuple[Kind | None, int, int, float, tuple[tuple[int, bool], ...]]


def _compile(
    stream: tuple[Action, ...],
    table: dict[Kind, list[float]],
    M: int,
    has_recv: list[bool],
    durations: Iterator[float] | None,
) -> list[Entry]:
    """Flatten a rank's stream into tuples for the hot loop, marking the messages it receives."""
    program: list[Entry] = []
    for action in stream:
        if isinstance(action, Instruction) and action.kind.is_collective:  # asynchronous, free here
            program.append((None, 0, 0, 0.0, ()))
        elif isinstance(action, Batch) or not action.kind.is_compute:
            keys = tuple((message_key(op, M), op.kind.is_send) for op in ops_of(action))
            for key, is_send in keys:
                if not is_send:
                    has_recv[key] = True
            program.append((None, 0, 0, 0.0, keys))
        else:
            cost = table[action.kind][action.stage] if durations is None else next(durations)
            program.append((action.kind, action.stage, action.microbatch, cost, ()))
    return program
