"""Weights tied across pipeline ranks (an embedding and the head that reuses it): each holder computes a part of
the gradient, and the parts are summed once per step (TR) over the ranks that hold the weight.

    tie_groups(...)   per tie group this rank holds: the transport of its holders (of every replica, or, with
                      fsdp, of this replica: each holds its own shard) and this rank's copies of its weights
    TieSum            TR: the sum, averaged over the replicas unless the step sums them; under FSDP it starts
                      after the replicas' reduce-scatter finished (``after``): it adds reduced shards
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from pipeengine.comm.base import Transport
from pipeengine.comm.topology import Topology
from pipeengine.core.ties import Ties
from pipeengine.errors import PipelineError
from pipeengine.observe.trace import Spans
from pipeengine.parallel.gradsync import GradientSync, SyncBytes, aligned, size
from schedules import Action, Instruction, Kind, Schedule, tie_ranks

__all__ = ["TieGroup", "TieSum", "tie_groups"]


@dataclass(frozen=True)
class TieGroup:
    """A tie group this rank holds: the group of ranks that hold it, and this rank's copies of its weights."""

    transport: Transport  # the holding ranks of every replica: the sum spans them all
    params: list[nn.Parameter]
    replicas: int  # data-parallel replicas in the group: averaged over them, unless the step sums them


@dataclass
class TieSum(GradientSync):
    """TR: each tie group's gradients summed over the ranks that hold it."""

    kind: ClassVar[Kind] = Kind.TIE_REDUCE
    groups: dict[int, TieGroup]  # tie group -> what this rank sums for it
    after_shards: bool = False  # FSDP: after the AR's reduce-scatter made the shards

    @property
    def after(self) -> tuple[Kind, ...]:
        return (Kind.ALL_REDUCE,) if self.after_shards else ()

    def claims(self) -> set[int]:
        return {id(p) for tie in self.groups.values() for p in tie.params}

    def begin(self, average: bool) -> None:
        """The group's first rank keeps the accumulated gradient, times what the sum will be divided by; the other
        holders zero theirs."""
        for tie in self.groups.values():
            scale = tie.replicas if average else 1
            for param in tie.params:
                if param.grad is None:
                    continue
                if tie.transport.rank != 0:
                    param.grad.zero_()
                elif scale > 1:
                    param.grad.mul_(scale)

    def start(self, op: Instruction, stream: tuple[Action, ...], average: bool, tracer: Spans) -> None:
        tie = self.groups.get(op.tie_group)
        if tie is None:
            raise PipelineError(f"{op}: this rank holds no weights of tie group {op.tie_group}")
        with tracer.span(op):
            grads = []
            for param in tie.params:
                if param.grad is None:  # unused here this step: its share of the sum is zero
                    param.grad = torch.zeros_like(param)
                grads.append(aligned(param))
            what = f"the sum of tie group {op.tie_group}'s gradients over the ranks that hold it"
            self._reduce(op, grads, tie.transport, what, tie.replicas if average else 1)

    def bytes(self, stream: tuple[Action, ...], into: SyncBytes) -> None:
        into.ties.update({g: float(sum(size(p) for p in tie.params)) for g, tie in self.groups.items()})


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
