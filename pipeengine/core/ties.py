"""Tied weights: one nn.Parameter used by layers of several stages, found once at construction.

A GPT ties its token embedding (first stage) to its output projection (last stage). Every rank
that holds one of those stages keeps a copy of the weight; after the last backward touching it
on each rank, the copies' gradients are summed over exactly those ranks (and averaged over the
data-parallel replicas) by a TR instruction in the stream (schedules.passes.sync), so every copy gets
the gradient one process would, and stays equal through the optimizer steps::

    rank 0    [embed ...]  ──F──►  ...  ◄──B──  ...  W(embed)  TR ─┐ sum of both gradients
    rank p-1  ...  [... head]  ──F, loss, B──►  W(head)        TR ─┘ (a group made once)

Stages that share a weight on one rank (ZB-V's V puts the first and last stage on rank 0) need
nothing: the weight is one tensor there. Everywhere the weight goes by the model's first name
for it (as nn.Module.named_parameters does); a checkpoint holds it once, with its other names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from pipeengine.core.bounds import stage_module

__all__: list[str] = []


@dataclass(frozen=True)
class Ties:
    """The weights shared by several stages, and the names every rank gives parameters."""

    names: dict[int, str]  # id(parameter) -> the model's first name for it (every parameter)
    groups: tuple[tuple[int, ...], ...]  # per tie group, the stages that hold its weights (schedule.tied)
    members: tuple[tuple[str, ...], ...]  # per tie group, the first names of its weights
    aliases: dict[str, str]  # every other name of a tied weight -> its first name
    owners: dict[str, int]  # first name of a tied weight -> the stage that writes it to checkpoints

    def spanning(self, placement: Sequence[int]) -> list[int]:
        """The tie groups whose stages are on more than one rank (those need a sum)."""
        return [g for g, stages in enumerate(self.groups) if len({placement[s] for s in stages}) > 1]

    def shared_elsewhere(self, placement: Sequence[int], rank: int) -> set[str]:
        """First names of the tied weights this rank holds but another rank owns (not written, not counted)."""
        return {name for name, stage in self.owners.items() if placement[stage] != rank}


def find_ties(model: nn.Sequential, bounds: Sequence[tuple[int, int]], placement: Sequence[int]) -> Ties:
    """The tie groups of a partitioned model; a tie that cannot be honoured is a ValueError naming the layers."""
    names: dict[int, str] = {id(p): name for name, p in model.named_parameters()}  # the first name wins
    holders: dict[int, list[tuple[int, str]]] = {}  # id(parameter) -> (stage, name) of each use
    buffers: dict[int, list[tuple[int, str]]] = {}
    storages: dict[int, list[tuple[int, str, int]]] = {}  # storage -> (stage, name, id(parameter))
    aliases: dict[str, str] = {}
    for stage, (start, end) in enumerate(bounds):
        module = stage_module(model, start, end)
        for name, param in module.named_parameters(remove_duplicate=False):
            holders.setdefault(id(param), []).append((stage, name))
            if name != names[id(param)]:
                aliases[name] = names[id(param)]
            if param.numel() and param.device.type != "meta":
                storages.setdefault(param.untyped_storage().data_ptr(), []).append((stage, name, id(param)))
        for name, buffer in module.named_buffers(remove_duplicate=False):
            buffers.setdefault(id(buffer), []).append((stage, name))
    for uses in buffers.values():
        ranks = {placement[stage] for stage, _ in uses}
        if len(ranks) > 1:
            (s0, n0), (s1, n1) = uses[0], next(u for u in uses if placement[u[0]] != placement[uses[0][0]])
            raise ValueError(
                f"buffer {n1!r} (stage {s1}) is the same tensor as {n0!r} (stage {s0}), which runs on another rank: "
                "each rank would update its own copy (e.g. batch-norm statistics). Keep the layers that share it on "
                "one rank (partition=[...]) or give each layer its own buffer"
            )
    for sharing in storages.values():
        if len({identity for _, _, identity in sharing}) > 1 and len({placement[s] for s, _, _ in sharing}) > 1:
            (s0, n0, i0) = sharing[0]
            s1, n1, _ = next(u for u in sharing if u[2] != i0)
            raise ValueError(
                f"parameter {n1!r} (stage {s1}) shares memory with {n0!r} (stage {s0}) but is another tensor (a view, "
                "or another shape), on another rank: a weight tied across ranks must be one nn.Parameter used by "
                "both layers, e.g. head.out.weight = embed.tokens.weight"
            )
    by_stages: dict[tuple[int, ...], list[str]] = {}
    owners: dict[str, int] = {}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}  # a frozen tie never changes: nothing to sum
    for identity, uses in holders.items():
        stages = tuple(sorted({stage for stage, _ in uses}))
        if len(stages) > 1:
            owners[names[identity]] = stages[0]
            if identity in trainable:
                by_stages.setdefault(stages, []).append(names[identity])
    groups = tuple(sorted(by_stages))
    return Ties(names, groups, tuple(tuple(by_stages[g]) for g in groups), aliases, owners)
