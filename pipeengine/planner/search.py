"""tune: choose the layout (dp x pp x tp, FSDP), schedule, split size, chunks, partition and checkpointing before
launching, under a memory limit, priced on this machine's measured links.

    result = tune(model, loss_fn, sample, world_size=4, tp_plan=plan, memory_limit=2 * 2**30)
    print(result)                                                # every candidate, fastest first
    engine = PipelineEngine(model, loss_fn, **result.best.engine_kwargs())

Each layer is measured once per micro-batch size and tensor-parallel degree on ``sample``
(pipeengine.planner.measure: under tensor parallelism, the shard a rank runs and the collectives it runs; on the
CPU, for the layouts of one pipeline rank, also with the host path warm, as a rank running every layer meets it).
Then every candidate (pipeengine.planner.candidates) is priced by the simulator, time and bytes, without running it:
each factorisation of the world into dp x pp x tp (tp only with a tp_plan whose splits it divides), FSDP on and off
(dp > 1), each registered schedule, each micro-batch count that divides a replica's batch, each chunk count the
schedule runs, the exact min-max partition by time, by memory, by parameters and uniform, and each checkpoint
choice. Its price (pipeengine.planner.costmodel) holds the layers' computes, the host cost per compute and per post,
the messages between stages, tensor parallelism's collectives inside the computes, the replicas' all-reduce (or
FSDP's reduce-scatter) after each stage's last backward and FSDP's all-gather before its first forward, and the
step's frame around its program (the header and the loss shared), at the machine's prices
(pipeengine.planner.calibration: measured by ``python -m pipeengine.tune --calibrate``, else built-in constants, and
the result says which), on this machine's processors (pipeengine.planner.pricing). Candidates whose peak passes
``memory_limit`` on any rank are dropped; the result says how many and what the limit cost, and why each layout it
could not build was refused.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from pipeengine.comm.backends import backend as backend_named
from pipeengine.comm.base import Transport
from pipeengine.core.config import CHECKPOINTING, EngineConfig, check_memory_limit
from pipeengine.core.specs import Tensors, unpack
from pipeengine.launcher.launch import keep_freed_memory
from pipeengine.planner import calibration
from pipeengine.planner.calibration import Prices
from pipeengine.planner.candidates import candidate_specs, layouts, named
from pipeengine.planner.measure import measure_layouts
from pipeengine.planner.pricing import in_parallel, price
from pipeengine.planner.result import Candidate, TuneResult
from schedules import SCHEDULES, Semantics, registration

__all__ = ["Candidate", "TuneResult", "choose", "tune"]


def tune(
    model: nn.Sequential,
    loss_fn: Callable[..., torch.Tensor] | None,
    sample: torch.Tensor | Tensors,
    world_size: int,
    *,
    target: torch.Tensor | Tensors | None = None,
    memory_limit: float | None = None,
    data_parallel: int | None = None,
    tensor_parallel: int | None = None,
    tp_plan: Mapping[str, object] | None = None,
    fsdp: bool | None = None,
    checkpoint: Sequence[str] = CHECKPOINTING,
    compile: bool | Mapping[str, object] = False,
    schedules: Sequence[str] | None = None,
    microbatches: Sequence[int] | None = None,
    methods: Sequence[str] = ("time", "memory", "parameters", "uniform"),
    max_microbatches: int = 64,
    backend: str = "gloo",
    optimizer_copies: int = 2,
    prices: Prices | str | os.PathLike[str] | None = None,
    repeats: int = 3,
    threads: int | None = None,
    device: str | torch.device | None = None,
    reuse_memory: bool = True,
    allocator: bool = True,
    progress: Callable[[int, int, int], None] | None = None,
    workers: int | None = None,
) -> TuneResult:
    """Price every way to lay ``model`` out on ``world_size`` ranks; see the module docstring.

    ``sample``: the batch a step trains on. When the planner chooses the data-parallel size (``data_parallel=None``)
    it is the whole step's, shared out among each layout's replicas; with ``data_parallel=`` fixed it is one
    replica's (as each rank of the engine is given it). ``target``: its targets: with them ``loss_fn`` is measured as
    part of the last layer (its time, and what it saves for backward); without them it is left out.
    ``data_parallel``, ``tensor_parallel``, ``fsdp``: fixed where given, else searched (tensor_parallel > 1 only with
    ``tp_plan``, the engine's). ``checkpoint``: the engine's checkpoint options to try. ``prices``: the machine's
    (pipeengine.planner.calibration.Prices, or the path of a calibration file; default: this machine's file, else
    the built-in constants). ``backend``: the transport that will run it: "gloo" posts every recv of a step at its
    start and frees a send's buffer once posted, "nccl" runs the program as lowered and holds a send's buffer until
    it completes, "loopback" (in-process ranks, which cannot host tensor parallelism or FSDP) as lowered with
    gloo's buffered sends. ``threads``: torch threads while timing the layers (default: the cores shared out among the
    world's ranks on one machine, as launch() does). ``reuse_memory``: on CPU, time the layers with glibc keeping freed
    memory, as launch()'s ranks run by default (pipeengine.launch.keep_freed_memory). ``allocator``: watch each
    layer's computes with the allocator (pipeengine.planner.transients), so that a candidate's peak counts what the
    allocator sees, not only what the step keeps between computes: ``memory_limit`` guards that figure.
    ``progress(done, layers, sizes)``: called as the layers are measured, with done=0 first, then after each layer
    at each micro-batch size and degree (of layers x sizes); ``progress_printer()`` writes it to stderr.
    ``workers``: the processes that price the candidates (pipeengine.planner.pricing; default: this machine's
    processors, where there are enough candidates and the platform forks).
    """
    _check_problem(model, sample, target)
    _check_options(
        world_size,
        data_parallel,
        tensor_parallel,
        tp_plan,
        fsdp,
        checkpoint,
        max_microbatches,
        repeats,
        microbatches,
        memory_limit,
    )
    rates = prices if isinstance(prices, Prices) else calibration.load(prices)
    if rates.world_size is not None and rates.world_size != world_size:
        warnings.warn(
            f"tune for {world_size} ranks at prices measured on {rates.world_size} ({rates.source}): how many ranks "
            f"share this machine's processors and what a collective over {world_size} costs were not measured; run "
            f"python -m pipeengine.tune --calibrate --world-size {world_size}",
            stacklevel=2,
        )
    transport = backend_named(backend)  # its program, and whether a sent buffer is free once posted (buffered)
    buffered = transport.semantics is Semantics.BUFFERED
    names = list(schedules or SCHEDULES)
    for name in names:
        registration(name)  # an unknown name fails here, with the valid ones
    batch = unpack(sample)[0].shape[0]
    refused: dict[str, str] = {}
    found = layouts(model, world_size, batch, data_parallel, tensor_parallel, tp_plan, fsdp, backend, refused)
    if not found:
        reasons = "; ".join(f"{layout}: {why}" for layout, why in refused.items()) or (
            f"data_parallel={data_parallel} and tensor_parallel={tensor_parallel} leave no pipeline size: their "
            f"product must divide world_size={world_size}"
        )
        raise ValueError(f"no layout of {world_size} ranks can run this model: {reasons}")
    per_replica = {dp: batch if data_parallel is not None else batch // dp for dp, _, _ in found}
    counts = {
        dp: sorted(m for m in (microbatches or range(1, min(rows, max_microbatches) + 1)) if rows % m == 0)
        for dp, rows in per_replica.items()
    }
    if not any(counts.values()):
        raise ValueError(
            f"no micro-batch count in {list(microbatches or [])} divides a replica's batch "
            f"({sorted(set(per_replica.values()))} rows)"
        )

    started = time.perf_counter()
    where = torch.device(device) if device is not None else torch.device("cpu")
    if where.type == "cpu" and reuse_memory:
        keep_freed_memory()
    measuring = {
        "repeats": repeats,
        "device": where,
        "threads": threads or max(1, (os.cpu_count() or 1) // world_size),
        "loss": loss_fn,
        "target": target,
        "allocator": allocator,
        "compile": compile,
        "tp_plan": tp_plan,
    }
    # a layout of one pipeline rank runs every layer back to back: on the CPU, its layers timed with the host path warm
    wanted = sorted(
        {(per_replica[dp] // m, tp, where.type == "cpu" and pp == 1) for dp, pp, tp in found for m in counts[dp]}
    )
    profiles, failed = measure_layouts(model, sample, wanted, measuring, progress)
    for layout in [x for x in found if x[2] in failed]:  # a plan this degree cannot split equally: refused
        refused[named(layout)] = failed[layout[2]]
        found.remove(layout)
    measured = time.perf_counter() - started

    started = time.perf_counter()
    specs = candidate_specs(
        model, found, fsdp, names, counts, per_replica, profiles, methods, checkpoint, transport, refused, tp_plan
    )
    priced = in_parallel(len(specs), lambda i: price(specs[i][0], rates, optimizer_copies, buffered), workers)
    candidates = [
        dataclasses.replace(candidate, step_time=step, bubble=bubble, peak_memory=peaks)
        for (_, candidate), (step, bubble, peaks) in zip(specs, priced, strict=True)
    ]
    if not candidates:
        why = "; ".join(f"{layout}: {reason}" for layout, reason in refused.items())
        raise ValueError(
            f"no candidate: {why}; allow more micro-batch counts (a batch with more divisors), other schedules, or "
            "another layout"
        )
    candidates.sort(key=lambda c: (c.step_time, max(c.peak_memory)))
    kept = [c for c in candidates if c.fits(memory_limit)]
    dropped = [c for c in candidates if not c.fits(memory_limit)]
    return TuneResult(kept, dropped, memory_limit, time.perf_counter() - started, measured, rates.source, refused)


def _check_options(
    world_size: int,
    data_parallel: int | None,
    tensor_parallel: int | None,
    tp_plan: object,
    fsdp: bool | None,
    checkpoint: Sequence[str],
    max_microbatches: int,
    repeats: int,
    microbatches: Sequence[int] | None,
    memory_limit: float | None,
) -> None:
    """tune's options refused before anything is measured, each naming the rule and the value."""
    for label, value in (
        ("world_size", world_size),
        ("data_parallel", 1 if data_parallel is None else data_parallel),
        ("tensor_parallel", 1 if tensor_parallel is None else tensor_parallel),
        ("max_microbatches", max_microbatches),
        ("repeats", repeats),
        *(("each of microbatches", m) for m in microbatches or ()),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    if fsdp and data_parallel is not None and data_parallel < 2:
        raise ValueError(
            f"fsdp=True shards the state over the data-parallel replicas, but data_parallel="
            f"{data_parallel}: pass data_parallel=2 (or more), or leave fsdp out"
        )
    if (tensor_parallel or 1) > 1 and tp_plan is None:
        raise ValueError(f"tensor_parallel={tensor_parallel} needs tp_plan= (the engine's) to shard the layers by")
    for option in checkpoint:
        if option not in CHECKPOINTING:
            raise ValueError(f"checkpoint options are {', '.join(CHECKPOINTING)}, got {option!r}")
    check_memory_limit(memory_limit)


def _check_problem(model: object, sample: object, target: object) -> None:
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"tune plans an nn.Sequential (the model PipelineEngine cuts into stages), got {type(model).__name__}; "
            "write the model as nn.Sequential(layer, layer, ...)"
        )
    for label, value in (("sample", sample), ("target", target)):
        if label == "target" and value is None:
            continue
        if not (
            isinstance(value, torch.Tensor)
            or (isinstance(value, tuple) and value and all(isinstance(t, torch.Tensor) for t in value))
        ):
            raise TypeError(
                f"{label} must be a batch: a tensor or a tuple of tensors (not a list), got {type(value).__name__}"
            )
        if unpack(value)[0].dim() == 0:
            raise ValueError(f"{label} needs a batch dimension, got a 0-d tensor")


def choose(
    config: EngineConfig,
    model: nn.Sequential,
    loss_fn: Callable[..., torch.Tensor],
    sample: object,
    world: Transport,
    engine: Callable[..., object],
) -> tuple[EngineConfig, Candidate]:
    """schedule="auto": world rank 0 (the first stage's rank) tunes on its sample, for the layout the config fixes
    (dp, tp, fsdp), at this machine's prices: where none were kept and the ranks are processes of one default
    process group, every rank measures them first (calibration.calibrate) and rank 0 keeps them. Every rank gets
    rank 0's choice. ``engine``: the engine class being built, which calibration times."""
    prices = _live_prices(world, engine)
    choice: Candidate | None = None
    failure = ""
    if world.rank == 0:
        try:
            if sample is None:
                raise ValueError("schedule='auto' needs sample= (an input batch) on the first stage's rank to tune on")
            result = tune(
                model,
                loss_fn,
                sample,  # type: ignore[arg-type]
                world.size,
                data_parallel=config.data_parallel,
                tensor_parallel=config.tensor_parallel,
                tp_plan=config.tp_plan,
                fsdp=config.fsdp,
                checkpoint=[config.checkpoint],
                compile=config.compile,
                prices=prices,
                microbatches=[config.num_microbatches] if config.num_microbatches else None,
                memory_limit=config.memory_limit,
                backend=world.name,
                device=config.device,
            )
            choice = result.best
        except Exception as error:  # noqa: BLE001  (every rank must hear of it)
            failure = f"{type(error).__name__}: {error}"
    (choice, failure), *_ = world.all_gather_object((choice, failure), "the tuned schedule from rank 0")
    if choice is None:
        raise ValueError(f"schedule='auto' could not tune on rank 0: {failure}")
    chosen = dataclasses.replace(
        config,
        schedule=choice.schedule,
        num_microbatches=choice.num_microbatches,
        chunks=choice.chunks,
        partition=choice.partition,
        memory_limit=None,
    )  # spent: the choice fits under it (a limit beside a
    # named schedule is refused as unread)
    return chosen, choice


def _live_prices(world: Transport, engine: Callable[..., object]) -> Prices | None:
    """The kept prices, or (none kept, every rank a process of the default group) measured now by every rank and
    kept by rank 0; None: the built-in constants (in-process ranks, or a group of the user's)."""
    import torch.distributed as dist

    kept = calibration.default_path().exists()
    processes = world.name != "loopback" and dist.is_initialized() and world.size == dist.get_world_size() > 1
    if not all(world.all_gather_object(kept or not processes, "whether this machine's prices are kept")):
        if world.rank == 0:
            print(
                f"schedule='auto': no prices kept for this machine ({calibration.default_path()}): measuring them on "
                f"the {world.size} ranks first (about 20 s for 4 CPU ranks), once",
                file=sys.stderr,
                flush=True,
            )
        prices = calibration.calibrate(engine)
        if world.rank == 0:
            calibration.save(prices, backend=world.name, world_size=world.size)
        return prices
    return None
