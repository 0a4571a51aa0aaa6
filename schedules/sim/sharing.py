"""Ranks that share processors: the simulator's replay when fewer ranks than there are can compute at full speed.

CPU ranks on one machine share its cores: with ``processors`` = P (Costs.processors) and n ranks computing at a
moment, each compute runs at min(1, P / n) of its full speed (processor sharing: the operating system's scheduler
shares the cores out evenly among the runnable threads). A compute's price is its time alone; its span is as long as
that much work takes at the rates it is given. The replay is event by event in time order: a compute starts when its
rank is free and its input has arrived (as in schedules.sim.simulation.run) and ends when its work is done; the rates
change whenever one starts or ends. Of a compute's price, the seconds it waits on other ranks (a tensor-parallel
collective inside it, FSDP's gather before a first forward: its entry's hold) take no processor: the compute holds its
rank that long after its work, beside the running ones. Communication is posted when the rank reaches it: its host
time (schedules.sim.entries) is work like a compute's, and a blocking collective then holds the rank until done. An
asynchronous collective (a gradient all-reduce) is work too, beside the rank's computes: each rank runs its own one
at a time, in program order, from their posts, sharing the processors with whatever else runs (gloo's threads reduce
on the same cores).

A rank that waited for a message is woken by it, and where other work runs the operating system may put it behind that
work on a busy processor: its compute starts ``wake(b)`` late (``wake``: points (b, seconds), linear between them,
level beyond), b the mean price of what runs at that moment. The delay is measured on the machine
(pipeengine.planner.wakes); none: a woken rank starts at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from schedules.sim.entries import Entry

__all__ = ["shared"]

_EPSILON = 1e-12
_INFINITY = float("inf")


def shared(
    programs: Sequence[Sequence[Entry]],
    processors: float,
    ready: Callable[[Entry, float], float | None],
    done: Callable[[Entry, float], None],
    post: Callable[[Entry, float], None],
    stuck: Callable[[list[tuple[int, int]]], Exception],
    ended: dict[tuple[int, int], float] | None = None,
    wake: Sequence[tuple[float, float]] = (),
) -> list[list[tuple[float, float]]]:
    """(start, end) of every action of every rank, in program order, the computes sharing ``processors``; each
    asynchronous collective's end in ``ended`` ((rank, index) -> when it was done).

    ``programs``: each rank's entries (schedules.sim.entries.Entry: kind None: communication; price: a compute's;
    host: host seconds; hold: what of it waits on other ranks). ``ready(entry, free)``: when a compute
    can start on a rank free since ``free``, or None while its input's time is unknown; ``done(entry, end)``: a
    compute ended; ``post(entry, at)``: communication posted; ``stuck(waits)``: the error to raise when no rank can
    go on ((rank, pc) of each waiting). ``wake``: the delay of a compute woken by its input while other work runs, by
    the mean price of that work (module docstring)."""
    replay = _Replay(programs, processors, ready, done, post, ended if ended is not None else {}, wake)
    while True:  # each turn: who can start, then the next event, then what ended at it
        if replay.changed:
            replay.start_idle()
        first, lowest = replay.next_events()
        rate = processors / replay.running if replay.running > processors else 1.0
        finish = replay.now + (lowest - replay.work) / rate if replay.running else _INFINITY
        if first == finish == _INFINITY:
            waiting = [(r, replay.pcs[r]) for r in range(len(programs)) if replay.pcs[r] < len(programs[r])]
            if waiting:
                raise stuck(waiting)
            return replay.times
        replay.advance(finish if finish < first else first, rate, lowest, first)


class _Replay:
    """The replay's state, rank by rank. A running compute ends when the work clock (the work each running compute
    has done since 0: all run at one rate) reaches its mark; an idle rank's next compute starts at its time once known
    (known, it stays)."""

    __slots__ = (
        "programs",
        "ready",
        "done",
        "post",
        "ended",
        "wake",
        "ranks",
        "times",
        "pcs",
        "free",
        "began",
        "mark",
        "hold",
        "start",
        "queued",
        "channel",
        "carrying",
        "woken",
        "work",
        "now",
        "running",
        "changed",
    )

    def __init__(
        self,
        programs: Sequence[Sequence[Entry]],
        processors: float,
        ready: Callable[[Entry, float], float | None],
        done: Callable[[Entry, float], None],
        post: Callable[[Entry, float], None],
        ended: dict[tuple[int, int], float],
        wake: Sequence[tuple[float, float]],
    ) -> None:
        ranks = len(programs)
        self.programs, self.ready, self.done, self.post, self.ended, self.wake = (
            programs,
            ready,
            done,
            post,
            ended,
            wake,
        )
        self.ranks = range(ranks)
        self.times: list[list[tuple[float, float]]] = [[] for _ in self.ranks]
        self.pcs, self.free, self.began = [0] * ranks, [0.0] * ranks, [0.0] * ranks
        self.mark: list[float | None] = [None] * ranks
        self.hold: list[float | None] = [None] * ranks  # a compute past its work, waiting on other ranks until then
        self.start: list[float | None] = [None] * ranks
        self.queued: list[deque[int]] = [deque() for _ in self.ranks]  # each rank's asynchronous collectives waiting
        self.channel: list[float | None] = [None] * ranks  # the work mark of the one running
        self.carrying = [0] * ranks  # which one that is
        self.woken = [False] * ranks  # its next compute waits for an input: woken by it, unless it is there first
        self.work = self.now = 0.0
        self.running, self.changed = 0, True

    def start_idle(self) -> None:
        """A rank went idle: its posts first (a compute's input may be one posted now), then who can start."""
        programs, pcs, free, mark, hold, start = self.programs, self.pcs, self.free, self.mark, self.hold, self.start
        for rank in self.ranks:
            if mark[rank] is None and hold[rank] is None and start[rank] is None:
                program, pc = programs[rank], pcs[rank]
                while pc < len(program) and program[pc].kind is None and not program[pc].host and not program[pc].hold:
                    self.posted(rank, pc, free[rank])
                    self.times[rank].append((free[rank], free[rank]))
                    pc += 1
                pcs[rank] = pc
        now, wake = self.now, bool(self.wake)
        for rank in self.ranks:
            if mark[rank] is None and hold[rank] is None and start[rank] is None and pcs[rank] < len(programs[rank]):
                entry = programs[rank][pcs[rank]]
                at = free[rank] if entry.kind is None else self.ready(entry, free[rank])
                if at is not None:
                    start[rank] = at if at > now else now
                    self.woken[rank] = wake and entry.kind is not None and at > free[rank]
        self.changed = False

    def next_events(self) -> tuple[float, float]:
        """Start the computes due now (a woken one behind the work running, if any); the next start or hold's end
        after now (in time), and the next work mark (on the work clock)."""
        start, mark, hold, channel, woken, now = self.start, self.mark, self.hold, self.channel, self.woken, self.now
        first = lowest = _INFINITY
        due: list[int] | None = None  # woken computes due now: they start once the others due now have
        for rank in self.ranks:
            at = start[rank]
            if at is not None:
                if at <= now and woken[rank]:
                    due = [rank] if due is None else [*due, rank]
                elif at <= now:
                    self.begin(rank)
                elif at < first:
                    first = at
            end, held = mark[rank], hold[rank]
            if held is not None and held < first:
                first = held
            if end is not None and end < lowest:
                lowest = end
            end = channel[rank]
            if end is not None and end < lowest:
                lowest = end
        if due:  # behind the work running now, if any
            behind = self.late() if self.running else 0.0
            for rank in due:
                woken[rank] = False
                if behind > 0:
                    start[rank] = now + behind
                    first = min(first, now + behind)
                else:
                    self.begin(rank)
                    end = mark[rank]
                    if end is not None and end < lowest:
                        lowest = end
        return first, lowest

    def advance(self, then: float, rate: float, lowest: float, first: float) -> None:
        """The clocks move to ``then``; each action whose work (or hold) is done ends, and each collective whose is."""
        self.work += (then - self.now) * rate
        self.now = now = then
        reached = self.work + _EPSILON * (1.0 + self.work)  # a mark at or below it is done
        if not (lowest <= reached or first <= now):  # nothing ended (a hold ends at or before now: first <= now)
            return
        programs, pcs, mark, hold, channel = self.programs, self.pcs, self.mark, self.hold, self.channel
        for rank in self.ranks:
            end = channel[rank]
            if end is not None and end <= reached:  # its collective is done: the next
                self.ended[rank, self.carrying[rank]], channel[rank] = now, None
                self.running -= 1
                self.next_collective(rank)
            end, held = mark[rank], hold[rank]
            if end is not None and end <= reached:  # its work is done
                mark[rank] = None
                self.running -= 1
                wait = programs[rank][pcs[rank]].hold
                if wait > 0:
                    hold[rank] = now + wait
                    continue
            elif held is None or held > now:
                continue
            entry = programs[rank][pcs[rank]]
            if entry.kind is None:
                self.posted(rank, pcs[rank], now)
            else:
                self.done(entry, now)
            self.times[rank].append((self.began[rank], now))
            pcs[rank] += 1
            self.free[rank], hold[rank] = now, None
            self.changed = True

    def begin(self, rank: int) -> None:
        """The rank's next action starts now: its work runs from this work clock."""
        entry = self.programs[rank][self.pcs[rank]]
        self.mark[rank] = self.work + (entry.host if entry.kind is None else entry.price - entry.hold)
        self.began[rank], self.start[rank], self.woken[rank] = self.now, None, False
        self.running += 1

    def late(self) -> float:
        """The delay of a compute woken now, behind what runs (its mean price)."""
        total = 0.0
        for r in self.ranks:
            if self.mark[r] is not None:
                entry = self.programs[r][self.pcs[r]]
                total += entry.host if entry.kind is None else entry.price
            if self.channel[r] is not None:
                total += self.programs[r][self.carrying[r]].price
        return delay(self.wake, total / self.running)

    def next_collective(self, rank: int) -> None:
        """The rank's channel takes up the next queued collective, if any, from now."""
        if self.queued[rank]:
            self.carrying[rank] = self.queued[rank].popleft()
            self.channel[rank] = self.work + self.programs[rank][self.carrying[rank]].price
            self.running += 1

    def posted(self, rank: int, index: int, at: float) -> None:
        """Communication posted at ``at``: an asynchronous collective queues on its rank's channel, and starts now if
        the channel is idle."""
        entry = self.programs[rank][index]
        self.post(entry, at)
        if entry.price > 0 and not entry.hold:
            self.queued[rank].append(index)
            if self.channel[rank] is None:
                self.next_collective(rank)


def delay(points: Sequence[tuple[float, float]], size: float) -> float:
    """The delay at ``size`` of a curve of (size, delay) points sorted by size: linear between them, level beyond."""
    if size <= points[0][0]:
        return points[0][1]
    for (left, low), (right, high) in zip(points, points[1:], strict=False):
        if size <= right:
            return low + (high - low) * (size - left) / (right - left) if right > left else high
    return points[-1][1]
