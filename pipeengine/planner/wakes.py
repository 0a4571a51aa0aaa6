"""How late a rank woken by a message starts while other ranks compute, where ranks share a machine's processors
(calibration runs it on every rank; schedules.sim.sharing charges it).

A rank waiting on a message sleeps; woken, the operating system may put it on a processor another rank is computing
on, behind that rank's work: with another rank computing, a transit that takes a fraction of a millisecond with the
others asleep sometimes takes milliseconds. The simulator shares the processors evenly among the computing ranks and
has no such delay, so a partition whose critical path crosses one message more runs slower than it prices
(docs/benchmarks.md).

The probe is a chain of stages, one a rank, each taking a message from the rank before, computing a burst of a known
time and sending on. With one micro-batch at a time only the sender had computed when a rank wakes; with many, ranks
compute beside each other and wake while others compute. The delay is the mean transit of the second less that of
the first, over the messages whose receiver was already waiting (woken by it), per burst length: the curve the
simulator reads by the mean price of the work running when a rank wakes. Transits are taken between ranks of one host
(the clock they share); ranks that share no host have no delay to measure.

Fitting the delay to whole steps instead (the engine's GPipe steps over such stages against the simulator, as
probes.host fits the latency) is ill-posed: the delay also sets how many wakes meet work, and the fit moved by an
order of magnitude from one launch to the next (docs/benchmarks.md).
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["BURSTS", "delays", "wakes"]

BURSTS = (0.5e-3, 2e-3)  # seconds of the bursts the delay is measured after (a layer's compute on the CPU)
_LOADED = 8  # micro-batches in flight: a chain of 4 ranks computes beside itself from the fourth to the fifth last

Transits = tuple[list[float], list[float]]  # a rank's woken transits with one micro-batch, with _LOADED


def wakes(repeats: int, bursts: Sequence[float] = BURSTS) -> tuple[tuple[float, float], ...]:
    """(price, seconds) points: for each burst length, the burst's time alone (the median over ranks) and how much
    later a woken rank starts while others compute (``delays``), from ``repeats`` passes of each chain. Every rank
    calls it and gets the same points."""
    world, rank = dist.get_world_size(), dist.get_rank()
    unit, message = torch.randn(64, 64), torch.zeros(1, dtype=torch.float64)
    host = socket.gethostname()
    measured = []
    for seconds in bursts:
        count = _count(unit, seconds)
        alone = []
        for turn in range(world):  # each rank's burst alone, the others asleep in the barrier
            dist.barrier()
            if turn == rank:
                for _ in range(5):
                    start = time.perf_counter()
                    _burst(unit, count)
                    alone.append(time.perf_counter() - start)
        transits: Transits = ([], [])
        for found, microbatches in zip(transits, (1, _LOADED), strict=True):
            for _ in range(repeats):
                dist.barrier()
                for _ in range(microbatches):
                    if rank > 0:
                        entered = time.perf_counter()
                        dist.recv(message, rank - 1)
                        if entered < message.item():  # it was waiting when the message was sent: woken by it
                            found.append(time.perf_counter() - message.item())
                    _burst(unit, count)
                    if rank < world - 1:
                        message[0] = time.perf_counter()
                        dist.send(message, rank + 1)
        measured.append((statistics.median(alone), transits))
    everyone: list[object] = [None] * world
    dist.all_gather_object(everyone, (host, measured))
    return delays(everyone)  # type: ignore[arg-type]


def delays(everyone: Sequence[tuple[str, Sequence[tuple[float, Transits]]]]) -> tuple[tuple[float, float], ...]:
    """The curve from every rank's (host, [(burst alone, transits) per burst]): each burst's median time alone over
    the ranks, and the mean woken transit with many micro-batches in flight less that with one (at least 0), over the
    ranks whose sender shares their host; none where no rank does or a chain woke none."""
    points = []
    for index in range(len(everyone[0][1])):
        idle: list[float] = []
        loaded: list[float] = []
        for rank in range(1, len(everyone)):
            if everyone[rank][0] == everyone[rank - 1][0]:
                one, many = everyone[rank][1][index][1]
                idle += one
                loaded += many
        if idle and loaded:
            compute = statistics.median(ranks[1][index][0] for ranks in everyone)
            points.append((compute, max(0.0, statistics.fmean(loaded) - statistics.fmean(idle))))
    return tuple(sorted(points))


def _burst(operand: torch.Tensor, count: int) -> None:
    for _ in range(count):
        torch.mm(operand, operand)


def _count(unit: torch.Tensor, seconds: float) -> int:
    """How many matmuls of ``unit`` take about ``seconds``: rank 0's count (the median of 7 timings of 40, the first
    left out), timed while the others wait, for all."""
    count = torch.tensor([0])
    if dist.get_rank() == 0:
        times = []
        for _ in range(8):
            start = time.perf_counter()
            _burst(unit, 40)
            times.append((time.perf_counter() - start) / 40)
        count[0] = max(1, round(seconds / statistics.median(times[1:])))
    dist.broadcast(count, 0)
    return int(count.item())
