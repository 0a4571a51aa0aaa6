"""What PipelineEngine settles at construction: device, schedule, an agreed partition, refusals."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipeengine.partition import (
    METHODS,
    Partition,
    bounds_from_counts,
    check_counts,
    check_method,
    method_costs,
    solve,
    stage_module,
)
from pipeengine.profile import LayerCosts, measure
from pipeengine.specs import Tensors, map_tensors, unpack
from schedules import Schedule, build_schedule, validate

__all__: list[str] = []


def agree_partition(
    model: nn.Sequential,
    schedule: Schedule,
    partition: str | Sequence[int] | None,
    sample: object,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> Partition:
    """The first stage's rank measures the layers and broadcasts the costs; every rank then solves alike."""
    if isinstance(partition, str):
        check_method(partition)
    counts = None if partition is None or isinstance(partition, str) else check_counts(partition, schedule.num_stages)
    m = schedule.num_microbatches
    source, rank = 0, dist.get_rank(group)  # group rank 0 runs the first stage (of the first replica)
    header = torch.zeros(2, dtype=torch.int64, device=device)  # [failed, method]
    rows = torch.zeros(5, len(model), dtype=torch.float64, device=device)
    failure: Exception | None = None
    if rank == source:
        method = partition if isinstance(partition, str) else ("time" if sample is not None else "parameters")
        try:
            micro = None if sample is None else _first_microbatch(sample, m)
            if method == "time" and micro is None:
                raise ValueError("partition='time' needs sample= (an example input batch) on the first stage's rank")
            costs = measure(model, micro, timed=counts is None and method == "time", device=device)
            rows = torch.tensor(costs.to_rows(), dtype=torch.float64, device=device)
            header[1] = METHODS.index(method)
        except Exception as error:  # every rank must hear of it, or they would wait for the costs
            failure = error
            header[0] = 1
    dist.broadcast(header, group_src=source, group=group)
    if failure is not None:
        raise failure
    if header[0]:
        raise ValueError(
            f"the first stage's rank ({source}) could not measure the layers to partition them; see its error"
        )
    dist.broadcast(rows, group_src=source, group=group)
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


def resolve_device(device: str | torch.device | None, group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    resolved = torch.device(device)
    if backend == "nccl" and resolved.type != "cuda":
        raise ValueError(f"the process group uses NCCL, which moves CUDA tensors only; got device={resolved}")
    return resolved


def resolve_schedule(schedule: str | Schedule, world: int, num_microbatches: int, chunks: int | None) -> Schedule:
    if isinstance(schedule, Schedule):
        if schedule.num_ranks != world or schedule.num_microbatches != num_microbatches:
            raise ValueError(
                f"the schedule is for {schedule.num_ranks} ranks and {schedule.num_microbatches} micro-batches, "
                f"but the world has {world} ranks and num_microbatches={num_microbatches}"
            )
        validate(schedule)
        return schedule
    if not isinstance(schedule, str):
        raise TypeError(f"schedule must be a name or a schedules.Schedule, got {type(schedule).__name__}")
    return build_schedule(schedule, world, num_microbatches, chunks)


def check_no_shared_parameters(model: nn.Sequential, bounds: list[tuple[int, int]], placement: tuple[int, ...]) -> None:
    """A parameter used by stages on two ranks would get two diverging copies: refuse it."""
    owner: dict[int, tuple[int, str]] = {}
    for stage, (start, end) in enumerate(bounds):
        for name, param in stage_module(model, start, end).named_parameters():
            seen = owner.setdefault(id(param), (stage, name))
            if placement[seen[0]] != placement[stage]:
                raise ValueError(
                    f"parameter {name!r} (stage {stage}) is the same tensor as {seen[1]!r} (stage {seen[0]}), "
                    "which runs on another rank; tied weights across ranks are not supported: untie them"
                )
