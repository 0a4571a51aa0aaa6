"""Data parallelism, replicated: each replica of a pipeline position holds every weight of its stages, trains on its
share of the batch, and their gradients are averaged once per step (AR), overlapping the pipeline's tail.

    ReplicaMean     AR: a stage's gradients averaged over the replicas, one flat buffer per dtype, started when
                    the stream's last backward of the stage ran, finished at the step's end (parallel.gradsync)
    share_buffers   after a step: every replica takes replica 0's buffers (batch norm's statistics)

Why not torch's reducer (not built on it; reasons, not a measurement): DDP's reducer is armed by the wrapped
module's forward and starts its bucket all-reduces from autograd hooks in the backward that follows. A pipeline
runs several forwards before their backwards, so torch.distributed.pipelining's stage arms it by hand
(``reducer.prepare_for_backward`` before the last backward, ``no_sync`` for the others; its own comment calls it a
hack): the reduction then starts inside that backward, not at the schedule's AR instruction, and the schedule no
longer decides what it overlaps. ``replicate()`` (torch 2.13: FSDP2's machinery with an all-reduce,
replicate_with_fsdp) can be driven as ShardedReduce drives fully_shard, as torch's stage does, but it turns every
parameter into a DTensor on the replicas' mesh: what engine.parameters(), state_dict and a checkpoint hold would
change for every data-parallel user; and in-process ranks (launch(in_process=True)) have no process group to build
either on. This reduction is the schedule's AR instruction itself: exact under every schedule, split backward
included, on any transport.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from pipeengine.comm.base import Transport
from pipeengine.observe.trace import Spans
from pipeengine.parallel.gradsync import GradientSync, SyncBytes, aligned, size
from schedules import Action, Instruction, Kind

__all__ = ["ReplicaMean", "share_buffers"]


@dataclass
class ReplicaMean(GradientSync):
    """AR: a stage's gradients averaged over the data-parallel replicas (a weight shared by two stages of this rank
    goes with the stage whose AR comes last, when all its gradient is in)."""

    kind: ClassVar[Kind] = Kind.ALL_REDUCE
    data: Transport  # the replicas of this pipeline position
    stages: dict[int, nn.Module]  # this rank's stages
    _left: set[int] = field(default_factory=set, init=False)  # id() of parameters another sync reduces (tied)
    _owners: dict[tuple[Action, ...], dict[int, list[nn.Parameter]]] = field(default_factory=dict, init=False)

    def leave(self, params: set[int]) -> None:
        self._left |= params
        self._owners.clear()

    def begin(self, average: bool) -> None:
        if not average and self.data.rank != 0:  # summed: replica 0's accumulated gradients stand for every replica's
            for module in self.stages.values():
                for param in module.parameters():
                    if param.grad is not None and id(param) not in self._left:
                        param.grad.zero_()

    def start(self, op: Instruction, stream: tuple[Action, ...], average: bool, tracer: Spans) -> None:
        with tracer.span(op):
            params = self.owned(stream)[op.stage]
            grads = [aligned(p) for p in params if p.grad is not None]  # the same on every replica: the same graph
            what = f"the gradient all-reduce of stage {op.stage} over the data-parallel replicas"
            self._reduce(op, grads, self.data, what, self.data.size if average else 1)

    def bytes(self, stream: tuple[Action, ...], into: SyncBytes) -> None:
        for stage, owned in self.owned(stream).items():  # what each stage's AR flattens, to the step's end
            into.flat[stage] = float(sum(size(p) for p in owned))

    def owned(self, stream: tuple[Action, ...]) -> dict[int, list[nn.Parameter]]:
        """Per stage, the parameters its AR averages: a weight shared by stages of this rank goes with the stage
        whose AR comes last in the stream."""
        owners = self._owners.get(stream)
        if owners is None:
            order = [a.stage for a in stream if isinstance(a, Instruction) and a.kind is Kind.ALL_REDUCE]
            last_stage = {}
            for stage in order:
                for param in self.stages[stage].parameters():
                    if id(param) not in self._left:
                        last_stage[id(param)] = (stage, param)
            owners = {stage: [] for stage in order}
            for stage, param in last_stage.values():
                owners[stage].append(param)
            self._owners[stream] = owners
        return owners


def share_buffers(stages: Iterable[nn.Module], data: Transport) -> None:
    """Every replica takes replica 0's buffers (batch norm's running statistics), as DDP's broadcast_buffers does:
    each replica updated its own from its own batch; eval, the next step and a checkpoint see one copy. One message
    per dtype."""
    buffers: dict[torch.dtype, list[torch.Tensor]] = {}
    for module in stages:
        for buffer in module.buffers():
            buffers.setdefault(buffer.dtype, []).append(buffer)
    for dtype, group in buffers.items():
        flat = torch.cat([b.detach().reshape(-1) for b in group])
        data.broadcast(flat, 0, f"replica 0's {str(dtype).removeprefix('torch.')} buffers")
        offset = 0
        for buffer in group:
            buffer.detach().copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()
