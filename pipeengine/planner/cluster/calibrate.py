"""A hardware description measured on the user's own GPUs: the preset's datasheet figures (peaks, memory) kept, the
rest measured where it runs, each measured figure's source saying so.

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 8 ... -m pipeengine.tune --calibrate \\
        --hardware h100-sxm --out my-cluster.json
    python -m pipeengine.tune --model config.json --devices 512 --hardware my-cluster.json ...

What is measured (every rank takes part; rank 0 writes the file):

- ``matmul_efficiency``: the best of square matmuls at the precision's dtype (Bekman's MAMF method: the best shape,
  a fraction of the datasheet peak) and, where ``shapes`` are given (the model's own, m x k x n), each of them;
  the description keeps the best, and the file's source lists every shape measured.
- ``memory_bandwidth``: a device-to-device copy (read and write) of ``copy_bytes``.
- ``intra``: all-reduce over the ranks of each node, at ``sizes`` bytes, fitted to NCCL's ring
  (``collectives.all_reduce``: 2(n-1) steps of the latency and 2(n-1)/n of the size at the bus bandwidth) by least
  squares: the figures the planner prices with, and the measured sweep itself (``Link.sweep``: each size's bus
  bandwidth, which the planner prices no collective faster than). ``inter``: the same over one rank of each node
  (the local ranks' groups all at once, each GPU on its own NIC, as a data-parallel all-reduce across nodes runs),
  where there are two nodes or more; otherwise the preset's, its source saying it was not measured.

A fit whose latency comes out at zero or below (the sizes too large to see it) keeps the preset's latency and says
so. The timing of a collective is the slowest rank's, the median of ``repeats``, after a warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeengine.planner.cluster.hardware import Hardware, Link, load

__all__ = ["fit_ring", "main", "measure"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SIZES = (2**20, 2**23, 2**26, 2**28)  # 1 MiB to 256 MiB: latency-bound to bandwidth-bound on NVLink and InfiniBand
SQUARES = (4096, 8192)
TRIAL: dict[str, Any] = {"copy_bytes": 2**24, "sizes": (2**12, 2**22), "squares": (256,)}  # --device cpu: small


def fit_ring(sizes: Sequence[float], seconds: Sequence[float], ranks: int) -> tuple[float, float]:
    """(bus bandwidth, latency a step) of a ring all-reduce over ``ranks`` from its times at ``sizes`` bytes: the
    least-squares line ``seconds = 2(n-1) latency + 2(n-1)/n size / bandwidth`` (collectives.all_reduce). The
    latency may come out at zero or below where the sizes are too large to show it: the caller decides."""
    if ranks < 2 or len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError(
            f"fit_ring: {len(sizes)} sizes ({len(set(sizes))} distinct) and {len(seconds)} times over "
            f"{ranks} ranks: give two distinct sizes or more, a time each, over 2 ranks or more"
        )
    x = [2 * (ranks - 1) / ranks * size for size in sizes]
    mean_x, mean_y = statistics.fmean(x), statistics.fmean(seconds)
    slope = sum((a - mean_x) * (b - mean_y) for a, b in zip(x, seconds, strict=True)) / sum(
        (a - mean_x) ** 2 for a in x
    )
    if slope <= 0:
        raise ValueError(
            f"fit_ring: the times {list(seconds)} do not grow with the sizes {list(sizes)}: not a "
            f"measurement of a link; measure again on an idle machine"
        )
    intercept = mean_y - slope * mean_x
    return 1 / slope, intercept / (2 * (ranks - 1))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable[[], object], device: torch.device, repeats: int, group: Any = None) -> float:
    """The median over ``repeats`` of the slowest rank's seconds for ``step`` (after one warm-up), from a barrier."""
    step()
    found = []
    for _ in range(repeats):
        _synchronize(device)
        if dist.is_initialized():
            dist.barrier(group=group)
        start = time.perf_counter()
        step()
        _synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        if dist.is_initialized():
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        found.append(float(elapsed.item()))
    return statistics.median(found)


def _slowest(rate: float, device: torch.device) -> float:
    """The least of every rank's ``rate``: the description holds for the slowest device of the world."""
    if not dist.is_initialized():
        return rate
    value = torch.tensor([rate], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return float(value.item())


def matmuls(
    shapes: Sequence[tuple[int, int, int]], dtype: torch.dtype, device: torch.device, repeats: int
) -> dict[tuple[int, int, int], float]:
    """FLOP/s of an m x k by k x n matmul for each (m, k, n) in ``shapes``, each rank's device timed alone, the
    slowest device's."""
    found = {}
    for m, k, n in shapes:
        left = torch.randn(m, k, device=device).to(dtype)
        right = torch.randn(k, n, device=device).to(dtype)
        seconds = _timed(functools.partial(torch.mm, left, right), device, repeats, group=_alone())
        found[m, k, n] = _slowest(2 * m * k * n / seconds, device)
    return found


_ALONE: list[tuple[Any, Any]] = []  # (the world it was made in, this rank's group of itself alone)


def _alone() -> Any:
    """A group of this rank alone (a timing that must not wait for the others), or None without a world: made once
    per world (a process that sets torch.distributed up again gets a new one)."""
    if not dist.is_initialized():
        return None
    if not _ALONE or _ALONE[0][0] is not dist.group.WORLD:
        groups = [dist.new_group([rank]) for rank in range(dist.get_world_size())]  # every rank makes every group
        _ALONE[:] = [(dist.group.WORLD, groups[dist.get_rank()])]
    return _ALONE[0][1]


def copy_bandwidth(nbytes: int, device: torch.device, repeats: int) -> float:
    """Bytes/s a device-to-device copy moves (each byte read and written: 2 x nbytes a copy), the slowest device's."""
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    seconds = _timed(functools.partial(target.copy_, source), device, repeats, group=_alone())
    return _slowest(2 * source.numel() * 4 / seconds, device)


def ring(
    group: Any, ranks: int, sizes: Sequence[int], device: torch.device, repeats: int
) -> tuple[float, float, tuple[tuple[float, float], ...]]:
    """(bus bandwidth, latency) of an all-reduce over ``group`` (``ranks`` ranks), fitted from ``sizes``, and the
    sweep it was fitted to: (bytes, busbw) at each size, as nccl-tests print it."""
    seconds = []
    for size in sizes:
        buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
        seconds.append(_timed(functools.partial(dist.all_reduce, buffer, group=group), device, repeats, group))
    sweep = tuple((float(size), 2 * (ranks - 1) / ranks * size / t) for size, t in zip(sizes, seconds, strict=True))
    return (*fit_ring(sizes, seconds, ranks), sweep)


def _node_groups(world: int, per_node: int) -> tuple[Any, Any]:
    """This rank's group of its node's ranks, and of the ranks of its local rank on every node (every rank makes
    every group, in one order, as new_group asks)."""
    rank = dist.get_rank()
    nodes = world // per_node
    intra = [dist.new_group(list(range(node * per_node, (node + 1) * per_node))) for node in range(nodes)]
    inter = [dist.new_group(list(range(local, world, per_node))) for local in range(per_node)] if nodes > 1 else []
    return intra[rank // per_node], (inter[rank % per_node] if inter else None)


def measure(
    base: Hardware,
    *,
    dtype: str = "bf16",
    shapes: Sequence[tuple[int, int, int]] = (),
    sizes: Sequence[int] = SIZES,
    copy_bytes: int = 2**30,
    repeats: int = 10,
    device: torch.device | None = None,
    per_node: int | None = None,
    squares: Sequence[int] = SQUARES,
) -> Hardware:
    """``base`` with what this world's devices measure in place of its matmul efficiency, memory bandwidth and
    links (the module's docstring); every rank calls it, each gets the same description. ``per_node``: ranks a
    node (default: LOCAL_WORLD_SIZE, as torchrun sets it, else the whole world)."""
    device = device or (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_node = per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % per_node:
        raise ValueError(
            f"measure: {world} ranks are not whole nodes of {per_node}: run the same --nproc-per-node on every node"
        )
    moment = [(socket.gethostname(), datetime.datetime.now().astimezone().isoformat(timespec="seconds"))]
    if dist.is_initialized():  # rank 0's host and moment on every rank: one description, whatever the clocks say
        dist.broadcast_object_list(moment, src=0)
    host, now = moment[0]
    where = f"measured on {host} at {now}, {world} ranks ({per_node} a node), torch {torch.__version__}"
    sources = dict(base.sources)
    rates = matmuls([*((n, n, n) for n in squares), *shapes], DTYPES[dtype], device, repeats)
    peak = base.peak_flops[dtype]
    best = max(rates, key=lambda shape: rates[shape])
    efficiency = min(1.0, rates[best] / peak)
    shown = ", ".join(f"{m}x{k}x{n} {rate / 1e12:.3g}" for (m, k, n), rate in rates.items())
    sources["matmul_efficiency"] = (
        f"{where}: the best of {dtype} matmuls (TFLOP/s: {shown}) over the datasheet's {peak / 1e12:.0f} TFLOP/s"
    )
    bandwidth = copy_bandwidth(copy_bytes, device, repeats)
    sources["memory_bandwidth"] = f"{where}: a copy of {copy_bytes} bytes, read and written"
    links = {"intra": base.intra, "inter": base.inter}
    mine, across = _node_groups(world, per_node) if world > 1 else (None, None)
    measured = {
        "intra": (mine, per_node, "a node's ranks") if per_node > 1 and mine is not None else None,
        "inter": (
            across,
            world // per_node,
            f"one rank of each of {world // per_node} nodes, every local rank's group at once",
        )
        if across is not None
        else None,
    }
    for tier, plan in measured.items():
        if plan is None:
            why = "one node" if tier == "inter" else "one rank a node"
            for figure in ("bandwidth", "latency"):
                sources[f"{tier}.{figure}"] = f"the preset's, not measured ({why}): {base.sources[f'{tier}.{figure}']}"
            continue
        group, ranks, who = plan
        said = f"{where}: all_reduce over {who}, at {list(sizes)} bytes, fitted to a ring"
        links[tier], sources[f"{tier}.bandwidth"], sources[f"{tier}.latency"] = _link(
            ring(group, ranks, sizes, device, repeats), getattr(base, tier), said
        )
        sources[f"{tier}.sweep"] = f"{where}: all_reduce over {who}, busbw at each size"
    intra, inter = links["intra"], links["inter"]
    return dataclasses.replace(
        base,
        name=f"{base.name}, measured",
        matmul_efficiency=efficiency,
        memory_bandwidth=bandwidth,
        intra=intra,
        inter=inter,
        sources=sources,
    )


def _link(
    fitted: tuple[float, float, tuple[tuple[float, float], ...]], preset: Link, said: str
) -> tuple[Link, str, str]:
    bandwidth, latency, sweep = fitted
    if latency > 0:
        return Link(bandwidth, latency, sweep), said, said
    kept = f"the preset's: the fit gave {latency:.3g} s a step ({said}); measure smaller sizes to see it"
    return Link(bandwidth, preset.latency, sweep), said, kept


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipeengine.tune --calibrate --hardware BASE --out FILE``: every rank of the world measures; rank 0
    writes the description and prints it."""
    said = (
        "a hardware description measured on these GPUs, the preset's datasheet figures kept (under torchrun: "
        "every rank measures, rank 0 writes --out)"
    )
    made = argparse.ArgumentParser(prog="python -m pipeengine.tune --calibrate --hardware", description=said)
    made.add_argument("--calibrate", action="store_true", required=True)
    made.add_argument("--hardware", required=True, help="the preset (or file) whose datasheet figures are kept")
    made.add_argument("--out", type=Path, required=True, help="where the measured description is written")
    made.add_argument("--precision", choices=tuple(DTYPES), default="bf16")
    made.add_argument("--shapes", default="", help="the model's matmuls, m x k x n, comma separated: 4096x8192x28672")
    made.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a trial run of the measuring")
    made.add_argument("--repeats", type=int, default=10)
    args = made.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.repeats < 1:
            raise ValueError(f"--repeats {args.repeats}: each figure is the median of 1 or more timings")
        base = load(args.hardware)
        shapes = [_shape(text) for text in args.shapes.split(",") if text.strip()]
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "--calibrate --hardware measures GPUs and this machine has none (torch.cuda."
                "is_available() is False): run it on the GPUs to plan for, under torchrun; --device cpu "
                "tries it here"
            )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    started = _world(args.device)
    try:
        device = torch.device("cpu")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            device = torch.device("cuda", torch.cuda.current_device())
        measured = measure(
            base,
            dtype=args.precision,
            shapes=shapes,
            repeats=args.repeats,
            device=device,
            **({} if args.device == "cuda" else TRIAL),
        )
        if not dist.is_initialized() or dist.get_rank() == 0:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(measured.to_json(), indent=1) + "\n")
            print(json.dumps(measured.to_json(), indent=1))
            print(f"wrote {args.out}: plan with --hardware {args.out}")
    finally:
        if started:
            dist.destroy_process_group()
    return 0


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.strip().lower().split("x")
    if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"--shapes: {text.strip()!r} is not m x k x n (three positive whole numbers: 4096x8192x28672)")
    m, k, n = (int(part) for part in parts)
    return m, k, n


def _world(device: str) -> bool:
    """Join torchrun's world where there is one (RANK in the environment); True if this call started it."""
    if "RANK" not in os.environ or dist.is_initialized():
        return False
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return True
