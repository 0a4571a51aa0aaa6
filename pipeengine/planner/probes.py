"""What calibration measures on the live ranks (pipeengine.planner.calibration runs them; every rank calls each):
a message's time, each collective's, a step's frame, posting, copying, how many ranks compute at full speed at once,
and the host cost and message latency as the engine's own steps take them."""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeengine.comm.calls import ROW

__all__ = ["busy", "collective", "computing", "copying", "frame", "fsdp", "host", "ping", "posting", "trimmed"]

HEADER = ROW  # int64s in a step's header row, as pipeengine.comm.calls gathers it


def synced(seconds: float) -> float:
    """The slowest rank's time (a collective is done when its last rank is)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def ping(elements: int, repeats: int, device: torch.device) -> float:
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


def collective(
    op: str,
    elements: int,
    group: Any,
    size: int,
    repeats: int,
    device: torch.device,
    rounds: int = 1,
    active: bool = True,
    baseline: float | None = None,
) -> float:
    """Seconds of one ``op`` on a whole tensor of ``elements`` floats over ``group``: ``repeats`` back to back after
    one barrier, as a step runs them, the slowest rank's time over their count (once warm); with ``rounds``, the
    median of that many. Timed one by one from a barrier each, an op also took the barrier's exit skew, milliseconds
    when ranks share cores. Every rank calls it; those not ``active`` (not of the group timed) only wait.

    On CPU each op follows a compute on every rank of the world, as in a step (a layer's matmul before a
    tensor-parallel all-reduce, the other stages' layers beside it; ``busy``), those not ``active`` computing too, and
    its price is what it adds to that compute's time (``baseline``: the compute's, ``computing()``'s, measured
    once for many ops; else each round timed both ways, the compute alone first): with
    its ranks' processors busy a collective takes a fraction of what it takes from idle ones, and the
    tensor-parallel steps measured took the former (docs/benchmarks.md)."""
    whole = torch.ones(elements - elements % size, device=device)
    shard = torch.empty(whole.numel() // size, device=device)
    work = busy(device)

    def once() -> None:
        with warnings.catch_warnings():  # torch 2.13 deprecates the *_tensor names FSDP2 itself still calls
            warnings.simplefilter("ignore", FutureWarning)
            if op == "all_reduce":
                dist.all_reduce(whole, group=group)
            elif op == "all_gather":
                dist.all_gather_into_tensor(whole, shard, group=group)
            else:
                dist.reduce_scatter_tensor(shard, whole, group=group)

    def timed(with_op: bool) -> float:
        dist.barrier()
        if active:  # the group leaves together: the barrier's exit skew is not the op's
            once()
        start = time.perf_counter()
        for _ in range(repeats):
            work()
            if with_op:
                once()
        if whole.is_cuda:
            torch.cuda.synchronize()
        return synced(time.perf_counter() - start if active else 0.0) / repeats

    if active:
        once()
    found = []
    for _ in range(rounds):
        alone = baseline if baseline is not None else timed(False) if whole.device.type == "cpu" else 0.0
        found.append(max(0.0, timed(active) - alone))
    return statistics.median(found)


def computing(repeats: int, rounds: int, device: torch.device) -> float:
    """Seconds of ``busy``'s compute as collective() times it between ops, every rank computing (the slowest rank's,
    the median of ``rounds``): the baseline a collective's price is what it adds to."""
    work = busy(device)
    found = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            work()
        found.append(synced(time.perf_counter() - start) / repeats)
    return statistics.median(found) if device.type == "cpu" else 0.0


def busy(device: torch.device) -> Callable[[], object]:
    """The compute collective() puts before each op on CPU (a layer's matmul: 128 x 1024 by 1024 x 256 floats, about
    half a millisecond on one thread); nothing on an accelerator, whose ranks wait on each other through a
    collective whatever runs."""
    if device.type != "cpu":
        return lambda: None
    generator = torch.Generator().manual_seed(0)
    left, right = torch.randn(128, 1024, generator=generator), torch.randn(1024, 256, generator=generator)
    return lambda: torch.mm(left, right)


def trimmed(samples: Sequence[float], cut: float = 0.1) -> float:
    """The mean of the samples without the lowest and highest ``cut`` of them: a step's frame over shared cores
    is two-valued (a short and a long time, about as often: docs/benchmarks.md), where a median jumps between the
    two from run to run and a mean follows how often each comes; the cut keeps a stall out."""
    ordered = sorted(samples)
    drop = int(len(ordered) * cut)
    kept = ordered[drop : len(ordered) - drop] or ordered
    return sum(kept) / len(kept)


def frame(
    groups: Mapping[int, Any], repeats: int, device: torch.device, pipelines: Collection[int] | None = None
) -> dict[str, dict[int, float]]:
    """What a training step runs outside its program, over groups of each size (``groups``: size -> this rank's
    group, all the world's groups of that size at once), each timed as a step takes it, from a barrier (the
    slowest rank's, the trimmed mean of ``repeats``): "pipeline", the header every rank of a pipeline gathers before the
    step (pipeengine.comm.calls) and the loss its last rank broadcasts after, over the sizes in ``pipelines`` (default:
    every one); "replicas", the loss summed over them."""
    found: dict[str, dict[int, float]] = {"pipeline": {}, "replicas": {}}
    loss = torch.zeros((), device=device)
    for size, group in groups.items():

        def replicas(group: Any = group) -> None:
            dist.all_reduce(loss, group=group)

        steps = [("pipeline", pipeline_frame(group, size, device))] if pipelines is None or size in pipelines else []
        for name, step in (*steps, ("replicas", replicas)):
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                step()
                times.append(synced(time.perf_counter() - start))
            found[name][size] = trimmed(times[1:])
    return found


def pipeline_frame(group: Any, size: int, device: torch.device) -> Callable[[], None]:
    """A pipeline's frame over ``group`` (of ``size`` ranks) as a step runs it: the header every rank gathers before
    the program (pipeengine.comm.calls) and the loss the last rank broadcasts after."""
    row = torch.zeros(HEADER, dtype=torch.int64, device=device)
    rows, loss = [torch.empty_like(row) for _ in range(size)], torch.zeros((), device=device)

    def run() -> None:
        dist.all_gather(rows, row, group=group)
        dist.broadcast(loss, group_src=size - 1, group=group)

    return run


def posting(repeats: int, device: torch.device, elements: int = 1024) -> tuple[float, float]:
    """Host seconds to post communication as the engine's transports do (one batch_isend_irecv per post), and the
    seconds of each message more in one post: rank 1 posts 1, then 8 recvs from rank 0 in one post, rank 0 each send
    to them in a post of its own (their recvs posted first, as gloo's programs post every recv at a step's start);
    the medians of ``repeats``; the other ranks wait."""
    rank = dist.get_rank()
    one: list[float] = []
    many: list[float] = []
    sends: list[float] = []
    for count in [1, 8] * repeats:
        buffers = [torch.zeros(elements, device=device) for _ in range(count)]
        handles = []
        if rank == 1:
            start = time.perf_counter()
            handles = dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, 0) for b in buffers])
            (one if count == 1 else many).append(time.perf_counter() - start)
        dist.barrier()
        if rank == 0:
            for b in buffers:
                start = time.perf_counter()
                handles += dist.batch_isend_irecv([dist.P2POp(dist.isend, b, 1)])
                sends.append(time.perf_counter() - start)
        for handle in handles:
            handle.wait()
        dist.barrier()
    found = torch.zeros(3, dtype=torch.float64)
    if rank < 2:
        found[rank] = statistics.median(sends) if rank == 0 else statistics.median(one)
        found[2] = statistics.median(many) if rank == 1 else 0.0
    dist.all_reduce(found)
    per_message = max(float(found[2] - found[1]) / 7, 0.0)
    return (float(found[0]) + float(found[1])) / 2, per_message


def copying(repeats: int, device: torch.device, elements: int = 2**20) -> float:
    """Host seconds per byte a gradient sync copies (its gradients flattened into one buffer, or back): the median
    of ``repeats`` flattenings of 16 tensors of ``elements`` floats in all, on this rank alone (the others wait)."""
    pieces = [torch.ones(elements // 16, device=device) for _ in range(16)]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        torch.cat([p.reshape(-1) for p in pieces])
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / (elements * 4)


def fsdp(
    groups: Mapping[int, Any], repeats: int, device: torch.device, width: int = 256, units: int = 3
) -> dict[str, Any]:
    """What FSDP2 adds to a stage as the engine shards one (pipeengine.parallel.fsdp: each layer a unit, gradients
    accumulated whole between syncs), on ``units`` Linear(width, width) layers against the same unsharded: "hooks",
    host seconds per unit in a forward and in a backward once gathered (each rank in turn, the others waiting); and
    over each group size (``groups``: size -> this rank's group, all the world's groups of that size at once),
    seconds per unit a forward that gathers it takes more ("gather") and a backward that reduce-scatters it
    ("reduce"), the slowest rank's; "unit", its bytes. The medians of ``repeats``."""
    from torch import nn

    from pipeengine.parallel import fsdp as sharding

    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(width, width) for _ in range(units)]).to(device)
    x = torch.randn(4, width, device=device)
    unit = (width * width + width) * 4
    rank = dist.get_rank()

    def passes(module: nn.Module, sync: bool = False) -> tuple[float, float]:
        start = time.perf_counter()
        out = module(x)
        middle = time.perf_counter()
        if sync:
            sharding.sync_next(module)
        out.sum().backward()
        module.zero_grad(set_to_none=True)
        return middle - start, time.perf_counter() - middle

    found: dict[str, Any] = {"gather": {}, "reduce": {}, "unit": unit}
    alone = [passes(plain) for _ in range(repeats)]  # the unsharded layers, the baseline of each
    for size, group in groups.items():
        sharded = sharding.probe_stage(copy.deepcopy(plain), group, device.type)
        timings = []
        for _ in range(repeats + 1):
            sharding.regather(sharded)
            dist.barrier()
            timings.append(passes(sharded, sync=True))
        extra = [statistics.median(t[k] for t in timings[1:]) - statistics.median(t[k] for t in alone) for k in (0, 1)]
        seconds = torch.tensor(extra, dtype=torch.float64) / units
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        found["gather"][size], found["reduce"][size] = max(float(seconds[0]), 0.0), max(float(seconds[1]), 0.0)
        if size == dist.get_world_size():  # the hooks, once gathered, with no collective
            sharding.regather(sharded)
            passes(sharded)
            hooks = torch.zeros(2, dtype=torch.float64)
            for turn in range(size):
                dist.barrier()
                if turn == rank:
                    mine = [passes(sharded) for _ in range(repeats)]
                    hooks += torch.tensor(
                        [
                            max(statistics.median(t[k] for t in mine) - statistics.median(t[k] for t in alone), 0.0)
                            / units
                            for k in (0, 1)
                        ],
                        dtype=torch.float64,
                    )
            dist.all_reduce(hooks)
            found["hooks"] = [float(h) / size for h in hooks]
    return found


def host(
    build: Callable[..., Any], price: Callable[[Any, float, float], float], repeats: int, device: torch.device
) -> tuple[float, float, float]:
    """Host seconds per compute and the latency of a message between stages, as the engine runs them, from two of
    its steps on tiny Linear(4, 4) layers against the simulator's (``price(program, overhead, latency)``: a simulated
    program at those prices, without the step's frame): a pipeline of one rank (8 micro-batches, no message: the
    computes' host cost; each rank on a group of its own, one at a time, the others waiting), then GPipe with one
    micro-batch over a layer a rank (a chain: each compute waits for a message) less the world's pipeline frame
    (``pipeline_frame``), each solved by bisection (each simulated step grows with its unknown); and that frame. A
    ping between two ranks alone misses what a rank pays to take a message up in a step. The chain's steps spread
    widely, and so do the frame's: many of each, one after the other, the frame taken from the same moments as the
    chain it is part of (timed apart, the latency they left moved more than twice as much: docs/benchmarks.md)."""
    from torch import nn

    world, rank = dist.get_world_size(), dist.get_rank()
    alone = [dist.new_group([r]) for r in range(world)]

    def timed(step: Callable[[], object], mine: bool = True, count: int = repeats, warm: int = 2) -> list[float]:
        times = []
        for _ in range(count + warm):
            dist.barrier()
            start = time.perf_counter()
            if mine:
                step()
            times.append(time.perf_counter() - start)
        return times[warm:]

    def solve(measured: float, step: Callable[[float], float]) -> float:
        low, high = 0.0, measured
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (middle, high) if step(middle) < measured else (low, middle)
        return (low + high) / 2

    torch.manual_seed(0)
    single = build(
        nn.Sequential(nn.Linear(4, 4)), nn.functional.mse_loss, num_microbatches=8, schedule="gpipe", group=alone[rank]
    )
    batch, target = torch.randn(8, 4), torch.randn(8, 4)
    steps = [statistics.median(timed(lambda: single.train_step(batch, target), turn == rank)) for turn in range(world)]
    overhead = solve(synced(steps[rank]), lambda o: price(single.schedule, o, 0.0))
    chain = build(
        nn.Sequential(*[nn.Linear(4, 4) for _ in range(world)]),
        nn.functional.mse_loss,
        num_microbatches=1,
        schedule="gpipe",
    )
    frame = pipeline_frame(dist.group.WORLD, world, device)
    chains, frames = [], []
    for turn in range(6 * repeats):
        chains += timed(lambda: chain.train_step(batch[:1], target[:1]), count=1, warm=2 if turn == 0 else 0)
        frames += timed(frame, count=1, warm=2 if turn == 0 else 0)
    around = synced(trimmed(frames))
    measured = synced(statistics.median(chains)) - around
    return overhead, solve(measured, lambda latency: price(chain.schedule, overhead, latency)), around
