"""Pricing a search's candidates: each a simulated step (schedules.summarize) at its stages' costs, on the machine's
processors.

A search prices thousands of candidates, each a pure-Python replay of its program (no torch): ``in_parallel`` splits
them between this process and forked ones where the platform forks (Linux) and there are enough to be worth the
fork, and prices them all here otherwise. The work reaches the workers through the fork (a module global set just
before), and only numbers come back, each worker's through a pipe of its own.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeengine.planner.calibration import Prices
from pipeengine.planner.costmodel import LayerProfile
from schedules import Schedule
from schedules.ir.gcpause import gc_paused
from schedules.sim.simulation import summarize

__all__ = ["Priced", "Spec", "in_parallel", "price", "processors"]

WORTH = 400  # candidates below which forking costs more than it saves (a fork and a pool: ~30 ms)


@dataclass(frozen=True)
class Spec:
    """What one candidate is priced from: its program, its layers' profile and cut, its layout and options."""

    program: Schedule
    profile: LayerProfile
    bounds: Sequence[tuple[int, int]]
    data_parallel: int
    fsdp: bool
    checkpoint: str


Priced = tuple[float, float, tuple[float, ...]]  # step seconds, bubble fraction, bytes per rank that must fit


def price(spec: Spec, prices: Prices, optimizer_copies: int, buffered: bool) -> Priced:
    """One candidate's step (the simulated program and the frame around it), bubble and memory that must fit."""
    program, dp = spec.program, spec.data_parallel
    costs = spec.profile.stage_costs(
        spec.bounds,
        prices=prices,
        optimizer_copies=optimizer_copies,
        buffered_sends=buffered,
        placement=program.placement,
        data_parallel=dp,
        fsdp=spec.fsdp,
        checkpoint=spec.checkpoint,
    )
    summary = summarize(program, costs)
    step = summary.makespan + prices.frame_of(dp, program.num_ranks)  # with what the step runs around its program
    late = spec.profile.in_flight(spec.bounds, spec.fsdp) if buffered else 0.0  # a buffer gloo lets go late
    return step, summary.bubble_fraction, tuple(peak + late for peak in summary.required_memory)


def processors() -> int:
    """The processors this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def in_parallel(count: int, work: Callable[[int], Priced], workers: int | None = None) -> list[Priced]:
    """``work(i)`` for each i < ``count``, in order: split round-robin over ``workers`` (default: this process's
    processors), this process and forked ones, or all here where there is one worker, too few items or no fork.
    A failure in a worker is raised here, with its traceback."""
    workers = min(workers or processors(), max(1, count // (WORTH // 2)))
    if workers < 2 or count < WORTH or sys.platform != "linux":
        with gc_paused():  # thousands of small simulations: no cycles to collect
            return [work(i) for i in range(count)]
    global _WORK
    _WORK = (work, count, workers)
    context = multiprocessing.get_context("fork")
    children = []
    try:
        for worker in range(1, workers):
            receiver, sender = context.Pipe(duplex=False)
            child = context.Process(target=_share, args=(worker, sender), daemon=True)
            child.start()
            sender.close()
            children.append((child, receiver))
        parts = [_shared(0)]
        for child, receiver in children:
            try:
                failure, part = receiver.recv()
            except EOFError:
                failure, part = f"the worker pricing share {len(parts)} died (exit code {child.exitcode})", []
            if failure:
                raise RuntimeError(f"pricing the candidates on {workers} workers failed: {failure}")
            parts.append(part)
    finally:
        _WORK = None
        for child, _ in children:
            child.join(timeout=5)
            if child.is_alive():
                child.kill()
    found: list[Any] = [None] * count
    for worker, part in enumerate(parts):
        found[worker::workers] = part
    return found


_WORK: tuple[Callable[[int], Priced], int, int] | None = None  # set for the forked workers to read


def _shared(worker: int) -> list[Priced]:
    work, count, workers = _WORK  # type: ignore[misc]
    with gc_paused():
        return [work(i) for i in range(worker, count, workers)]


def _share(worker: int, sender: Any) -> None:
    """A forked worker: its share of the work, or the failure, back through ``sender``."""
    try:
        sender.send(("", _shared(worker)))
    except BaseException:  # noqa: BLE001  (the parent raises it)
        import traceback

        sender.send((traceback.format_exc(), []))
    finally:
        sender.close()
