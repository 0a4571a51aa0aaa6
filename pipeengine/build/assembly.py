"""Construction: from a model, a loss and an EngineConfig, what one rank runs (its Assembly).

assemble(model, loss_fn, config, sample, world)
    topology    world -> one (dp, pp, tp) grid -> this rank's pipeline, replicas and tensor group
    transform   each stage cut from the model, then transformed on the mesh (parallelize=; build.transform)
    schedule    compiled and lowered (or the user's, lowered if it is compute only), validated
    partition   measured on the first stage's rank, broadcast, solved alike everywhere
    ties        weights shared by stages on several ranks: a group of their holders each (ties.py)
    stages      this rank's layers, under the model's names, with a StageWorker each
    syncs       the gradient synchronisations its AR and TR instructions start (runtime.gradsync)
    programs    per step kind and gradient-free boundaries: what the transport runs, proved
                under its semantics before the first step that needs it
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeengine.build.transform import check_shardable, device_mesh, plan_matches, retie, transform_stage
from pipeengine.comm.base import Transport
from pipeengine.comm.topology import Topology
from pipeengine.core.bounds import bounds_from_counts, check_counts, stage_module
from pipeengine.core.config import METHODS, EngineConfig
from pipeengine.core.grid import Grid
from pipeengine.core.specs import Tensors, map_tensors, meta_copy, unpack
from pipeengine.core.ties import Ties, find_ties
from pipeengine.planner.partition import Partition, method_costs, solve
from pipeengine.planner.profiler import LayerCosts, measure
from pipeengine.runtime.backward import keep_compiled_graphs
from pipeengine.runtime.executor import Executor
from pipeengine.runtime.gradsync import GradientSync, ReplicaMean, ShardedReduce, TieGroup, TieSum
from pipeengine.runtime.stage import LossFn, StageWorker
from schedules import (
    Kind,
    Schedule,
    build_schedule,
    forward_only,
    lower,
    lowered,
    tie_ranks,
    validate,
    with_gradient_sync,
    with_tie_sync,
)

__all__: list[str] = []


@dataclass
class Programs:
    """The streams a rank's transport runs, made and validated once per kind of step."""

    schedule: Schedule  # lowered, without gradient sync
    transport: Transport
    sync: bool  # add the data-parallel gradient all-reduces
    _made: dict[tuple[bool, frozenset[int]], Schedule] = field(default_factory=dict)

    def get(self, train: bool, no_gradient: frozenset[int] = frozenset()) -> Schedule:
        """The program of a training step whose ``no_gradient`` boundaries need no gradient, or of an eval step."""
        key = (train, no_gradient if train else frozenset())
        program = self._made.get(key)
        if program is None:
            declared = sorted(self.schedule.no_gradient - no_gradient) if train else []
            if declared:  # the schedule says no gradient crosses where one must: a stage would silently not train
                b = declared[0]
                raise ValueError(
                    f"the schedule says boundary {b} (between stages {b} and {b + 1}) carries no gradient (its "
                    f"no_gradient, a 'no-gradient' line in a schedule file), but stage {b + 1}'s input needs one: "
                    f"stages up to {b} would never get a gradient. Remove boundary {b} from it, or freeze those stages "
                    "(requires_grad=False before building the engine): gradient-free boundaries are inferred"
                )
            if not train:
                base = forward_only(self.schedule)
            else:
                base = lower(self.schedule.without_gradient(no_gradient)) if no_gradient else self.schedule
                base = with_tie_sync(with_gradient_sync(base) if self.sync else base)
            program = self.transport.program(base)
            validate(program, self.transport.semantics)  # the streams that will run, under their transport's rules
            self._made[key] = program
        return program


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
    grid = Grid.of(world.size, config.data_parallel, config.tensor_parallel)
    # every pattern matches (or none runs), at a degree every style can run at
    plan = plan_matches(model, config.tp_plan, config.tensor_parallel) if config.tp_plan else {}
    mesh = device_mesh(grid, world, config.fsdp) if config.needs_mesh else None
    topology = Topology.build(grid, world, mesh)
    lowered = resolve_schedule(config.schedule, topology.pipeline_size, config.num_microbatches, config.chunks)  # type: ignore[arg-type]
    # every replica must cut the model alike: the whole world agrees when there are several
    agreeing = topology.world if world.size > topology.pipeline.size else topology.pipeline
    partition = agree_partition(model, lowered, config.partition, sample, agreeing, world.device, config.compile)
    ties = find_ties(model, partition.bounds, lowered.placement)
    if config.fsdp:
        check_shardable(model)
        refuse_shared_units(ties, lowered.placement)
    lowered = dataclasses.replace(lowered, tied=ties.groups)
    schedule = with_tie_sync(with_gradient_sync(lowered) if config.data_parallel > 1 else lowered)
    num_stages = schedule.num_stages
    meta = [meta_copy(layer) for layer in model]  # before any transform: boundaries are whole tensors
    stages = {  # cut, then transformed on the mesh (the seam where tensor parallelism and sharding go)
        s: transform_stage(stage_module(model, *partition.bounds[s]).to(world.device), s, config, mesh, plan)
        for s in schedule.stages_of(topology.pp_rank)
    }
    ties = agree_on_ties(ties, stages, topology)
    workers = {
        s: StageWorker(s, module, is_last=s == num_stages - 1, loss_fn=loss_fn,
                       checkpointed=config.checkpointed(s, num_stages), precision=config.dtype)
        for s, module in stages.items()
    }  # fmt: skip
    if any(op.kind is Kind.BACKWARD_INPUT for rank in range(schedule.num_ranks) for _, op in schedule.ops(rank)):
        keep_compiled_graphs()  # W re-enters what I kept: compiled regions must allow it (runtime.backward)
    topology.pipeline.open_channels()
    syncs = gradient_syncs(ties, lowered, topology, workers, config.fsdp, config.reshard_after_forward)
    executor = Executor(topology.pp_rank, workers, topology.pipeline, syncs)
    programs = Programs(lowered, topology.pipeline, config.data_parallel > 1)
    return Assembly(topology, world.device, schedule, partition, ties, stages, workers, executor, programs, meta,
                    mesh)


def agree_on_ties(ties: Ties, stages: dict[int, nn.Module], topology: Topology) -> Ties:
    """The ties after the transform (build.transform.retie): one placement per tied weight on every rank that
    holds it, or every rank refuses naming it."""
    ties, placements = retie(ties, stages)
    if ties.owners:  # every rank knows the ties alike: all or none meet here
        seen: dict[str, set[str]] = {}
        for mine in topology.world.all_gather_object(placements, "the placements of the tied weights"):
            for name, wheres in mine.items():
                seen.setdefault(name, set()).update(wheres)
        split = {name: sorted(wheres) for name, wheres in seen.items() if len(wheres) > 1}
        if split:
            name, wheres = next(iter(split.items()))
            raise ValueError(
                f"the weight tied as {name!r} (with {[a for a, b in ties.aliases.items() if b == name]}) was "
                f"parallelized differently on the ranks that hold it: {wheres}; a tied weight must have one placement "
                "in every layer that holds it (e.g. RowwiseParallel on the embedding and ColwiseParallel on the head "
                "both shard it on dim 0), or none"
            )
    return ties


def refuse_shared_units(ties: Ties, placement: Sequence[int]) -> None:
    """fsdp=True: FSDP2 shards a parameter within one root; a weight two stages of one rank share would be two."""
    for group, stages in enumerate(ties.groups):
        ranks = [placement[s] for s in stages]
        shared = sorted({r for r in ranks if ranks.count(r) > 1})
        if shared:
            raise ValueError(
                f"fsdp=True: the weight tied as {list(ties.members[group])} is used by stages "
                f"{[s for s in stages if placement[s] == shared[0]]}, both on pipeline rank {shared[0]}; FSDP2 shards "
                "each stage on its own (one fully_shard root per stage) and cannot shard one parameter in two. Use a "
                "schedule that places those stages on different ranks (e.g. '1f1b', 'interleaved'), or fsdp=False"
            )


def gradient_syncs(
    ties: Ties, schedule: Schedule, topology: Topology, workers: dict[int, StageWorker], fsdp: bool = False,
    reshard_after_forward: bool = False,
) -> dict[Kind, GradientSync]:
    """What this rank's AR and TR instructions start: the replicas' mean (FSDP2's reduce-scatter with fsdp), and
    the tied weights' sum; finished in this order (AR, then TR: with FSDP the tie sum adds reduced shards)."""
    syncs: dict[Kind, GradientSync] = {}
    tied = TieSum(tie_groups(ties, schedule, topology, {s: w.module for s, w in workers.items()}, fsdp),
                  after_shards=fsdp)  # fmt: skip
    if topology.data is not None and fsdp:
        syncs[Kind.ALL_REDUCE] = ShardedReduce({s: w.module for s, w in workers.items()}, topology.data.size,
                                               sum_only=topology.world.device.type != "cuda",
                                               reshard_after_forward=reshard_after_forward)
    elif topology.data is not None:
        syncs[Kind.ALL_REDUCE] = ReplicaMean(topology.data, workers, exclude=tied.params)
    if tied.groups:
        syncs[Kind.TIE_REDUCE] = tied
    return syncs


def tie_groups(
    ties: Ties, schedule: Schedule, topology: Topology, stages: dict[int, nn.Module], fsdp: bool = False
) -> dict[int, TieGroup]:
    """Per tie group that spans ranks and that this rank holds: the group of its holders in every replica (and of
    this tensor-parallel index), taken from the grid; every rank makes every group, in one order. With fsdp each
    replica holds its own shard: one group per replica, and nothing to average (the reduce-scatter did)."""
    mine = {ties.names[id(p)]: p for module in stages.values() for p in module.parameters()}
    grid, groups = topology.grid, {}
    replicas = [[d] for d in range(grid.dp)] if fsdp else [None]
    for group in ties.spanning(schedule.placement):
        for dp in replicas:
            for t in range(grid.tp):
                transport = topology.subgroup(grid.select(dp=dp, pp=tie_ranks(schedule, group), tp=[t]))
                if transport is not None:
                    params = [mine[name] for name in ties.members[group]]
                    groups[group] = TieGroup(transport, params, 1 if fsdp else grid.dp)
    return groups


def agree_partition(
    model: nn.Sequential,
    schedule: Schedule,
    partition: str | Sequence[int] | None,
    sample: object,
    transport: Transport,
    device: torch.device,
    compile: bool | Mapping[str, object] = False,
) -> Partition:
    """The first stage's rank measures the layers and broadcasts the costs; every rank then solves alike."""
    counts = None if partition is None or isinstance(partition, str) else check_counts(partition, schedule.num_stages)
    m = schedule.num_microbatches
    source = 0  # group rank 0 runs the first stage (of the first replica)
    header = torch.zeros(2, dtype=torch.int64, device=device)  # [failed, method]
    rows = torch.zeros(5, len(model), dtype=torch.float64, device=device)
    failure: Exception | None = None
    if transport.rank == source:
        method = partition if isinstance(partition, str) else ("time" if sample is not None else "parameters")
        try:
            micro = None if sample is None else _first_microbatch(sample, m)
            if method == "time" and micro is None:
                raise ValueError("partition='time' needs sample= (an example input batch) on the first stage's rank")
            costs = measure(model, micro, timed=counts is None and method == "time", device=device, compile=compile)
            rows = torch.tensor(costs.to_rows(), dtype=torch.float64, device=device)
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
    return Partition(method, solve(method_costs(method, costs), schedule.num_stages), costs, schedule.placement)


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
