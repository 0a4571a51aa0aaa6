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
from typing import Any

__all__ = ["shared"]

_EPSILON = 1e-12


def shared(
    programs: Sequence[Sequence[Any]],
    processors: float,
    ready: Callable[[Any, float], float | None],
    done: Callable[[Any, float], None],
    post: Callable[[Any, float], None],
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
    ranks, infinity = len(programs), float("inf")
    times: list[list[tuple[float, float]]] = [[] for _ in range(ranks)]
    pcs, free, began = [0] * ranks, [0.0] * ranks, [0.0] * ranks
    # a running compute ends when the work clock (the work each running compute has done since 0: all run at one
    # rate) reaches its mark; an idle rank's next compute starts at its time once known (known, it stays)
    mark: list[float | None] = [None] * ranks
    hold: list[float | None] = [None] * ranks  # a compute past its work, waiting on other ranks until then
    start: list[float | None] = [None] * ranks
    queued: list[deque[int]] = [deque() for _ in range(ranks)]  # each rank's asynchronous collectives waiting
    channel: list[float | None] = [None] * ranks  # the work mark of the one running
    carrying = [0] * ranks  # which one that is
    ended = ended if ended is not None else {}
    work = now = 0.0
    running, changed = 0, True
    woken = [False] * ranks  # its next compute waits for an input: woken by it, unless it is there first

    def begin(rank: int) -> None:
        """The rank's next action starts now: its work runs from this work clock."""
        nonlocal running
        entry = programs[rank][pcs[rank]]
        mark[rank] = work + (entry.host if entry.kind is None else entry.price - entry.hold)
        began[rank], start[rank], woken[rank] = now, None, False
        running += 1

    def late() -> float:
        """The delay of a compute woken now, behind what runs (its mean price)."""
        total = 0.0
        for r in range(ranks):
            if mark[r] is not None:
                entry = programs[r][pcs[r]]
                total += entry.host if entry.kind is None else entry.price
            if channel[r] is not None:
                total += programs[r][carrying[r]][2]
        return delay(wake, total / running)

    def next_collective(rank: int) -> None:
        """The rank's channel takes up the next queued collective, if any, from now."""
        nonlocal running
        if queued[rank]:
            carrying[rank] = queued[rank].popleft()
            channel[rank] = work + programs[rank][carrying[rank]][2]
            running += 1

    def posted(rank: int, index: int, at: float) -> None:
        """Communication posted at ``at``: an asynchronous collective queues on its rank's channel, and starts now if
        the channel is idle."""
        entry = programs[rank][index]
        post(entry, at)
        if entry.price > 0 and not entry.hold:
            queued[rank].append(index)
            if channel[rank] is None:
                next_collective(rank)

    while True:
        if changed:  # a rank went idle: its posts first (a compute's input may be one posted now), then who can start
            for rank in range(ranks):
                if mark[rank] is None and hold[rank] is None and start[rank] is None:
                    program, pc = programs[rank], pcs[rank]
                    while pc < len(program) and program[pc][0] is None and not program[pc][7] and not program[pc][8]:
                        posted(rank, pc, free[rank])
                        times[rank].append((free[rank], free[rank]))
                        pc += 1
                    pcs[rank] = pc
            for rank in range(ranks):
                idle = mark[rank] is None and hold[rank] is None and start[rank] is None
                if idle and pcs[rank] < len(programs[rank]):
                    entry = programs[rank][pcs[rank]]
                    at = free[rank] if entry.kind is None else ready(entry, free[rank])
                    if at is not None:
                        start[rank] = at if at > now else now
                        woken[rank] = bool(wake) and entry.kind is not None and at > free[rank]
            changed = False
        first = lowest = infinity
        due: list[int] | None = None  # woken computes due now: they start once the others due now have
        for rank in range(ranks):  # a compute due now starts (at this work clock); the next event after now
            at = start[rank]
            if at is not None:
                if at <= now and woken[rank]:
                    due = [rank] if due is None else [*due, rank]
                elif at <= now:
                    begin(rank)
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
            behind = late() if running else 0.0
            for rank in due:
                woken[rank] = False
                if behind > 0:
                    start[rank] = now + behind
                    first = min(first, now + behind)
                else:
                    begin(rank)
                    end = mark[rank]
                    if end is not None and end < lowest:
                        lowest = end
        rate = processors / running if running > processors else 1.0
        finish = now + (lowest - work) / rate if running else infinity
        if first == finish == infinity:
            waiting = [(r, pcs[r]) for r in range(ranks) if pcs[r] < len(programs[r])]
            if waiting:
                raise stuck(waiting)
            return times
        then = finish if finish < first else first
        work += (then - now) * rate
        now = then
        reached = work + _EPSILON * (1.0 + work)  # a mark at or below it is done
        if lowest <= reached or first <= now:  # something ended (a hold ends at or before now: first <= now)
            for rank in range(ranks):
                end = channel[rank]
                if end is not None and end <= reached:  # its collective is done: the next
                    ended[rank, carrying[rank]], channel[rank], running = now, None, running - 1
                    next_collective(rank)
                end, held = mark[rank], hold[rank]
                if end is not None and end <= reached:  # its work is done
                    mark[rank], running = None, running - 1
                    wait = programs[rank][pcs[rank]][8]
                    if wait > 0:
                        hold[rank] = now + wait
                        continue
                elif held is None or held > now:
                    continue
                entry = programs[rank][pcs[rank]]
                if entry.kind is None:
                    posted(rank, pcs[rank], now)
                else:
                    done(entry, now)
                times[rank].append((began[rank], now))
                pcs[rank] += 1
                free[rank], hold[rank] = now, None
                changed = True


def delay(points: Sequence[tuple[float, float]], size: float) -> float:
    """The delay at ``size`` of a curve of (size, delay) points sorted by size: linear between them, level beyond."""
    if size <= points[0][0]:
        return points[0][1]
    for (left, low), (right, high) in zip(points, points[1:], strict=False):
        if size <= right:
            return low + (high - low) * (size - left) / (right - left) if right > left else high
    return points[-1][1]
