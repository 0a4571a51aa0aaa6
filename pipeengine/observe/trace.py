"""Tracing: when each instruction ran on this rank, gathered to rank 0 as a schedules.Timeline.

CPU marks are time.perf_counter(). After a traced step, rank 0 estimates every rank's
clock offset by ping-pong (NTP's rule: of a few round trips, trust the fastest, error
at most half its round trip) and puts all spans on its own clock:

    rank 0   t0 ──ping──►        ◄──pong(t_r)── t1      offset_r = t_r - (t0 + t1) / 2
    rank r          └─ reads its clock t_r ─┘

CUDA marks are events on the compute stream, read once at the end of the traced step
(the only place tracing synchronises), with time zero taken as the traced step's
barrier returns on each rank: aligned to about the collective's skew.

Every rank's time zero is taken after that barrier (pipeengine.train.tracing), once all have set
their tracing up: a timeline shows the step, not one rank's setup ahead of the others'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import NamedTuple, Protocol

import torch

from pipeengine.comm.base import Transfer, Transport
from pipeengine.observe.ledger import Ledger, StageSizes
from schedules import Action, Instruction, Kind, Memory, Semantics, Span, Timeline

__all__: list[str] = []

Mark = float | torch.cuda.Event
PINGS = 8  # round trips per rank for the clock offset
# the prefix of an instruction's range in the user's profiler: "pipeengine/2F0" (a bare "2F0" reads as a C++ mangled
# name, which the profiler demangles to "F0")
RANGE = "pipeengine/"


def _warm_ranges() -> None:
    """Open one range now, with no profiler on: torch's record_function imports a module on its first use
    (torch.profiler._cupti_monitor, torch 2.13). Imported while the user's profiler records with_stack, that module's
    code object is freed before the profiler reads the names of the Python calls it recorded, which point into it:
    ``prof.events()`` then reads garbage (UnicodeDecodeError). Under a profiler already recording this changes
    nothing."""
    with torch.profiler.record_function(RANGE + "import"):
        pass


_warm_ranges()


class _Span:
    """``with tracer.span(action):`` records the block as a span (when it completes); while a torch.profiler records
    (the user's), the block is also a range in it, named as the timeline names the action."""

    __slots__ = ("tracer", "action", "wait", "start", "range")

    def __init__(self, tracer: Tracer, action: Action, wait: bool) -> None:
        self.tracer, self.action, self.wait = tracer, action, wait
        self.range: torch.profiler.record_function | None = None

    def __enter__(self) -> None:
        if self.tracer.profiled:
            name = f"wait {self.action}" if self.wait else str(self.action)
            self.range = torch.profiler.record_function(RANGE + name)
            self.range.__enter__()
        self.start = self.tracer.mark()

    def __exit__(self, kind: type[BaseException] | None, value: object, trace: TracebackType | None) -> None:
        if kind is None and self.tracer.records is not None:
            self.tracer.records.append((self.action, self.start, self.tracer.mark(), self.wait))
        if self.range is not None:
            self.range.__exit__(kind, value, trace)


def profiling() -> bool:
    """Whether a torch.profiler is recording in this process (the user's: each instruction is a range in it)."""
    return bool(torch.autograd._profiler_enabled())  # type: ignore[attr-defined]


def profiler_open() -> bool:
    """Whether a torch.profiler is open in this process, recording or about to (a scheduled profiler's wait and
    warmup phases prepare kineto without recording; a profiler of the engine's own started then would take the
    session from under it, and the user's crashes when it turns active). torch keeps no record of a prepared
    session: the open profilers are found among the live objects (tens of milliseconds, once per traced step)."""
    if profiling():
        return True
    import gc

    kind = torch.autograd.profiler.profile
    return any(type(o) is kind and o.entered and o.kineto_results is None for o in gc.get_objects())


class RankTrace(NamedTuple):
    """What a rank sends rank 0 at a traced step's end."""

    origin: float  # its time zero, on its clock (seconds; 0 where a CUDA event marks it)
    spans: list[Span]
    samples: list[tuple[float, float, Action | None]]  # (seconds since zero, bytes held, after which instruction)
    sizes: dict[int, StageSizes]  # its stages, measured for this step
    allocated: float | None  # the allocator's peak in the step, where it was watched
    optimizer: float  # the optimizer step's peak after it
    tie_sync: dict[int, float]  # tie group -> the bytes its TR flattens on this rank


class Spans(Protocol):
    """What a step's code asks of its tracer: a span around each instruction it runs, and, where a ledger watches
    memory, a sample after each. A Tracer is one; an untraced step's (pipeengine.step.executor.UNTRACED) records
    nothing and enters nothing of this module."""

    @property
    def ledger(self) -> Ledger | None: ...

    def span(self, action: Action, wait: bool = False) -> AbstractContextManager[object]: ...

    def sample(self, action: Action, held: Iterable[torch.Tensor]) -> None: ...


class Tracer:
    """Records when each instruction ran on this rank (RANGES_ONLY: only the ranges in the user's profiler)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.records: list[tuple[Action, Mark, Mark, bool]] = []
        self.origin: Mark = 0.0
        self.ledger: Ledger | None = None  # set: a sample of the bytes held after every instruction
        self.state = 0.0  # bytes held the whole step (parameters, gradients, optimizer state)
        self.samples: list[tuple[Mark, float, Action | None]] = []
        self.sizes: dict[int, StageSizes] = {}  # this rank's stages, measured for this step
        self.tie_sync: dict[int, float] = {}  # tie group -> the bytes its TR flattens on this rank
        self.allocated: float | None = None  # the allocator's peak in the step, where it was watched (train.tracing)
        self.profiled = False  # the user's torch.profiler records: each span is a range in it too

    def begin(
        self, ledger: Ledger | None = None, state: float = 0.0, sizes: dict[int, StageSizes] | None = None
    ) -> None:
        """Start a step's trace: time zero is now; with a ledger, memory is sampled too."""
        self.records, self.samples = [], []
        self.ledger, self.sizes, self.allocated = ledger, sizes or {}, None
        self.late = {s: size.grads_late for s, size in self.sizes.items() if size.grads_late}  # not made yet
        self.state = state - sum(self.late.values())
        self.ungathered = {s for s, size in self.sizes.items() if size.gathered}  # FSDP: gathered by the first F
        self.sharded = {s for s, size in self.sizes.items() if size.gathered_grads}  # FSDP: whole grads until AR
        self.grads_made: set[int] = set()
        self.origin = self.mark()
        if ledger is not None:
            self.samples.append((self.origin, self.state, None))

    def sample(self, action: Action, held: Iterable[torch.Tensor]) -> None:
        """The bytes held now (after ``action``): the step-long state and every storage alive."""
        if self.ledger is not None:  # the executor samples only with one
            if isinstance(action, Instruction):
                self.state += self._state_change(action)
            self.samples.append((self.mark(), self.state + self.ledger.bytes(held), action))

    def _state_change(self, action: Instruction) -> float:
        """What the step-long state gained with this instruction: the gradients a stage's first B or W made; with
        FSDP the parameters its first compute gathered, and at its AR the shards (and a reduce-scatter input kept) for
        the whole tensors."""
        s, kind, change = action.stage, action.kind, 0.0
        if kind.is_compute and s in self.ungathered:
            self.ungathered.discard(s)
            change += self.sizes[s].gathered
        if kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            if s not in self.sharded:
                change += self.late.pop(s, 0.0)  # its first gradient compute made the gradients
            elif s not in self.grads_made:
                self.grads_made.add(s)
                change += self.sizes[s].gathered_grads
        if kind is Kind.ALL_REDUCE and s in self.sharded:
            size = self.sizes[s]
            change += self.late.pop(s, 0.0) + size.reduce_held - size.gathered - size.gathered_grads
        return change

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def span(self, action: Action, wait: bool = False) -> _Span:
        return _Span(self, action, wait)

    def spans(self, rank: int) -> list[Span]:
        """This rank's spans in seconds since the step began."""
        seconds = self._seconds()
        return [Span(rank, action, seconds(a), seconds(b), wait) for action, a, b, wait in self.records]

    def _seconds(self) -> Callable[[Mark], float]:
        if self.cuda:
            torch.cuda.current_stream().synchronize()
            origin = self.origin
            return lambda mark: float(origin.elapsed_time(mark)) / 1e3  # type: ignore[union-attr, arg-type]
        return lambda mark: float(mark) - float(self.origin)  # type: ignore[arg-type]

    def gather(self, label: str, transport: Transport, num_stages: int) -> Timeline | None:
        """Every rank's spans (and memory) on rank 0's clock, as one Timeline on group rank 0; None elsewhere."""
        rank, size = transport.rank, transport.size
        same = self.cuda or transport.shared_clock
        offsets, error = ([0.0] * size, 0.0) if same else _clock_offsets(transport)
        origin = 0.0 if self.cuda else float(self.origin)  # type: ignore[arg-type]
        seconds = self._seconds()
        samples = [(seconds(mark), held, action) for mark, held, action in self.samples]
        optimizer = sum(s.state + s.optimizer for s in self.sizes.values())  # the optimizer step after this one
        mine = RankTrace(origin, self.spans(rank), samples, self.sizes, self.allocated, optimizer, self.tie_sync)
        gathered: list[RankTrace] = transport.all_gather_object(mine, "the traced step's spans")
        if rank != 0:
            return None
        base = gathered[0].origin
        spans, memory = [], []
        for r, theirs in enumerate(gathered):
            shift = theirs.origin - offsets[r] - base  # their time zero, on rank 0's clock, since rank 0's zero
            spans += [Span(s.rank, s.action, s.start + shift, s.end + shift, s.wait) for s in theirs.spans]
            memory.append([(t + shift, held, action) for t, held, action in theirs.samples])
        timeline = Timeline(size, spans, label=label, unit="s", measured=True, clock_error=error)
        if self.samples:
            timeline.memory = memory
            ties = {group: held for g in gathered for group, held in g.tie_sync.items()}
            timeline.sizes = _sizes(
                [g.sizes for g in gathered],
                num_stages,
                transport.semantics is Semantics.BUFFERED,
                [ties.get(group, 0.0) for group in range(max(ties, default=-1) + 1)],
            )
            peaks = [g.allocated for g in gathered if g.allocated is not None]
            timeline.allocated_peak = peaks if len(peaks) == len(gathered) else None
            timeline.optimizer_peak = [g.optimizer for g in gathered]
        return timeline


class _RangesOnly(Tracer):
    """An untraced step under the user's profiler: each instruction a range in it, nothing recorded here (an
    untraced step without one runs under pipeengine.step.executor.UNTRACED)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.profiled = True
        self.records = None  # type: ignore[assignment]  # spans are not kept


RANGES_ONLY: Tracer = _RangesOnly()


def _sizes(
    per_rank: list[dict[int, StageSizes]], num_stages: int, buffered: bool, tie_sync: list[float]
) -> Memory | None:
    """The per-stage sizes every rank measured for its stages, as the simulator's Memory."""
    stages = {stage: sizes for mine in per_rank for stage, sizes in mine.items()}
    if sorted(stages) != list(range(num_stages)):
        return None
    table = [stages[s] for s in range(num_stages)]
    return Memory(
        state=[s.state for s in table],
        activation=[s.activation for s in table],
        after_input=[s.after_input for s in table],
        boundary=[s.boundary for s in table],
        gradient=[s.gradient for s in table],
        buffered_sends=buffered,
        output_after_input=[float(s.output_after_input) for s in table],
        input_after_input=[float(s.input_after_input) for s in table],
        transient=[s.transients[0] for s in table],
        backward_transient=[s.transients[1] for s in table],
        input_transient=[s.transients[2] for s in table],
        weight_transient=[s.transients[3] for s in table],
        sync=[s.sync for s in table],
        tie_sync=tuple(tie_sync),
        optimizer=[s.optimizer for s in table],
        grads_late=[s.grads_late for s in table],
        first_transient=[s.first_transient for s in table],
        gathered=[s.gathered for s in table],
        gathered_grads=[s.gathered_grads for s in table],
        reduce_held=[s.reduce_held for s in table],
        reduce_transient=[s.reduce_transient for s in table],
        gather_transient=[s.gather_transient for s in table],
    )


def _clock_offsets(transport: Transport) -> tuple[list[float], float]:
    """On rank 0: each rank's clock minus rank 0's (seconds), and the most any may be off (half the
    fastest round trip of the worst-measured rank); zeros elsewhere."""
    rank, offsets, error = transport.rank, [0.0] * transport.size, 0.0
    send, recv = True, False

    def move(op: bool, peer: int, stamp: torch.Tensor) -> None:
        transfer = Transfer(op, (stamp,), peer, "a clock ping")
        transport.post([transfer])
        transport.complete([transfer])

    stamp = torch.zeros(1, dtype=torch.float64, device=transport.control_device)
    for peer in range(1, transport.size):
        if rank == 0:
            best = (float("inf"), 0.0)
            for _ in range(PINGS):
                sent = time.perf_counter()
                move(send, peer, stamp)
                move(recv, peer, stamp)
                back = time.perf_counter()
                best = min(best, (back - sent, float(stamp.item()) - (sent + back) / 2))
            offsets[peer], error = best[1], max(error, best[0] / 2)
        elif rank == peer:
            for _ in range(PINGS):
                move(recv, 0, stamp)
                stamp.fill_(time.perf_counter())
                move(send, 0, stamp)
    return offsets, error
