"""Ranks that share processors: the simulator's replay when fewer ranks than there are can compute at full speed.

CPU ranks on one machine share its cores: with ``processors`` = P (Costs.processors) and n ranks computing at a
moment, each compute runs at min(1, P / n) of its full speed (processor sharing: the operating system's scheduler
shares the cores out evenly among the runnable threads). A compute's price is its time alone; its span is as long as
that much work takes at the rates it is given. The replay is event by event in time order: a compute starts when its
rank is free and its input has arrived (as in schedules.sim.simulation.run) and ends when its work is done; the rates
change whenever one starts or ends. Communication is posted when the rank reaches it and costs no processor.
"""

from __future__ import annotations

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
) -> list[list[tuple[float, float]]]:
    """(start, end) of every action of every rank, in program order, the computes sharing ``processors``.

    ``programs``: each rank's entries (schedules.sim.simulation's; entry[0] None: communication, entry[2]: a
    compute's price). ``ready(entry, free)``: when a compute can start on a rank free since ``free``, or None while
    its input's time is unknown; ``done(entry, end)``: a compute ended; ``post(entry, at)``: communication posted;
    ``stuck(waits)``: the error to raise when no rank can go on ((rank, pc) of each waiting)."""
    ranks = len(programs)
    times: list[list[tuple[float, float]]] = [[] for _ in range(ranks)]
    pcs, free = [0] * ranks, [0.0] * ranks
    running: dict[int, list[float]] = {}  # rank -> [work left (seconds at full speed), start]
    now = 0.0
    while True:
        idle = [rank for rank in range(ranks) if rank not in running]
        for rank in idle:  # every post first: a compute's input may be one another rank posts now
            program, pc = programs[rank], pcs[rank]
            while pc < len(program) and program[pc][0] is None:
                post(program[pc], free[rank])
                times[rank].append((free[rank], free[rank]))
                pc += 1
            pcs[rank] = pc
        starts: dict[int, float] = {}
        for rank in idle:
            if pcs[rank] < len(programs[rank]):
                at = ready(programs[rank][pcs[rank]], free[rank])
                if at is not None:
                    starts[rank] = at if at > now else now
        if not running and not starts:
            waiting = [(r, pcs[r]) for r in range(ranks) if pcs[r] < len(programs[r])]
            if waiting:
                raise stuck(waiting)
            return times
        rate = min(1.0, processors / len(running)) if running else 0.0
        finish = now + min(left for left, _ in running.values()) / rate if running else float("inf")
        then = min(finish, min(starts.values(), default=float("inf")))
        for entry in running.values():
            entry[0] -= (then - now) * rate
        now = then
        for rank in [r for r, (left, _) in running.items() if left <= _EPSILON * (1.0 + now)]:
            _, began = running.pop(rank)
            done(programs[rank][pcs[rank]], now)
            times[rank].append((began, now))
            pcs[rank] += 1
            free[rank] = now
        for rank, at in starts.items():
            if at <= now:
                running[rank] = [programs[rank][pcs[rank]][2], now]
