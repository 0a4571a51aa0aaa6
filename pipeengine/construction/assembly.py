"""Construction: from a model, a loss and an EngineConfig, what one rank runs (its Assembly).

assemble(model, loss_fn, config, sample, world)
    topology    world -> one (dp, pp, tp) grid -> this rank's pipeline, replicas and tensor group
    schedule    compiled and lowered (or the user's, lowered if it is compute only), validated
    partition   measured on the first stage's rank, broadcast, solved alike everywhere
    ties        weights shared by stages on several ranks: a group of their holders each (core.ties)
    stages      this rank's layers, under the model's names, cut and transformed on the mesh
                (construction.transform: the parallelisms of pipeengine.parallel), with a StageWorker each
    syncs       the gradient synchronisations its AR and TR instructions start (pipeengine.parallel)
    executor    the interpreter of this rank's streams, and the program cache it runs (step.stepping.Programs)

Nothing here runs at step time: the step (pipeengine.step.stepping) is handed the executor and the programs.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipeengine.comm.base import Transport
from pipeengine.comm.topology import Topology
from pipeengine.construction.layercosts import LayerCosts
from pipeengine.construction.measure import measure
from pipeengine.construction.partition import Partition, method_costs, solve
from pipeengine.construction.transform import transform_stage
from pipeengine.core.bounds import bounds_from_counts, check_counts, stage_module
from pipeengine.core.config import METHODS, EngineConfig
from pipeengine.core.grid import Grid
from pipeengine.core.specs import Tensors, map_tensors, meta_copy, unpack
from pipeengine.core.ties import Ties
from pipeengine.parallel import checked_ties, fsdp, gradient_syncs, tensor
from pipeengine.step.backward import keep_compiled_graphs
from pipeengine.step.executor import Executor
from pipeengine.step.stage import LossFn, StageWorker
from pipeengine.step.stepping import Programs
from schedules import Kind, Schedule, build_schedule, lowered, validate, with_gradient_sync, with_tie_sync

__all__: list[str] = []


@dataclass
class Assembly:
    """What one rank runs."""

    topology: Topology
    device: torch.device
    schedule: Schedule  # lowered, with the gradient syncs (data parallelism, tied weights): engine.schedule
    partition: Partition
    ties: Ties
    stages: dict[int, nn.Module]  # this rank's stages (as transformed)
    workers: dict[int, StageWorker]
    executor: Executor
    programs: Programs
    meta_layers: list[nn.Module]  # every layer on the meta device: every rank infers every boundary
    mesh: object | None = None  # torch's DeviceMesh over the grid, where a stage transform needed one


def assemble(model: nn.Sequential, loss_fn: LossFn, config: EngineConfig, sample: object, world: Transport) -> Assembly:
    """Build what this rank runs; every rank of ``world`` calls it (it agrees on the partition)."""
    if world.alone and config.fsdp:
        raise ValueError(
            "fsdp=True cannot be dry-run: FSDP2 will not train parameters on the meta device (it wants "
            "them materialized). Dry-run the layout with fsdp=False (the same grid, partition, groups and "
            "program; each replica's state then counted whole, not 1/data_parallel of it)"
        )
    grid = Grid.of(world.size, config.data_parallel, config.tensor_parallel)
    # every pattern matches (or none runs), at a degree every style can run at
    plan = tensor.plan_matches(model, config.tp_plan, config.tensor_parallel) if config.tp_plan else {}
    mesh = tensor.device_mesh(grid, world, config.fsdp) if config.needs_mesh else None
    topology = Topology.build(grid, world, mesh)
    lowered = resolve_schedule(config.schedule, topology.pipeline_size, config.num_microbatches, config.chunks)  # type: ignore[arg-type]
    # every replica must cut the model alike: the whole world agrees when there are several
    agreeing = topology.world if world.size > topology.pipeline.size else topology.pipeline
    # no stage of the engine's own partition ends on a tensor-parallel shard (the planner's is measured so)
    joined = tensor.shards_output(model, plan)[:-1] if grid.tp > 1 else []
    partition = agree_partition(
        model, lowered, config.partition, sample, agreeing, world.device, config.compile, joined
    )
    ties = checked_ties(model, partition.bounds, lowered.placement, config.fsdp)
    lowered = dataclasses.replace(lowered, tied=ties.groups)
    schedule = with_tie_sync(with_gradient_sync(lowered) if config.data_parallel > 1 else lowered)
    num_stages = schedule.num_stages
    meta = [meta_copy(layer) for layer in model]  # before any transform: boundaries are whole tensors
    stages = {  # cut, then transformed on the mesh (the seam where tensor parallelism and sharding go)
        s: transform_stage(stage_module(model, *partition.bounds[s]).to(world.device), s, config, mesh, plan)
        for s in schedule.stages_of(topology.pp_rank)
    }
    ties = tensor.agree_on_ties(ties, stages, topology)
    partition = dataclasses.replace(partition, grid=grid, tp_rank=topology.tp_rank)
    if grid.tp > 1:  # the report shows a tensor-parallel rank's shares (every rank of the pipeline gathers them)
        names = [name for name, _ in model.named_children()]
        shards = tensor.shard_costs(partition.costs, names, partition.bounds, stages, topology.pipeline)
        partition = dataclasses.replace(partition, shards=shards)
    workers = {
        s: StageWorker(
            s,
            module,
            is_last=s == num_stages - 1,
            loss_fn=loss_fn,
            checkpointed=config.checkpointed(s, num_stages),
            precision=config.dtype,
            sharding=fsdp.sharding(module),
        )
        for s, module in stages.items()
    }
    if any(op.kind is Kind.BACKWARD_INPUT for rank in range(schedule.num_ranks) for _, op in schedule.ops(rank)):
        keep_compiled_graphs()  # W re-enters what I kept: compiled regions must allow it (step.backward)
    topology.pipeline.open_channels()
    syncs = gradient_syncs(ties, lowered, topology, stages, config.fsdp, config.reshard_after_forward)
    executor = Executor(topology.pp_rank, workers, topology.pipeline, syncs)
    programs = Programs(lowered, topology.pipeline, config.data_parallel > 1)
    return Assembly(topology, world.device, schedule, partition, ties, stages, workers, executor, programs, meta, mesh)


def agree_partition(
    model: nn.Sequential,
    schedule: Schedule,
    partition: str | Sequence[int] | None,
    sample: object,
    transport: Transport,
    device: torch.device,
    compile: bool | Mapping[str, object] = False,
    joined: Sequence[bool] = (),
) -> Partition:
    """The first stage's rank measures the layers and broadcasts the costs; every rank then solves alike, no stage
    ending on a layer ``joined`` marks (its output a tensor-parallel shard: partition.solve)."""
    counts = None if partition is None or isinstance(partition, str) else check_counts(partition, schedule.num_stages)
    m = schedule.num_microbatches
    source = 0  # group rank 0 runs the first stage (of the first replica)
    header = torch.zeros(2, dtype=torch.int64, device=transport.control_device)  # [failed, method]
    rows = torch.zeros(5, len(model), dtype=torch.float64, device=transport.control_device)
    failure: Exception | None = None
    if transport.rank == source or transport.alone:  # alone: a dry run's rank works out what the source would send
        method = partition if isinstance(partition, str) else ("time" if sample is not None else "parameters")
        if method == "time" and transport.alone:  # a dry run: layers timed on the meta device say nothing
            warnings.warn(
                "partition by time measures the layers on the device, and a dry run (pipeengine.dry_run) "
                "has none: it partitions by parameters instead; pass partition= (stage sizes, or "
                "'parameters' or 'memory') to check the layout the real run will use",
                stacklevel=2,
            )
            method = "parameters"
        try:
            micro = None if sample is None else _first_microbatch(sample, m)
            if method == "time" and micro is None:
                raise ValueError("partition='time' needs sample= (an example input batch) on the first stage's rank")
            costs = measure(model, micro, timed=counts is None and method == "time", device=device, compile=compile)
            rows = torch.tensor(costs.to_rows(), dtype=torch.float64, device=transport.control_device)
            header[1] = METHODS.index(method)
        except Exception as error:  # every rank must hear of it, or they would wait for the costs
            failure = error
            header[0] = 1
    transport.broadcast(header, source, f"the partition from rank {source}")
    if failure is not None:
        raise failure
    if header[0]:
        raise ValueError(
            f"the first stage's rank ({source}) could not measure the layers to partition them; see its error"
        )
    transport.broadcast(rows, source, f"the layer costs from rank {source}")
    costs = LayerCosts.from_rows(rows.tolist())
    if counts is not None:
        return Partition("explicit", bounds_from_counts(counts, len(model)), costs, schedule.placement)
    method = METHODS[int(header[1])]
    return Partition(method, solve(method_costs(method, costs), schedule.num_stages, joined), costs, schedule.placement)


def _first_microbatch(sample: object, num_microbatches: int) -> torch.Tensor | Tensors:
    """One micro-batch of an example input batch: its first batch // m rows (at least one)."""
    if isinstance(sample, torch.Tensor) or (
        isinstance(sample, tuple) and all(isinstance(t, torch.Tensor) for t in sample)
    ):
        rows = max(1, unpack(sample)[0].shape[0] // num_microbatches)
        return map_tensors(sample, lambda t: t[:rows])
    raise TypeError(f"sample must be a tensor or a tuple of tensors (an input batch), got {type(sample).__name__}")


def resolve_schedule(schedule: str | Schedule, world: int, num_microbatches: int, chunks: int | None) -> Schedule:
    """The lowered, validated schedule: compiled from its name, or the user's (lowered first if compute only)."""
    if isinstance(schedule, str):
        return build_schedule(schedule, world, num_microbatches, chunks)
    if schedule.num_ranks != world or schedule.num_microbatches != num_microbatches:
        raise ValueError(
            f"the schedule is for {schedule.num_ranks} ranks and {schedule.num_microbatches} micro-batches, "
            f"but the world has {world} ranks and num_microbatches={num_microbatches}"
        )
    schedule = lowered(schedule)  # a compute-only schedule (a compiler's output, a hand-written order): its messages
    validate(schedule)
    return schedule
