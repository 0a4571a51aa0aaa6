"""tune: choose the layout (dp x pp x tp, FSDP), schedule, split size, chunks, partition and checkpointing before
launching, under a memory limit, priced on this machine's measured links.

    result = tune(model, loss_fn, sample, world_size=4, tp_plan=plan, memory_limit=2 * 2**30)
    print(result)                                                # every candidate, fastest first
    engine = PipelineEngine(model, loss_fn, **result.best.engine_kwargs())

Each layer is measured once per micro-batch size and tensor-parallel degree on ``sample``
(pipeengine.planner.measure: under tensor parallelism, the shard a rank runs and the collectives it runs; on the
CPU, for the layouts of one pipeline rank, also with the host path warm, as a rank running every layer meets it). Then
every candidate is priced by the simulator, time and bytes, without running it: each factorisation of the world
into dp x pp x tp (tp only with a tp_plan whose splits it divides), FSDP on and off (dp > 1), each registered
schedule, each micro-batch count that divides a replica's batch, each chunk count the schedule runs, the exact
min-max partition by time, by memory, by parameters and uniform, and each checkpoint choice. Its price
(pipeengine.planner.costmodel) holds the layers' computes, the host cost per compute and per post, the messages
between stages, tensor parallelism's collectives inside the computes, the replicas' all-reduce (or FSDP's
reduce-scatter) after each stage's last backward and FSDP's all-gather before its first forward, and the step's
frame around its program (the header and the loss shared), at the machine's prices
(pipeengine.planner.calibration: measured by ``python -m pipeengine.tune --calibrate``, else built-in constants,
and the result says which), on this machine's processors (pipeengine.planner.pricing). Candidates whose peak
passes ``memory_limit`` on any rank are dropped; the result says how many and what the limit cost, and why each
layout it could not build was refused.
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
from pipeengine.construction.layercosts import LayerCosts
from pipeengine.construction.partition import cut_points, method_costs, solve
from pipeengine.core.config import CHECKPOINTING, EngineConfig, check_memory_limit
from pipeengine.core.specs import Tensors, unpack
from pipeengine.launcher.launch import keep_freed_memory
from pipeengine.parallel import checked_ties
from pipeengine.planner import calibration
from pipeengine.planner.calibration import Prices
from pipeengine.planner.costmodel import LayerProfile
from pipeengine.planner.measure import measure_layouts
from pipeengine.planner.pricing import Spec, in_parallel, price
from pipeengine.planner.result import Candidate, TuneResult
from schedules import SCHEDULES, Schedule, Semantics, build_schedule, registration, with_gradient_sync

__all__ = ["Candidate", "TuneResult", "choose", "layouts", "tune"]

Layout = tuple[int, int, int]  # (dp, pp, tp)


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
    _check_options(world_size, data_parallel, tensor_parallel, tp_plan, fsdp, checkpoint, max_microbatches, repeats,
                   microbatches, memory_limit)  # fmt: skip
    rates = prices if isinstance(prices, Prices) else calibration.load(prices)
    if rates.world_size is not None and rates.world_size != world_size:
        warnings.warn(
            f"tune for {world_size} ranks at prices measured on {rates.world_size} ({rates.source}): how many ranks "
            f"share this machine's processors and what a collective over {world_size} costs were not measured; run "
            f"python -m pipeengine.tune --calibrate --world-size {world_size}", stacklevel=2)  # fmt: skip
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
            f"product must divide world_size={world_size}")  # fmt: skip
        raise ValueError(f"no layout of {world_size} ranks can run this model: {reasons}")
    per_replica = {dp: batch if data_parallel is not None else batch // dp for dp, _, _ in found}
    counts = {dp: sorted(m for m in (microbatches or range(1, min(rows, max_microbatches) + 1)) if rows % m == 0)
              for dp, rows in per_replica.items()}  # fmt: skip
    if not any(counts.values()):
        raise ValueError(f"no micro-batch count in {list(microbatches or [])} divides a replica's batch "
                         f"({sorted(set(per_replica.values()))} rows)")  # fmt: skip

    started = time.perf_counter()
    where = torch.device(device) if device is not None else torch.device("cpu")
    if where.type == "cpu" and reuse_memory:
        keep_freed_memory()
    measuring = {"repeats": repeats, "device": where, "threads": threads or max(1, (os.cpu_count() or 1) // world_size),
                 "loss": loss_fn, "target": target, "allocator": allocator, "compile": compile, "tp_plan": tp_plan}
    # a layout of one pipeline rank runs every layer back to back: on the CPU, its layers timed with the host path warm
    wanted = sorted({(per_replica[dp] // m, tp, where.type == "cpu" and pp == 1) for dp, pp, tp in found
                     for m in counts[dp]})  # fmt: skip
    profiles, failed = measure_layouts(model, sample, wanted, measuring, progress)
    for layout in [x for x in found if x[2] in failed]:  # a plan this degree cannot split equally: refused
        refused[_named(layout)] = failed[layout[2]]
        found.remove(layout)
    measured = time.perf_counter() - started

    started = time.perf_counter()
    specs = _specs(model, found, fsdp, names, counts, per_replica, profiles, methods, checkpoint, transport, refused,
                   tp_plan)  # fmt: skip
    priced = in_parallel(len(specs), lambda i: price(specs[i][0], rates, optimizer_copies, buffered), workers)
    candidates = [dataclasses.replace(candidate, step_time=step, bubble=bubble, peak_memory=peaks)
                  for (_, candidate), (step, bubble, peaks) in zip(specs, priced, strict=True)]  # fmt: skip
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


def _check_options(world_size: int, data_parallel: int | None, tensor_parallel: int | None, tp_plan: object,
                   fsdp: bool | None, checkpoint: Sequence[str], max_microbatches: int, repeats: int,
                   microbatches: Sequence[int] | None, memory_limit: float | None) -> None:  # fmt: skip
    """tune's options refused before anything is measured, each naming the rule and the value."""
    for label, value in (("world_size", world_size), ("data_parallel", 1 if data_parallel is None else data_parallel),
                         ("tensor_parallel", 1 if tensor_parallel is None else tensor_parallel),
                         ("max_microbatches", max_microbatches),
                         ("repeats", repeats), *(("each of microbatches", m) for m in microbatches or ())):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    if fsdp and data_parallel is not None and data_parallel < 2:
        raise ValueError(f"fsdp=True shards the state over the data-parallel replicas, but data_parallel="
                         f"{data_parallel}: pass data_parallel=2 (or more), or leave fsdp out")  # fmt: skip
    if (tensor_parallel or 1) > 1 and tp_plan is None:
        raise ValueError(f"tensor_parallel={tensor_parallel} needs tp_plan= (the engine's) to shard the layers by")
    for option in checkpoint:
        if option not in CHECKPOINTING:
            raise ValueError(f"checkpoint options are {', '.join(CHECKPOINTING)}, got {option!r}")
    check_memory_limit(memory_limit)


def _specs(model: nn.Sequential, found: list[Layout], fsdp: bool | None, names: list[str], counts: dict[int, list[int]],
           per_replica: dict[int, int], profiles: dict[tuple[int, int, bool], LayerProfile], methods: Sequence[str],
           checkpoint: Sequence[str], transport: object, refused: dict[str, str], tp_plan: object
           ) -> list[tuple[Spec, Candidate]]:  # fmt: skip
    """Each candidate of every layout to price, and what it is (the programs, cuts and engine checks shared among
    the layouts that can share them)."""
    specs: list[tuple[Spec, Candidate]] = []
    programs: dict[tuple[str, int, int, int, bool], Schedule | str] = {}  # shared by the layouts of one pipeline size
    cuts: dict[tuple[int, int, bool, str, int], list[tuple[int, int]]] = {}  # (rows, tp, alone, method, stages)
    checked: dict[tuple[object, ...], str] = {}  # (bounds, placement, fsdp) -> why the engine refuses it ("": builds)
    for layout in found:
        dp, pp, tp = layout
        for sharded in ([fsdp] if fsdp is not None else [False, True]) if dp > 1 else [False]:
            specs += _layout_candidates(
                model, layout, sharded, names, counts[dp], per_replica[dp], profiles, methods, checkpoint,
                transport, refused, programs, cuts, checked, tp_plan)  # fmt: skip
    return specs


def layouts(model: nn.Sequential, world_size: int, batch: int, data_parallel: int | None = None,
            tensor_parallel: int | None = None, tp_plan: object = None, fsdp: bool | None = None,
            backend: str = "gloo", refused: dict[str, str] | None = None) -> list[Layout]:  # fmt: skip
    """Every (dp, pp, tp) with dp x pp x tp = world_size the engine can build for this model; each other
    factorisation is in ``refused`` with the reason."""
    refused = refused if refused is not None else {}
    found = []
    for dp in [d for d in range(1, world_size + 1) if world_size % d == 0]:
        for tp in [t for t in range(1, world_size // dp + 1) if (world_size // dp) % t == 0]:
            layout = (dp, world_size // (dp * tp), tp)
            why = _illegal(model, layout, batch, data_parallel, tensor_parallel, tp_plan, fsdp, backend)
            if why is None:
                found.append(layout)
            elif why:  # "" : not asked for
                refused[_named(layout)] = why
    return found


def _illegal(model: nn.Sequential, layout: Layout, batch: int, data_parallel: int | None,
             tensor_parallel: int | None, tp_plan: object, fsdp: bool | None, backend: str) -> str | None:  # fmt: skip
    dp, pp, tp = layout
    if (data_parallel is not None and dp != data_parallel) or (tensor_parallel is not None and tp != tensor_parallel):
        return ""
    if tp > 1 and tp_plan is None:
        return ""  # not asked for: tensor parallelism only with a plan
    if tp > 1 and backend == "loopback":
        return "tensor parallelism runs DTensor collectives, which in-process ranks cannot host"
    if fsdp and dp == 1:
        return "fsdp=True needs data_parallel > 1 replicas to shard over"
    if fsdp and backend == "loopback":
        return "FSDP runs DTensor collectives, which in-process ranks cannot host"
    if pp > len(model):
        return (f"{pp} pipeline stages need at least {pp} layers, one per stage; the model has {len(model)}: use at "
                f"most {len(model)} pipeline ranks (more replicas), or split the model into more nn.Sequential layers")
    if data_parallel is None and batch % dp:
        return f"the batch of {batch} rows does not split equally into {dp} replicas"
    return None


def _layout_candidates(
    model: nn.Sequential, layout: Layout, sharded: bool, names: Sequence[str], counts: Sequence[int], rows: int,
    profiles: Mapping[tuple[int, int, bool], LayerProfile], methods: Sequence[str], checkpoint: Sequence[str],
    transport: object, refused: dict[str, str], programs: dict[tuple[str, int, int, int, bool], Schedule | str],
    cuts: dict[tuple[int, int, bool, str, int], list[tuple[int, int]]], checked: dict[tuple[object, ...], str],
    tp_plan: object,
) -> list[tuple[Spec, Candidate]]:  # fmt: skip
    """Every candidate of one layout (schedule, chunks, micro-batches, partition and checkpointing), to be priced:
    what it is priced from, and the candidate (unpriced). ``programs``: each program as the transport runs it (with
    the replicas' ARs), or why it cannot be built; ``cuts``: each partition by (rows, tp, one pipeline rank, method,
    stages); ``checked``: why the engine refuses each cut on its placement (_refusal); all kept across layouts and
    FSDP on and off. A cut the engine would refuse is no candidate."""
    dp, ranks, tp = layout
    layers = len(model)
    seen: dict[tuple[object, ...], int] = {}
    found: list[tuple[Spec, Candidate]] = []
    why: dict[str, str] = {}  # schedule -> why it gave this layout nothing
    for name in names:
        record = registration(name)
        for chunks in record.chunks or tuple(v for v in (2, 3, 4) if ranks * v <= layers):
            stages = ranks * chunks
            if stages > layers:
                continue
            for m in counts:
                program = programs.get((name, ranks, m, chunks, dp > 1))
                if program is None:
                    program = programs[name, ranks, m, chunks, dp > 1] = _program(transport, name, ranks, m, chunks,
                                                                                   dp > 1)  # fmt: skip
                if isinstance(program, str):  # m does not suit this schedule (interleaved: a multiple of p)
                    why[name] = program
                    continue
                profile = profiles.get((rows // m, tp, True)) if ranks == 1 else None  # warm, on the CPU
                profile = profile or profiles.get((rows // m, tp, False))
                if profile is None:
                    continue
                joined = profile.shards_output[:-1]  # no stage ends on a tensor-parallel shard
                most = len(cut_points(layers, joined))
                if stages > most:
                    why[name] = (f"{stages} stages, but with tp={tp} the tp_plan lets the model be cut into {most} at "
                                 "most (a stage cannot end on a layer whose output is a shard)")  # fmt: skip
                    continue
                for method in methods:
                    bounds = cuts.get((rows // m, tp, ranks == 1, method, stages))
                    if bounds is None:
                        bounds = cuts[rows // m, tp, ranks == 1, method, stages] = solve(
                            method_costs(method, LayerCosts.of(profile, model)), stages, joined)  # fmt: skip
                    refusal = _refusal(model, bounds, program.placement, sharded, checked)
                    if refusal:  # the engine would refuse to build it
                        why[name] = refusal
                        continue
                    partition = tuple(b - a for a, b in bounds)
                    for option in checkpoint:
                        if option == "except_last" and stages == 1:
                            continue  # the same as never
                        key = (name, m, chunks, partition, option)
                        if key in seen:  # another method cut it the same way
                            spec, old = found[seen[key]]
                            found[seen[key]] = (spec, dataclasses.replace(old, methods=(*old.methods, method)))
                            continue
                        seen[key] = len(found)
                        found.append((Spec(program, profile, bounds, dp, sharded, option),
                                      Candidate(name, m, chunks, (method,), partition, 0.0, 0.0, (), dp, sharded, tp,
                                                option, tp_plan if tp > 1 else None)))  # type: ignore[arg-type]  # fmt: skip
    if not found:
        refused[_named(layout, sharded)] = (
            f"this layout builds with no schedule of {list(names)} (m in {list(counts)}, {ranks} pipeline "
            f"rank{'s' if ranks != 1 else ''}, {layers} layers)" + "".join(f"; {name}: {reason}" for name, reason
                                                                          in why.items()))  # fmt: skip
    return found


def _refusal(model: nn.Sequential, bounds: Sequence[tuple[int, int]], placement: Sequence[int], sharded: bool,
             checked: dict[tuple[object, ...], str]) -> str:  # fmt: skip
    """Why the engine would refuse to build this cut on this placement ("": it builds), by the engine's own rule
    (pipeengine.parallel.checked_ties), asked once per cut: ``checked`` keeps each answer."""
    key = (tuple(bounds), tuple(placement), sharded)
    if key not in checked:
        try:
            checked_ties(model, bounds, placement, sharded)
            checked[key] = ""
        except ValueError as error:
            checked[key] = str(error)
    return checked[key]


def _program(transport: object, name: str, ranks: int, m: int, chunks: int, synced: bool) -> Schedule | str:
    """The schedule as the transport runs it, with each stage's AR where there are replicas; or why it cannot be
    built."""
    try:
        schedule = build_schedule(name, ranks, m, chunks)
    except ValueError as error:
        return str(error)
    program = transport.program(schedule)  # type: ignore[attr-defined]
    return with_gradient_sync(program) if synced else program


def _named(layout: Layout, fsdp: bool = False) -> str:
    dp, pp, tp = layout
    return f"dp{dp} x pp{pp} x tp{tp}" + (" fsdp" if fsdp else "")


def _check_problem(model: object, sample: object, target: object) -> None:
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"tune plans an nn.Sequential (the model PipelineEngine cuts into stages), got {type(model).__name__}; "
            "write the model as nn.Sequential(layer, layer, ...)"
        )
    for label, value in (("sample", sample), ("target", target)):
        if label == "target" and value is None:
            continue
        if not (isinstance(value, torch.Tensor) or (isinstance(value, tuple) and value
                                                     and all(isinstance(t, torch.Tensor) for t in value))):  # fmt: skip
            raise TypeError(
                f"{label} must be a batch: a tensor or a tuple of tensors (not a list), got {type(value).__name__}"
            )
        if unpack(value)[0].dim() == 0:
            raise ValueError(f"{label} needs a batch dimension, got a 0-d tensor")


def choose(
    config: EngineConfig, model: nn.Sequential, loss_fn: Callable[..., torch.Tensor], sample: object,
    world: Transport, engine: Callable[..., object],
) -> tuple[EngineConfig, Candidate]:  # fmt: skip
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
            result = tune(model, loss_fn, sample, world.size, data_parallel=config.data_parallel,  # type: ignore[arg-type]
                          tensor_parallel=config.tensor_parallel, tp_plan=config.tp_plan, fsdp=config.fsdp,
                          checkpoint=[config.checkpoint], compile=config.compile, prices=prices,
                          microbatches=[config.num_microbatches] if config.num_microbatches else None,
                          memory_limit=config.memory_limit, backend=world.name, device=config.device)  # fmt: skip
            choice = result.best
        except Exception as error:  # noqa: BLE001  (every rank must hear of it)
            failure = f"{type(error).__name__}: {error}"
    (choice, failure), *_ = world.all_gather_object((choice, failure), "the tuned schedule from rank 0")
    if choice is None:
        raise ValueError(f"schedule='auto' could not tune on rank 0: {failure}")
    chosen = dataclasses.replace(config, schedule=choice.schedule, num_microbatches=choice.num_microbatches,
                                 chunks=choice.chunks, partition=choice.partition,
                                 memory_limit=None)  # fmt: skip  # spent: the choice fits under it (a limit beside a
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
            print(f"schedule='auto': no prices kept for this machine ({calibration.default_path()}): measuring them on "
                  f"the {world.size} ranks first (about 20 s for 4 CPU ranks), once", file=sys.stderr, flush=True)
        prices = calibration.calibrate(engine)
        if world.rank == 0:
            calibration.save(prices, backend=world.name, world_size=world.size)
        return prices
    return None
