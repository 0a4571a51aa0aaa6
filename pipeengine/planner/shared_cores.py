"""The CPU host model: what ranks cost that share a machine's processors (CPU ranks, more of them than cores).

Optional, and only for that case: calibration measures ``processors`` on CPU alone (``measure_processors``; None
where each rank computes at full speed, as on GPUs, which never enter this module), and only then how late a rank
woken by a message starts while others compute (pipeengine.planner.wakes). The cost model asks this module how a
pipeline's computes, its tensor-parallel collectives and its replicas' all-reduce share the processors; the
simulator shares them among the computes running at each moment (schedules.sim.sharing, Costs.processors and
Costs.wake). Everything here is a no-op where ``processors`` is None.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["measure_processors", "per_pipeline", "replicas_speed", "sharing", "split", "wake"]


def per_pipeline(processors: float | None, data_parallel: int, tensor_parallel: int) -> float | None:
    """The processors one pipeline's ranks have: the machine's, shared with the other replicas' and tensor-parallel
    ranks, which compute at the same moments (each simulated rank stands for data_parallel x tensor_parallel)."""
    return None if processors is None else processors / (data_parallel * tensor_parallel)


def replicas_speed(processors: float | None, world: int) -> float:
    """The speed of the replicas' asynchronous all-reduce, work on the same cores as the computes (gloo's threads
    reduce there): its time with every rank of the world running one, brought to full speed where they outnumber
    the processors."""
    return 1.0 if processors is None else min(1.0, processors / world)


def split(
    alone: float, crowded: float, processors: float | None, tensor_parallel: int, world: int
) -> tuple[float, float]:
    """(work, wait) of a tensor-parallel collective timed ``alone`` (its group's ranks alone) and ``crowded`` (every
    group of the world at once). Ranks with processors of their own wait through all of it. Where ranks share
    processors, the share that is processor work is what slowed it crowded against the slowdown of pure work: that
    share is work at full speed (brought down by tp / processors where the group outnumbers them), the rest a wait."""
    if processors is None:
        return 0.0, alone
    slower = min(1.0, processors / tensor_parallel) / min(1.0, processors / world)
    share = 1.0 if slower <= 1.0 or alone <= 0 else min(1.0, max(0.0, (crowded / alone - 1) / (slower - 1)))
    return share * alone * min(1.0, processors / tensor_parallel), (1 - share) * alone


def wake(processors: float | None, repeats: int) -> tuple[tuple[float, float], ...]:
    """How late a woken rank starts behind the others' work (pipeengine.planner.wakes), where ranks share
    processors; nothing otherwise."""
    if processors is None:
        return ()
    from pipeengine.planner import wakes

    return tuple(wakes.wakes(repeats))


def measure_processors(repeats: int, device: torch.device | None = None) -> float | None:
    """How many of the ranks compute at full speed at once: each rank times the same CPU work alone (the others
    wait in a barrier, which sleeps), then all run it at once. On each machine (the ranks of one share its monotonic
    clock) the slowdown is (last end - first start) / its ranks' mean time alone (the median of ``repeats``); the
    answer is world / the largest. None if the ranks do not slow each other (within 10%: a core each), and on an
    accelerator (``device``), whose ranks each have their own."""
    if device is not None and device.type != "cpu":
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    a = torch.randn(192, 192)

    def work() -> None:  # about 0.1 s on one core of the 2-core machine: long beside the barrier's exit skew
        for _ in range(200):
            torch.mm(a, a)

    alone, together = [], []
    for _ in range(repeats):
        for turn in range(world):
            dist.barrier()
            if turn == rank:
                start = time.perf_counter()
                work()
                alone.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        work()
        together.append((start, time.perf_counter()))
    found: list[Any] = [None] * world
    dist.all_gather_object(found, (socket.gethostname(), statistics.median(alone), together))
    return sharing(found)


def sharing(found: Sequence[tuple[str, float, Sequence[tuple[float, float]]]]) -> float | None:
    """Processors from each rank's (host, time alone, [(start, end) of each run all at once]): on each host the
    median span of a run over its ranks' mean time alone is its slowdown; world / the largest, or None within 10% of
    one processor a rank."""
    slowdowns = []
    for host in {name for name, _, _ in found}:
        mine = [(time_alone, marks) for name, time_alone, marks in found if name == host]
        runs = range(min(len(marks) for _, marks in mine))
        spans = [max(marks[i][1] for _, marks in mine) - min(marks[i][0] for _, marks in mine) for i in runs]
        slowdowns.append(statistics.median(spans) / statistics.fmean(time_alone for time_alone, _ in mine))
    found_processors = len(found) / max(slowdowns)
    return None if found_processors > len(found) / 1.1 else found_processors
