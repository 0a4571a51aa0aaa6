"""Cost-model simulator: replays each rank's stream and returns a Timeline."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from schedules.ir.dataflow import Dataflow
from schedules.ir.gcpause import gc_paused
from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule
from schedules.sim.entries import Charges, Entry, priced, skeletons
from schedules.sim.memory_model import Memory, peaks, track
from schedules.sim.perstage import PerStage, expand
from schedules.sim.sharing import shared
from schedules.sim.timeline import Span, Timeline

__all__ = ["Costs", "Summary", "replay", "simulate", "summarize"]


@dataclass(frozen=True)
class Costs:
    """Time of each instruction kind, one number or one per stage.

    ``backward`` (the full backward) defaults to ``backward_input + backward_weight``.
    A message between stages s and s+1 takes ``latency + per_byte * message_bytes[s]``,
    where ``message_bytes[s]`` is the size of stage s's output (and of its gradient).
    ``memory``: the bytes each stage holds (schedules.sim.memory_model); with them the simulated
    timeline carries each rank's memory over time and its peak.
    ``all_reduce``: seconds of stage s's gradient sync (AR): asynchronous from its post, one at a time on a
    rank (in program order), and the step ends when the last is done. ``gather``: seconds before stage s's first
    forward of the step can start on its rank (FSDP's all-gather of its parameters). ``processors``: how many ranks
    can compute at full speed at once (CPU ranks sharing a machine's cores; schedules.sim.sharing); None: each rank
    its own. ``forward_wait`` (``backward_wait``): of stage s's forward (its B and I), the seconds it waits on other
    ranks (tensor parallelism's collectives inside it), which take no processor where ranks share them.
    ``post``: seconds of rank time each post of communication takes (making its buffers, issuing it), plus
    ``post_message`` for each message it posts. ``sync_host``: seconds of rank time at stage s's AR before its
    collective runs (flattening the gradients). ``sync_blocking``: each AR holds its rank until its collective is
    done (FSDP's reduce-scatter) instead of running beside what follows. ``wake``: where ranks share processors, how
    late a compute woken by its input starts while other work runs, by that work's mean price ((price, seconds)
    points sorted by price; schedules.sim.sharing); empty: at once.
    ``unit``: what the times are in, which the simulated timeline keeps: "s" for seconds (``from_timeline`` of a
    measured step, the planner's prices), "" for cost units.
    """

    forward: PerStage = 1.0
    backward: PerStage | None = None
    backward_input: PerStage = 1.0
    backward_weight: PerStage = 1.0
    latency: float = 0.0
    per_byte: float = 0.0
    message_bytes: PerStage = 0.0
    memory: Memory | None = None
    all_reduce: PerStage = 0.0
    gather: PerStage = 0.0
    processors: float | None = None
    forward_wait: PerStage = 0.0
    backward_wait: PerStage = 0.0
    post: float = 0.0
    post_message: float = 0.0
    sync_host: PerStage = 0.0
    sync_blocking: bool = False
    wake: tuple[tuple[float, float], ...] = ()
    unit: str = ""

    @classmethod
    def from_timeline(cls, timeline: Timeline) -> Costs:
        """A cost model from a (measured) timeline: the median time of each compute kind on each stage,
        and the bytes each stage held, where the timeline measured them (``timeline.sizes``), in its unit.

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
            memory=timeline.sizes,
            unit=timeline.unit,
        )

    def per_stage(self, num_stages: int) -> dict[Kind, list[float]]:
        """Expand to one list per compute kind, one value per stage."""
        weight = expand("Costs.backward_weight", self.backward_weight, num_stages)
        grad_input = expand("Costs.backward_input", self.backward_input, num_stages)
        if self.backward is None:
            backward = [i + w for i, w in zip(grad_input, weight, strict=True)]
        else:
            backward = expand("Costs.backward", self.backward, num_stages)
        return {
            Kind.FORWARD: expand("Costs.forward", self.forward, num_stages),
            Kind.BACKWARD: backward,
            Kind.BACKWARD_INPUT: grad_input,
            Kind.BACKWARD_WEIGHT: weight,
        }

    def message_times(self, num_stages: int) -> list[float]:
        """Per stage s, the time of a message across boundary s|s+1 (the last entry is unused)."""
        sizes = expand("Costs.message_bytes", self.message_bytes, num_stages)
        return [self.latency + self.per_byte * size for size in sizes]


@gc_paused()
def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Replay every rank's stream under a cost model (default: unit costs, free communication).

    Posting communication takes no time on the rank; a compute waits until its input
    has arrived: max(send posted, recv posted) + message time. A compute-only schedule
    (not lowered) is simulated too, with each message leaving when its producer ends.
    Communication spans run from posting to completion, beside the compute spans. With
    ``costs.memory`` the timeline also carries each rank's bytes over time (``memory``) and
    its peak (``peak_memory``, reached by ``peak_actions``). Raises ScheduleError if the
    streams cannot make progress.
    """
    costs = costs or Costs()
    times = run(schedule, costs)
    timeline = _timeline(schedule, times, schedule.name, costs.unit)
    if costs.memory is not None:
        timeline.memory = track(schedule, times, costs.memory)
        timeline.sizes = costs.memory
        timeline.optimizer_peak = costs.memory.optimizer_peak(schedule.placement)
    return timeline


@dataclass(frozen=True)
class Summary:
    """What a search keeps of a simulated step (``simulate``'s timeline without its spans): the makespan, the idle
    share of all ranks together, and per rank what must fit in memory (empty without ``Costs.memory``)."""

    makespan: float
    bubble_fraction: float
    required_memory: tuple[float, ...]


def summarize(schedule: Schedule, costs: Costs) -> Summary:
    """``simulate(schedule, costs)``'s makespan, bubble fraction and required memory, without building its spans (a
    search prices thousands of candidates; call it inside ``gc_paused()``)."""
    times = run(schedule, costs)
    start = min((t[0] for rank in times for t in rank), default=0.0)
    end = max((t[1] for rank in times for t in rank), default=0.0)
    makespan = end - start
    busy = 0.0
    for stream, rank in zip(schedule.instructions, times, strict=True):
        for action, (began, ended) in zip(stream, rank, strict=True):
            if isinstance(action, Instruction) and action.kind.is_compute:
                busy += ended - began
    bubble = 1.0 - busy / (schedule.num_ranks * makespan) if makespan > 0 else 0.0
    if costs.memory is None:
        return Summary(makespan, bubble, ())
    during = peaks(schedule, times, costs.memory)
    after = costs.memory.optimizer_peak(schedule.placement)
    return Summary(makespan, bubble, tuple(max(a, b) for a, b in zip(during, after, strict=True)))


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
    A compute starts when its rank is free, its own stage's earlier half is done (B and I after F,
    W after I) and the message it consumes (schedules.ir.dataflow) is there: at once for a handoff
    on its rank, else when both the send and the recv are posted, plus the message time.
    """
    p, S, M = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    flow = Dataflow.of(schedule)
    table, message = costs.per_stage(S), costs.message_times(S)
    forward_end: list[float | None] = [None] * (S * M)  # stage*M + mb -> when its F ended
    input_end: list[float | None] = [None] * (S * M)  # stage*M + mb -> when its B or I ended (W waits for it)
    made: list[float | None] = [None] * flow.num_keys  # message -> when its producer ended
    sent: list[float | None] = [None] * flow.num_keys  # message -> when its send was posted
    received: list[float | None] = [None] * flow.num_keys  # message -> when its recv was posted
    shapes, has_recv = skeletons(schedule, flow)  # lowered schedules wait for their recvs, compute-only do not
    charges = _charges(costs, S)
    programs = [
        priced(skeleton, table, None if durations is None else iter(durations[rank]), charges)
        for rank, skeleton in enumerate(shapes)
    ]
    ready, done, post, stuck = _rules(schedule, (forward_end, input_end, made, sent, received), has_recv, message)
    if costs.processors is not None and costs.processors < p:  # the ranks share fewer processors than they are
        ended: dict[tuple[int, int], float] = {}  # the asynchronous collectives, run sharing them too
        spans = shared(programs, costs.processors, ready, done, post, stuck, ended, _wake(costs.wake))
        return _collectives(programs, spans, sent, received, message, M, ended)
    times: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    pcs, clocks, channels = [0] * p, [0.0] * p, [0.0] * p
    remaining = sum(len(program) for program in programs)
    while remaining:
        progress = False
        for rank in range(p):
            program, pc, clock, out = programs[rank], pcs[rank], clocks[rank], times[rank]
            while pc < len(program):
                entry = program[pc]
                if entry.kind is None:  # communication: post and go on; completion is filled in below
                    began = clock
                    clock += entry.host  # the host time it takes to post
                    if entry.hold:  # a blocking collective: the rank waits for it, one at a time with its others
                        clock = channels[rank] = max(clock, channels[rank]) + entry.hold
                    post(entry, clock)
                    out.append((began, clock))
                    pc += 1
                    continue
                start = ready(entry, clock)
                if start is None:
                    break
                clock = start + entry.price
                out.append((start, clock))
                done(entry, clock)
                pc += 1
            if pc != pcs[rank]:
                progress = True
                remaining -= pc - pcs[rank]
                pcs[rank], clocks[rank] = pc, clock
        if not progress:
            raise stuck([(r, pcs[r]) for r in range(p) if pcs[r] < len(programs[r])])
    return _collectives(programs, times, sent, received, message, M)


def _wake(points: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Costs.wake checked: (price, seconds) points, sorted by price, none negative."""
    found = tuple((float(size), float(late)) for size, late in points)
    if any(size < 0 or late < 0 for size, late in found) or list(found) != sorted(found):
        raise ValueError(f"Costs.wake must be (price, seconds) points sorted by price, none negative; got {found}")
    return found


def _charges(costs: Costs, stages: int) -> Charges:
    """What entries.priced charges beyond the compute table (its Charges), checked and expanded per stage."""
    forward = expand("Costs.forward_wait", costs.forward_wait, stages)
    backward = expand("Costs.backward_wait", costs.backward_wait, stages)
    waits = {_F: forward, Kind.BACKWARD: backward, Kind.BACKWARD_INPUT: backward, _W: [0.0] * stages}
    for name, value in (("Costs.post", costs.post), ("Costs.post_message", costs.post_message)):
        if value < 0:
            raise ValueError(f"{name} must not be negative, got {value}")
    return Charges(
        expand("Costs.all_reduce", costs.all_reduce, stages),
        expand("Costs.gather", costs.gather, stages),
        waits,
        float(costs.post),
        float(costs.post_message),
        expand("Costs.sync_host", costs.sync_host, stages),
        bool(costs.sync_blocking),
    )


def _rules(
    schedule: Schedule,
    ends: tuple[list[float | None], list[float | None], list[float | None], list[float | None], list[float | None]],
    has_recv: list[bool],
    message: list[float],
) -> tuple[
    Callable[[Entry, float], float | None],
    Callable[[Entry, float], None],
    Callable[[Entry, float], None],
    Callable[[list[tuple[int, int]]], Exception],
]:
    """run()'s rules over its records (``ends``: when each F and B or I ended, each message was made, its send and
    its recv posted), for both replays: ``ready(entry, free)``, when a compute can start on a rank free since
    ``free`` (None while an input's time is unknown); ``done(entry, end)``, a compute ended; ``post(entry, at)``,
    communication posted; ``stuck(waits)``, the error when no rank can go on."""
    forward_end, input_end, made, sent, received = ends
    M = schedule.num_microbatches

    def ready(entry: Entry, free: float) -> float | None:
        kind, index, needs, crosses = entry.kind, entry.slot, entry.needs, entry.crosses
        start = 0.0 if kind is _F else (input_end[index] if kind is _W else forward_end[index])
        if start is None or needs < 0:
            return None if start is None else max(start, free)
        at = made[needs]
        if at is not None and crosses:
            if has_recv[needs]:
                posted, wanted = sent[needs], received[needs]
                at = None if posted is None or wanted is None else max(posted, wanted)
            if at is not None:
                at += message[(needs >> 1) // M]
        return None if at is None else max(at, start, free)

    def done(entry: Entry, end: float) -> None:
        kind, index, makes = entry.kind, entry.slot, entry.makes
        if kind is _F:
            forward_end[index] = end
        elif kind is not _W:
            input_end[index] = end
        if makes >= 0:
            made[makes] = end

    def post(entry: Entry, at: float) -> None:
        for key, is_send in entry.keys:
            if is_send:
                sent[key] = at
            else:
                received[key] = at

    def stuck(waits: list[tuple[int, int]]) -> Exception:
        where = ", ".join(f"rank {r} at instruction {pc} ({schedule.instructions[r][pc]})" for r, pc in waits)
        error: Exception = schedule.error("every rank can make progress", f"the simulation is stuck: {where}", waits)
        return error

    return ready, done, post, stuck


def _collectives(
    programs: list[list[Entry]],
    times: list[list[tuple[float, float]]],
    sent: list[float | None],
    received: list[float | None],
    message: list[float],
    M: int,
    ended: dict[tuple[int, int], float] | None = None,
) -> list[list[tuple[float, float]]]:
    """Each communication's end: a message when it has arrived, a rank's collectives one at a time in program order
    from their post (asynchronous: no rank waits on them; a blocking one ended where the replay put it; ``ended``:
    where the shared-processor replay ran the asynchronous ones)."""
    for rank, (program, out) in enumerate(zip(programs, times, strict=True)):
        channel = 0.0  # a rank's collectives run one at a time, in program order
        for index, entry in enumerate(program):
            if entry.kind is not None:
                continue
            began, posted_at = out[index]
            if entry.hold:  # blocking: done when the rank went on
                channel = max(channel, posted_at)
            elif entry.price > 0:  # an asynchronous collective with a price
                channel = ended[rank, index] if ended is not None else max(posted_at, channel) + entry.price
                out[index] = (began, channel)
            else:
                end = posted_at
                for key, _ in entry.keys:
                    posted, wanted = sent[key], received[key]
                    if posted is not None and wanted is not None:
                        end = max(end, max(posted, wanted) + message[(key >> 1) // M])
                out[index] = (began, end)
    return times


_F, _W = Kind.FORWARD, Kind.BACKWARD_WEIGHT
