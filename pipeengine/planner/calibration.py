"""The machine's prices: host time per instruction, a point-to-point message, each collective over each group size.

    python -m pipeengine.tune --calibrate --world-size 4     # measure on 4 ranks of this machine; keep the file

``calibrate()`` measures them on the live ranks of the default process group (every rank calls it), in seconds:
a message between two ranks and each collective FSDP and data parallelism run (all-reduce, all-gather,
reduce-scatter) at 4 KiB to 16 MiB on every group size that divides the world, each fitted to latency + bytes x
per_byte; how many ranks compute at full speed at once (CPU ranks share the machine's cores: each times the same
work alone and all together); and the host cost of one pipeline instruction and the latency of a message between
stages as the engine takes it up, fitted so that the simulator's steps of tiny layers (replicas, then a chain of
stages) take what the engine's took. ``save`` keeps them in a file per machine
(``default_path()``: the host's name, with the date); ``load`` reads it, or gives the built-in constants, measured
once on the 2-core machine of the benchmarks, and says so (``Prices.source``). The planner
(pipeengine.planner.search) prices every layout with them.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["COLLECTIVES", "Link", "Prices", "calibrate", "default_path", "load", "measure_machine", "save"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # priced on the whole tensor's bytes
# host seconds per compute beyond its kernels, on CPU/gloo: its span 0.13 ms, a post 0.08 ms, 0.05 ms between
# instructions (a traced 2-rank 1F1B of Linear(8) layers, m=32, on the 2-core machine of the benchmarks)
OVERHEAD = 3e-4
LATENCY, PER_BYTE = 1e-4, 1e-9  # a message on loopback gloo: ~0.1 ms, ~1 GB/s (benchmarks/vs_torch.py probes)
BUILT_IN = "built-in constants (measured on the benchmarks' 2-core machine, not this one: run python -m " \
           "pipeengine.tune --calibrate)"  # fmt: skip
SIZES = (2**12, 2**16, 2**20, 2**24)  # bytes each collective and message is timed at: up to a model's gradients


@dataclass(frozen=True)
class Link:
    """A fitted price: seconds = latency + per_byte x bytes."""

    latency: float
    per_byte: float

    def time(self, nbytes: float) -> float:
        return self.latency + self.per_byte * nbytes

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float]]) -> Link:
        """Least squares over (bytes, seconds), neither coefficient below zero."""
        xs, ys = [float(x) for x, _ in samples], [float(y) for _, y in samples]
        mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
        slope = max(slope, 0.0)
        return cls(max(mean_y - slope * mean_x, 0.0), slope)


def _steps(op: str, group: int) -> tuple[float, float]:
    """A ring's (messages, share of the whole tensor each rank sends) for ``op`` over ``group`` ranks."""
    rounds = 2 * (group - 1) if op == "all_reduce" else group - 1
    return float(rounds), rounds / group


@dataclass(frozen=True)
class Prices:
    """What the planner charges: ``overhead`` seconds of host time per compute; ``p2p`` a message between stages;
    ``collectives[op][group]`` an op over a group of that many ranks, on the whole tensor's bytes (an all-gather's
    output, a reduce-scatter's input). A group size not measured is scaled from the nearest measured one as a ring
    scales; an op never measured is a ring of ``p2p`` messages. ``source`` says where they come from. ``processors``:
    how many ranks of the machine compute at full speed at once (CPU ranks share its cores: 2 for 4 ranks on 2 cores),
    measured; None: each rank its own (a GPU each, or not measured)."""

    overhead: float = OVERHEAD
    p2p: Link = field(default_factory=lambda: Link(LATENCY, PER_BYTE))
    collectives: Mapping[str, Mapping[int, Link]] = field(default_factory=dict)
    source: str = BUILT_IN
    calibrated: bool = False
    processors: float | None = None  # ranks of this machine that compute at full speed at once; None: every rank
    world_size: int | None = None  # the ranks they were measured on (a calibration file's)

    def collective(self, op: str, group: int, nbytes: float) -> float:
        if op not in COLLECTIVES:
            raise ValueError(f"no price for collective {op!r}: the planner prices {', '.join(COLLECTIVES)}")
        if group <= 1 or nbytes <= 0:
            return 0.0
        fitted = self.collectives.get(op, {})
        if group in fitted:
            return fitted[group].time(nbytes)
        rounds, share = _steps(op, group)
        if not fitted:
            return rounds * self.p2p.latency + share * self.p2p.per_byte * nbytes
        near = min(fitted, key=lambda g: (abs(g - group), g))
        near_rounds, near_share = _steps(op, near)
        link = fitted[near]
        return link.latency * rounds / near_rounds + link.per_byte * nbytes * share / near_share

    def to_json(self) -> dict[str, object]:
        return {"overhead": self.overhead, "p2p": [self.p2p.latency, self.p2p.per_byte], "processors": self.processors,
                "collectives": {op: {str(g): [link.latency, link.per_byte] for g, link in groups.items()}
                                for op, groups in self.collectives.items()}}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str) -> Prices:
        """Prices from a calibration file's record; a ValueError naming the value where one is not a finite
        number >= 0 (processors > 0)."""
        p2p = data["p2p"]
        collectives = data.get("collectives", {})
        processors = None if data.get("processors") is None else float(data["processors"])
        found = cls(float(data["overhead"]), Link(*map(float, p2p)),
                    {op: {int(g): Link(*map(float, v)) for g, v in groups.items()}
                     for op, groups in collectives.items()},
                    source, True, processors,
                    None if data.get("world_size") is None else int(data["world_size"]))  # fmt: skip
        seconds = {"overhead": found.overhead, "p2p latency": found.p2p.latency, "p2p per_byte": found.p2p.per_byte}
        for op, groups in found.collectives.items():
            for group, link in groups.items():
                seconds[f"{op} over {group} latency"] = link.latency
                seconds[f"{op} over {group} per_byte"] = link.per_byte
        for name, value in seconds.items():
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} is {value}, not a number of seconds >= 0")
        if processors is not None and (not math.isfinite(processors) or processors <= 0):
            raise ValueError(f"processors is {processors}, not a positive number of ranks")
        return found


def default_path() -> Path:
    """$PIPEENGINE_CALIBRATION, else ~/.cache/pipeengine/calibration-HOST.json (one file per machine)."""
    chosen = os.environ.get("PIPEENGINE_CALIBRATION")
    if chosen:
        return Path(chosen)
    return Path.home() / ".cache" / "pipeengine" / f"calibration-{socket.gethostname()}.json"


def save(prices: Prices, path: str | os.PathLike[str] | None = None, **about: object) -> Path:
    """Write the prices with the host, the date and ``about`` (the backend, the world size); returns the path."""
    target = Path(path) if path is not None else default_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    record = {"host": socket.gethostname(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              **about, **prices.to_json()}  # fmt: skip
    target.write_text(json.dumps(record, indent=1) + "\n")
    return target


def load(path: str | os.PathLike[str] | None = None) -> Prices:
    """The prices kept at ``path`` (default_path()), or the built-in constants where there is no file. A file
    that cannot be read is refused, naming it."""
    source = Path(path) if path is not None else default_path()
    if not source.exists():
        if path is not None:
            raise FileNotFoundError(f"no calibration file at {source}: run python -m pipeengine.tune --calibrate")
        return Prices()
    try:
        data = json.loads(source.read_text())
        return Prices.from_json(data, f"calibrated on {data['host']} at {data['date']} ({source})")
    except (ValueError, KeyError, TypeError, OSError) as error:
        raise ValueError(
            f"calibration file {source} cannot be read ({type(error).__name__}: {error}); delete it and run "
            "python -m pipeengine.tune --calibrate again"
        ) from error


def calibrate(engine: Callable[..., Any], repeats: int = 5, sizes: Sequence[int] = SIZES) -> Prices:
    """Measure this machine's prices on every rank of the default process group (each calls it; at least 2 ranks);
    every rank returns them. ``engine``: PipelineEngine, whose step the host cost is fitted to (given by the caller:
    the planner sits below the engine)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise ValueError("calibration measures messages and collectives between ranks: launch at least 2")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    samples: dict[str, dict[int, list[tuple[float, float]]]] = {op: {} for op in COLLECTIVES}
    p2p: list[tuple[float, float]] = []
    for size in sizes:
        p2p.append((size, _ping(size // 4, repeats, device)))
    for group_size in [g for g in range(2, world + 1) if world % g == 0]:
        group = dist.new_subgroups(group_size)[0] if group_size < world else dist.group.WORLD
        for op in COLLECTIVES:
            for size in sizes:
                samples[op].setdefault(group_size, []).append(
                    (size, _collective(op, size // 4, group, group_size, repeats, device)))  # fmt: skip
    processors = None if device.type == "cuda" else _processors(repeats)
    collectives = {op: {g: Link.fit(s) for g, s in groups.items()} for op, groups in samples.items()}
    overhead, message = _host(engine, p2p, repeats, device, processors)
    found = Prices(overhead, message, collectives,
                   f"measured just now on {socket.gethostname()}", True, processors)  # fmt: skip
    shared: list[object] = [found if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]  # type: ignore[return-value]


def measure_machine(world_size: int, engine: Callable[..., Any], backend: str = "gloo",
                    path: str | os.PathLike[str] | None = None) -> tuple[Path, Prices]:  # fmt: skip
    """Launch ``world_size`` ranks on this machine (pipeengine.launch), calibrate on them and keep the prices at
    ``path`` (default_path()); returns the path and the prices read back."""
    from pipeengine.launcher.launch import launch

    target = Path(path) if path is not None else default_path()
    device = "cuda" if backend == "nccl" else None
    launch(_calibrate_and_save, world_size, (str(target), backend, engine), device=device)
    return target, load(target)


def _calibrate_and_save(path: str, backend: str, engine: Callable[..., Any]) -> None:
    prices = calibrate(engine)
    if dist.get_rank() == 0:
        save(prices, path, backend=backend, world_size=dist.get_world_size())


def _synced(seconds: float) -> float:
    """The slowest rank's time (a collective is done when its last rank is)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _ping(elements: int, repeats: int, device: torch.device) -> float:
    """Half a round trip of ``elements`` floats between ranks 0 and 1 (the median); the others wait."""
    rank, buffer, times = dist.get_rank(), torch.zeros(elements, device=device), []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[1:]) if rank == 0 else 0.0


def _collective(op: str, elements: int, group: Any, size: int, repeats: int, device: torch.device) -> float:
    """Seconds of one ``op`` on a whole tensor of ``elements`` floats over ``group``: ``repeats`` back to back after
    one barrier, as a step runs them, the slowest rank's time over their count (once warm). Timed one by one from a
    barrier each, an op also took the barrier's exit skew, milliseconds when ranks share cores."""
    whole = torch.ones(elements - elements % size, device=device)
    shard = torch.empty(whole.numel() // size, device=device)

    def once() -> None:
        if op == "all_reduce":
            dist.all_reduce(whole, group=group)
        elif op == "all_gather":
            dist.all_gather_into_tensor(whole, shard, group=group)
        else:
            dist.reduce_scatter_tensor(shard, whole, group=group)

    once()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    if whole.is_cuda:
        torch.cuda.synchronize()
    return _synced(time.perf_counter() - start) / repeats


def _processors(repeats: int) -> float | None:
    """How many of the ranks compute at full speed at once: each rank times the same CPU work alone (the others
    wait in a barrier, which sleeps), then all run it at once. On each machine (the ranks of one share its monotonic
    clock) the slowdown is (last end - first start) / its ranks' mean time alone (the median of ``repeats``); the
    answer is world / the largest. None if the ranks do not slow each other (within 10%: a core each)."""
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
    processors = len(found) / max(slowdowns)
    return None if processors > len(found) / 1.1 else processors


def _host(build: Callable[..., Any], p2p: list[tuple[float, float]], repeats: int, device: torch.device,
          processors: float | None = None) -> tuple[float, Link]:  # fmt: skip
    """Host seconds per compute and the latency of a message between stages, as the engine runs them, from two of
    its steps on tiny Linear(4, 4) layers against the simulator's: every rank a replica of one layer (8 micro-batches,
    then the all-reduce of their gradients, timed alone: no message, the computes' host cost), then GPipe with one
    micro-batch over a layer a rank (a chain: each compute waits for a message), solved in turn by bisection (each
    simulated step grows with its unknown). A ping between two ranks alone (``p2p``, whose per-byte price is kept)
    misses what a rank pays to take a message up in a step."""
    from torch import nn

    from schedules import Costs, simulate

    world = dist.get_world_size()
    link = Link.fit(p2p)
    runs = []
    for layers, micro, replicas in ((1, 8, world), (world, 1, 1)):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
        engine = build(model, nn.functional.mse_loss, num_microbatches=micro, schedule="gpipe", data_parallel=replicas)
        batch, target = torch.randn(micro, 4), torch.randn(micro, 4)
        times = []
        for _ in range(repeats + 2):
            dist.barrier()
            start = time.perf_counter()
            engine.train_step(batch, target)
            times.append(_synced(time.perf_counter() - start))
        runs.append((engine.schedule, statistics.median(times[2:]), replicas))
    gradients = sum(p.numel() for p in nn.Linear(4, 4).parameters())  # floats, all-reduced in one buffer
    reduce = _collective("all_reduce", gradients, dist.group.WORLD, world, repeats, device)

    def step(run: tuple[Any, float, int], overhead: float, latency: float) -> float:
        program, _, replicas = run  # a message is a micro-batch's output: Linear(4, 4) keeps its input's size
        costs = Costs(forward=overhead, backward=overhead, latency=latency, per_byte=link.per_byte, message_bytes=16,
                      all_reduce=reduce if replicas > 1 else 0.0,
                      processors=None if processors is None else processors / replicas)  # fmt: skip
        return simulate(program, costs).makespan

    def solve(run: tuple[Any, float, int], price: Callable[[float], float]) -> float:
        low, high = 0.0, run[1]
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (middle, high) if price(middle) < run[1] else (low, middle)
        return (low + high) / 2

    alone, chain = runs
    overhead = solve(alone, lambda o: step(alone, o, 0.0))
    return overhead, Link(solve(chain, lambda latency: step(chain, overhead, latency)), link.per_byte)
