"""The machine's prices: host time per instruction, a point-to-point message, each collective over each group size.

    python -m pipeengine.tune --calibrate --world-size 4     # measure on 4 ranks of this machine; keep the file

``calibrate()`` measures them on the live ranks of the default process group (every rank calls it), in seconds
(pipeengine.planner.probes): a message between two ranks (fitted to latency + bytes x per_byte) and each
collective FSDP, data and tensor parallelism run (all-reduce, all-gather, reduce-scatter) at 1 KiB to 16 MiB on
every group size that divides the world, each after a compute on every rank as a step runs it (a Curve through
the sizes measured); a training step's frame (the header a pipeline's ranks agree on before its program, the loss
shared after it) over each group size; posting a message;
copying a byte of gradients (a sync flattens them); how many ranks compute at full speed at once (CPU ranks share
the machine's cores: each times the same work alone and all together); and the host cost of one pipeline
instruction and the latency of a message between stages as the engine takes it up, fitted so that the simulator's
steps of tiny layers (a pipeline of one rank, then a chain of stages, less the frame of the world's pipeline, timed
beside it) take what the engine's took. ``save`` keeps
them in a file per machine (``default_path()``: the host's name, with the date); ``load`` reads it, or gives the
built-in constants, measured once on the 2-core machine of the benchmarks, and says so (``Prices.source``). The
planner (pipeengine.planner.search) prices every layout with them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeengine.core.files import once_each, write_atomically
from pipeengine.planner import calibration_file, probes, shared_cores

__all__ = ["COLLECTIVES", "Curve", "Link", "Prices", "calibrate", "default_path", "load", "measure_machine", "save"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # priced on the whole tensor's bytes
# The built-in constants: what python -m pipeengine.tune --calibrate --world-size 4 measured on the benchmarks'
# machine (when and how they spread: docs/benchmarks.md): host seconds per compute beyond its layers' measured time, a
# message's latency as a step takes it up (fitted after the frame, which it trades off against) and per byte; a
# training step's frame over pipelines and replicas of 2 and 4 ranks; posting (per post, per message more); copying
# a byte of gradients
OVERHEAD = 6e-5
LATENCY, PER_BYTE = 1e-4, 3e-10
FRAME = {"pipeline": {2: 3.4e-3, 4: 4.5e-3}, "replicas": {2: 4e-4, 4: 4.5e-4}}
POST, POST_MESSAGE, COPY = 2.2e-5, 1.3e-5, 4e-11
# FSDP2 per unit: host seconds in a forward and a backward; beyond the raw collective, its gather and reduce-scatter
FSDP = {"hooks": [9e-5, 7.5e-5], "gather": {2: 1e-3, 4: 1.3e-3}, "reduce": {2: 5e-4, 4: 1.5e-3}}
FORMAT = 2  # of the calibration file: 1 (no version written) had no frame, posting, copying or FSDP's extras
CALIBRATE = "python -m pipeengine.tune --calibrate --world-size N (N: the ranks you will run)"
BUILT_IN = f"built-in constants (measured on the benchmarks' 2-core machine, not this one: run {CALIBRATE})"
SIZES = (2**12, 2**16, 2**20, 2**24)  # bytes each message is timed at: up to a model's gradients
# bytes each collective is timed at: a micro-batch's activations (tensor parallelism) to a stage's gradients
COLLECTIVE_SIZES = (2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24)


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


@dataclass(frozen=True)
class Curve:
    """Seconds measured at some sizes (bytes ascending): between two, the line through them; below the smallest, its
    time; past the largest, the last segment's slope. ``of`` makes the times non-decreasing (noise never makes a
    larger tensor cheaper): the closest such in least squares, each run of sizes measured out of order pooled to
    their mean. ``latency`` and ``per_byte`` read as a Link's: the smallest's time, the last slope."""

    points: tuple[tuple[float, float], ...]

    @classmethod
    def of(cls, samples: Sequence[tuple[float, float]]) -> Curve:
        ordered = sorted((float(b), float(s)) for b, s in samples)
        pools: list[list[float]] = []  # [sum of times, count], pooled adjacent violators
        for _, seconds in ordered:
            pools.append([seconds, 1.0])
            while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
                total, count = pools.pop()
                pools[-1][0] += total
                pools[-1][1] += count
        times = [total / count for total, count in pools for _ in range(int(count))]
        return cls(tuple((size, t) for (size, _), t in zip(ordered, times, strict=True)))

    @property
    def latency(self) -> float:
        return self.points[0][1]

    @property
    def per_byte(self) -> float:
        if len(self.points) < 2:
            return 0.0
        (a, t), (b, u) = self.points[-2:]
        return (u - t) / (b - a)

    def time(self, nbytes: float) -> float:
        points = self.points
        if nbytes <= points[0][0]:
            return points[0][1]
        for (a, t), (b, u) in zip(points, points[1:], strict=False):
            if nbytes <= b:
                return t + (u - t) * (nbytes - a) / (b - a)
        return points[-1][1] + self.per_byte * (nbytes - points[-1][0])


def _steps(op: str, group: int) -> tuple[float, float]:
    """A ring's (messages, share of the whole tensor each rank sends) for ``op`` over ``group`` ranks."""
    rounds = 2 * (group - 1) if op == "all_reduce" else group - 1
    return float(rounds), rounds / group


@dataclass(frozen=True)
class Prices:
    """What the planner charges: ``overhead`` seconds of host time per compute; ``p2p`` a message between stages;
    ``collectives[op][group]`` an op over a group of that many ranks, on the whole tensor's bytes (an all-gather's
    output, a reduce-scatter's input). A group size not measured is scaled from the nearest measured one as a ring
    scales; an op never measured is a ring of ``p2p`` messages. ``crowded[op][group]``: the same with every group of
    that size in the world running it at once (where smaller than the world). ``source`` says where they come from.
    ``processors``: how many ranks of the machine compute at full speed at once (CPU ranks share its cores: 2 for 4
    ranks on 2 cores), measured; None: each rank its own (a GPU each, or not measured). ``frame[name][group]``: the
    seconds a training step spends outside its program ("pipeline": the header its ranks gather first and the loss
    broadcast last, "replicas": the loss summed over them), ``post`` and ``post_message`` a post's host seconds and
    each message's more in it, ``copy`` host seconds per byte a gradient sync copies. ``fsdp``: what FSDP2 adds per
    unit: "hooks" (host seconds in a forward, a backward), "gather" and "reduce" (seconds beyond the raw collective,
    by group). ``wake``: where ranks share processors, how late a rank woken by a message starts while others compute,
    by their work's price ((price, seconds) points, pipeengine.planner.wakes; Costs.wake); none: at once."""

    overhead: float = OVERHEAD
    p2p: Link = field(default_factory=lambda: Link(LATENCY, PER_BYTE))
    collectives: Mapping[str, Mapping[int, Link | Curve]] = field(default_factory=dict)
    source: str = BUILT_IN
    calibrated: bool = False
    processors: float | None = None  # ranks of this machine that compute at full speed at once; None: every rank
    world_size: int | None = None  # the ranks they were measured on (a calibration file's)
    frame: Mapping[str, Mapping[int, float]] = field(default_factory=lambda: FRAME)
    post: float = POST
    post_message: float = POST_MESSAGE
    copy: float = COPY
    fsdp: Mapping[str, Any] = field(default_factory=lambda: FSDP)
    crowded: Mapping[str, Mapping[int, Link | Curve]] = field(default_factory=dict)
    wake: tuple[tuple[float, float], ...] = ()

    def fsdp_extra(self, name: str, group: int) -> float:
        """Seconds FSDP2 adds per unit to its all-gather ("gather") or reduce-scatter ("reduce") over ``group`` ranks
        beyond the raw collective (the nearest group size measured; none measured: 0)."""
        measured = self.fsdp.get(name, {})
        if group <= 1 or not measured:
            return 0.0
        return float(measured[min(measured, key=lambda g: (abs(g - group), g))])

    def frame_of(self, data_parallel: int, pipeline: int) -> float:
        """Seconds a training step of ``pipeline`` ranks a pipeline and ``data_parallel`` replicas spends outside its
        program (a group size not measured: the nearest measured, scaled by its ranks less one)."""
        total = 0.0
        for name, size in (("pipeline", pipeline), ("replicas", data_parallel)):
            measured = self.frame.get(name, {})
            if size > 1 and measured:
                near = min(measured, key=lambda g: (abs(g - size), g))
                total += measured[near] * (size - 1) / (near - 1)
        return total

    def collective(self, op: str, group: int, nbytes: float, crowded: bool = False) -> float:
        """Seconds of ``op`` on a whole tensor of ``nbytes`` over ``group`` ranks: the group's ranks alone, or
        (``crowded``) with every group of that size in the world running it at once, as the replicas of each pipeline
        rank do (where measured)."""
        if op not in COLLECTIVES:
            raise ValueError(f"no price for collective {op!r}: the planner prices {', '.join(COLLECTIVES)}")
        if group <= 1 or nbytes <= 0:
            return 0.0
        if crowded and group in self.crowded.get(op, {}):
            return self.crowded[op][group].time(nbytes)
        fitted = self.collectives.get(op, {})
        if group in fitted:
            return fitted[group].time(nbytes)
        rounds, share = _steps(op, group)
        if not fitted:
            return rounds * self.p2p.latency + share * self.p2p.per_byte * nbytes
        near = min(fitted, key=lambda g: (abs(g - group), g))
        near_rounds, near_share = _steps(op, near)
        link = fitted[near]  # its latency by the rounds, the rest by the bytes each rank sends
        return link.latency * rounds / near_rounds + (link.time(nbytes) - link.latency) * share / near_share

    def to_json(self) -> dict[str, object]:
        return {
            "format": FORMAT,
            "overhead": self.overhead,
            "p2p": [self.p2p.latency, self.p2p.per_byte],
            "processors": self.processors,
            "post": [self.post, self.post_message],
            "copy": self.copy,
            "fsdp": {
                "hooks": list(self.fsdp.get("hooks", [0.0, 0.0])),
                **{name: {str(g): s for g, s in self.fsdp.get(name, {}).items()} for name in ("gather", "reduce")},
            },
            "frame": {name: {str(g): s for g, s in sizes.items()} for name, sizes in self.frame.items()},
            "collectives": _curves(self.collectives),
            "crowded": _curves(self.crowded),
            "wake": [list(point) for point in self.wake],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str) -> Prices:
        """Prices from a calibration file's record; a ValueError naming the field (its path in the JSON), its value
        and the rule where the planner cannot price with it (pipeengine.planner.calibration_file: not a finite
        number >= 0, a curve measured twice at one size, a group of one rank, ...), or it is of another format."""
        calibration_file.check(data, FORMAT, COLLECTIVES)
        collectives, crowded = _read_curves(data.get("collectives", {})), _read_curves(data.get("crowded", {}))
        post, post_message = map(float, data["post"])
        by_group = {name: _by_group(data["fsdp"][name]) for name in ("gather", "reduce")}
        fsdp: dict[str, Any] = {"hooks": [float(h) for h in data["fsdp"]["hooks"]], **by_group}
        return cls(
            float(data["overhead"]),
            Link(*map(float, data["p2p"])),
            collectives,
            source,
            True,
            None if data.get("processors") is None else float(data["processors"]),
            data.get("world_size"),
            frame={name: _by_group(sizes) for name, sizes in data["frame"].items()},
            post=post,
            post_message=post_message,
            copy=float(data["copy"]),
            fsdp=fsdp,
            crowded=crowded,
            wake=tuple(sorted((float(c), float(late)) for c, late in data.get("wake", []))),
        )


def _curves(table: Mapping[str, Mapping[int, Link | Curve]]) -> dict[str, dict[str, list[Any]]]:
    """Collectives' prices as a file keeps them: a Curve as its [bytes, seconds] points, a Link as [latency,
    per_byte]."""
    return {
        op: {
            str(g): [list(p) for p in link.points] if isinstance(link, Curve) else [link.latency, link.per_byte]
            for g, link in groups.items()
        }
        for op, groups in table.items()
    }


def _read_curves(table: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[int, Link | Curve]]:
    return {
        op: {int(g): Curve.of(v) if v and isinstance(v[0], list) else Link(*map(float, v)) for g, v in groups.items()}
        for op, groups in table.items()
    }


def _curved(samples: Mapping[str, Mapping[int, Sequence[tuple[float, float]]]]) -> dict[str, dict[int, Link | Curve]]:
    """Each op's (bytes, seconds) samples by group size as a Curve through them."""
    return {op: {g: Curve.of(s) for g, s in found.items()} for op, found in samples.items()}


def _by_group(table: Mapping[str, Any]) -> dict[int, float]:
    """A file's {"group size": seconds} as {size: seconds}."""
    return {int(group): float(value) for group, value in table.items()}


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
    record = {
        "host": socket.gethostname(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **about,
        **prices.to_json(),
    }
    text = json.dumps(record, indent=1) + "\n"
    write_atomically(target, lambda temporary: Path(temporary).write_text(text))  # never seen half written
    return target


def load(path: str | os.PathLike[str] | None = None) -> Prices:
    """The prices kept at ``path`` (default_path()), or the built-in constants where there is no file. A file
    that cannot be read, or holds what the planner cannot price with, is refused naming it and the field."""
    source = Path(path) if path is not None else default_path()
    if not source.exists():
        if path is not None:
            raise FileNotFoundError(f"no calibration file at {source}: run {CALIBRATE}")
        return Prices()
    again = f"delete it or run {CALIBRATE} again"
    try:
        data = json.loads(source.read_text(), object_pairs_hook=once_each)
    except (OSError, ValueError) as error:  # not a file to read, or not JSON, or a key written twice
        read = f"{type(error).__name__}: {error}"
        raise ValueError(f"calibration file {source} cannot be read ({read}); {again}") from error
    try:
        return Prices.from_json(data, f"calibrated on {calibration_file.measured(data)} ({source})")
    except ValueError as error:
        raise ValueError(f"calibration file {source} is refused: {error}; {again}") from error


def calibrate(engine: Callable[..., Any], repeats: int = 5, sizes: Sequence[int] = COLLECTIVE_SIZES) -> Prices:
    """Measure this machine's prices on every rank of the default process group (each calls it; at least 2 ranks);
    every rank returns them. ``engine``: PipelineEngine, whose step the host cost is fitted to (given by the caller:
    the planner sits below the engine)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise ValueError("calibration measures messages and collectives between ranks: launch at least 2")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    samples: dict[str, dict[int, list[tuple[float, float]]]] = {op: {} for op in COLLECTIVES}
    p2p = Link.fit([(size, probes.ping(size // 4, repeats, device)) for size in SIZES])
    groups = {
        g: dist.new_subgroups(g)[0] if g < world else dist.group.WORLD for g in range(2, world + 1) if world % g == 0
    }
    crowded: dict[str, dict[int, list[tuple[float, float]]]] = {op: {} for op in COLLECTIVES}
    baseline = probes.computing(4 * repeats, 2 * repeats, device)  # what each op's price is beyond
    for group_size, group in groups.items():
        for op in COLLECTIVES:
            for size in sizes:
                # a small op's time varies with when each rank is scheduled: many of them, in few rounds
                count, rounds = (4 * repeats, 3) if size < 2**20 else (repeats, repeats) if size < 2**22 else (2, 3)
                samples[op].setdefault(group_size, []).append(
                    (
                        size,
                        probes.collective(
                            op, size // 4, group, group_size, count, device, rounds, rank < group_size, baseline
                        ),
                    )
                )
                if group_size < world:  # every group of the size at once, as the replicas of each pipeline rank
                    crowded[op].setdefault(group_size, []).append(
                        (
                            size,
                            probes.collective(
                                op, size // 4, group, group_size, count, device, rounds, baseline=baseline
                            ),
                        )
                    )
    post, post_message = probes.posting(2 * repeats, device)
    sharing = shared_cores.measure_processors(repeats, device)  # CPU ranks only: the optional host model
    # the world's pipeline frame is timed below, beside probes.host's chain of stages
    framed = probes.frame(groups, 12 * repeats, device, pipelines=[g for g in groups if g < world])
    partial = Prices(
        0.0,
        p2p,
        _curved(samples),
        f"measured just now on {socket.gethostname()}",
        True,
        sharing,
        None,
        frame=framed,
        post=post,
        post_message=post_message,
        copy=probes.copying(repeats, device),
        fsdp={},
        crowded=_curved(crowded),
    )
    partial = dataclasses.replace(partial, fsdp=_fsdp(partial, probes.fsdp(groups, 2 * repeats, device)))
    overhead, latency, around = probes.host(engine, _stepper(partial), 4 * repeats, device)
    frame = {**partial.frame, "pipeline": {**partial.frame["pipeline"], world: around}}  # timed with the latency's
    found = dataclasses.replace(partial, overhead=overhead, p2p=Link(latency, p2p.per_byte), frame=frame)
    if sharing is not None:  # ranks share processors: how late one woken while others compute
        found = dataclasses.replace(found, wake=shared_cores.wake(sharing, 6 * repeats))
    shared: list[object] = [found if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]  # type: ignore[return-value]


def _fsdp(prices: Prices, measured: Mapping[str, Any]) -> dict[str, Any]:
    """What FSDP2 adds per unit beyond the raw collectives: probes.fsdp's seconds per unit over each group size less
    the calibrated collective at the unit's bytes (every group at once, as the probe ran it), at least 0."""
    unit = float(measured["unit"])
    return {
        "hooks": measured["hooks"],
        **{
            name: {g: max(0.0, t - prices.collective(op, g, unit, crowded=True)) for g, t in measured[name].items()}
            for name, op in (("gather", "all_gather"), ("reduce", "reduce_scatter"))
        },
    }


def _stepper(prices: Prices) -> Callable[[Any, float, float], float]:
    """probes.host's simulated program of its tiny Linear(4, 4) layers at ``prices``, for a host cost per compute and
    a message latency: every compute that host cost, each message a micro-batch's output (Linear(4, 4) keeps its
    input's size), posting (the step's frame is measured beside it)."""
    from schedules import Costs, simulate

    def step(program: Any, overhead: float, latency: float) -> float:
        costs = Costs(
            forward=overhead,
            backward=overhead,
            latency=latency,
            per_byte=prices.p2p.per_byte,
            message_bytes=16,
            post=prices.post,
            post_message=prices.post_message,
            processors=None if prices.processors is None else min(prices.processors, program.num_ranks),
        )
        return simulate(program, costs).makespan

    return step


def measure_machine(
    world_size: int, engine: Callable[..., Any], backend: str = "gloo", path: str | os.PathLike[str] | None = None
) -> tuple[Path, Prices]:
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
