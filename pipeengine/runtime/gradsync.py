"""Gradient synchronisation: one protocol, started by the stream after the last backward that touches what it
synchronises (schedules.passes.sync places it), finished before the step returns, overlapping what runs between.

    GradientSync.start(op, stream, average)   at AR (stage s's gradients) or TR (tie group g's weights)
    GradientSync.finish()                     at the step's end: wait, and write the result back

Three implementations; the first two reduce flat buffers (one per dtype) asynchronously:

    ReplicaMean   AR: a stage's gradients averaged over the data-parallel replicas (a weight shared by two
                  stages of this rank goes with the stage whose AR comes last, when all its gradient is in)
    TieSum        TR: a tied weight's gradient summed over the ranks that hold a copy (every replica's), then
                  averaged over the replicas
    ShardedReduce AR with fsdp=True: FSDP2's reduce-scatter of the stage's gradients, once per step (each
                  micro-batch's backward only accumulates: set_requires_gradient_sync(False) until then), as
                  torch.distributed.pipelining's stage does it (perform_reduce_grad): its flags on, the
                  post-backward of every parameter group, the root's final callback, the flags off again

Gradients accumulated over earlier steps (no zero_grad between) are already synchronised: a reduction must add
only this step's share. A mean over replicas does (the mean of ``old + new_i`` is ``old + mean(new_i)``); a sum
would add ``old`` once per rank, so before a training step's first backward (``begin``) one rank of each summing
group keeps it (times the divisor it will be divided by) and the others zero theirs in place: no copy is held.

Finished in the order AR, then TR: with FSDP a tie sum adds shards, so it starts when they are reduced
(TieSum(after_shards=True) defers its start to its finish) and spans the holders of one replica.

``average=False`` (a token-mean loss over the global count) sums over replicas instead of averaging:
each replica's share already carries its weight.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeengine.comm.base import Pending, Transport
from pipeengine.core.dtensors import is_dtensor, local
from pipeengine.core.sharding import reshard
from pipeengine.errors import PipelineError
from pipeengine.observe.trace import Tracer
from pipeengine.runtime.stage import StageWorker
from schedules import Action, Instruction, Kind

__all__ = ["GradientSync", "ReplicaMean", "ShardedReduce", "TieGroup", "TieSum"]


@dataclass
class Reduction:
    """One flat buffer being reduced: the gradients it was made of, and what to divide the result by."""

    op: Instruction  # the instruction that started it
    pending: Pending
    flat: torch.Tensor
    grads: list[torch.Tensor]
    divisor: int

    def finish(self, tracer: Tracer) -> None:
        with tracer.span(self.op, wait=True):
            self.pending.wait()
        if self.divisor > 1:
            self.flat /= self.divisor
        offset = 0
        for grad in self.grads:
            grad.copy_(self.flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


@dataclass
class GradientSync(abc.ABC):
    """Gradients synchronised once per step (see the module docstring)."""

    started: list[Reduction] = field(default_factory=list, init=False)

    def begin(self, average: bool) -> None:  # noqa: B027  (a mean needs nothing)
        """Before a training step's first backward: what .grad holds from earlier steps, counted once by the sum
        (see the module docstring)."""

    @abc.abstractmethod
    def start(self, op: Instruction, stream: tuple[Action, ...], average: bool, tracer: Tracer) -> None:
        """Start synchronising what ``op`` names; ``stream`` is this rank's program, ``average`` as above."""

    def held(self) -> Iterator[torch.Tensor]:
        """The flat buffers being reduced: held from the start to the step's end."""
        for reduction in self.started:
            yield reduction.flat

    def finish(self, tracer: Tracer) -> None:
        """Wait for every reduction started this step and write the results back into the gradients."""
        started, self.started = self.started, []
        for reduction in started:
            reduction.finish(tracer)

    def _reduce(self, op: Instruction, grads: Iterable[torch.Tensor], transport: Transport, what: str,
                divisor: int) -> None:  # fmt: skip
        """Start a sum of ``grads`` over ``transport``, one flat buffer per dtype."""
        buckets: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:  # a DTensor's shard: the replicas hold the same shard, at the same tensor index
            buckets.setdefault(grad.dtype, []).append(local(grad))
        for bucket in buckets.values():
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self.started.append(Reduction(op, transport.start_all_reduce(flat, what), flat, bucket, divisor))


@dataclass
class ReplicaMean(GradientSync):
    """AR: a stage's gradients averaged over the data-parallel replicas."""

    data: Transport  # the replicas of this pipeline position
    workers: dict[int, StageWorker]
    exclude: set[int]  # id() of parameters another synchronisation owns (tied across ranks: TieSum)
    _owners: dict[tuple[Action, ...], dict[int, list[nn.Parameter]]] = field(default_factory=dict, init=False)

    def begin(self, average: bool) -> None:
        if not average and self.data.rank != 0:  # summed: replica 0's accumulated gradients stand for every replica's
            for worker in self.workers.values():
                for param in worker.module.parameters():
                    if param.grad is not None and id(param) not in self.exclude:
                        param.grad.zero_()

    def start(self, op: Instruction, stream: tuple[Action, ...], average: bool, tracer: Tracer) -> None:
        with tracer.span(op):
            params = self.owned(stream)[op.stage]
            grads = [_aligned(p) for p in params if p.grad is not None]  # the same on every replica: the same graph
            what = f"the gradient all-reduce of stage {op.stage} over the data-parallel replicas"
            self._reduce(op, grads, self.data, what, self.data.size if average else 1)

    def owned(self, stream: tuple[Action, ...]) -> dict[int, list[nn.Parameter]]:
        """Per stage, the parameters its AR averages: a weight shared by stages of this rank goes with the stage
        whose AR comes last in the stream."""
        owners = self._owners.get(stream)
        if owners is None:
            order = [a.stage for a in stream if isinstance(a, Instruction) and a.kind is Kind.ALL_REDUCE]
            last_stage = {}
            for stage in order:
                for param in self.workers[stage].module.parameters():
                    if id(param) not in self.exclude:
                        last_stage[id(param)] = (stage, param)
            owners = {stage: [] for stage in order}
            for stage, param in last_stage.values():
                owners[stage].append(param)
            self._owners[stream] = owners
        return owners


@dataclass
class ShardedReduce(GradientSync):
    """AR with fsdp=True: FSDP2 reduce-scatters stage ``op.stage``'s gradients into its sharded parameters."""

    roots: dict[int, nn.Module]  # stage -> its module, fully_shard'ed (an FSDPModule)
    replicas: int  # FSDP2 divides by this unless the step sums (a global token count)
    sum_only: bool = False  # the backend reduces with SUM alone (gloo): FSDP2 divides after, not in the collective
    reshard_after_forward: bool = False  # the units free their gathered parameters after each forward
    _begun: list[nn.Module] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        for root in self.roots.values():
            self.accumulate(root)

    @staticmethod
    def accumulate(root: nn.Module) -> None:
        """Micro-batches' backwards add into the unsharded gradients: no reduce-scatter, parameters kept gathered."""
        root.set_is_last_backward(False)  # type: ignore[operator]
        root.set_reshard_after_backward(False)  # type: ignore[operator]
        root.set_requires_gradient_sync(False)  # type: ignore[operator]

    def start(self, op: Instruction, stream: tuple[Action, ...], average: bool, tracer: Tracer) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        root = self.roots[op.stage]
        with tracer.span(op):
            root.set_is_last_backward(True)  # type: ignore[operator]
            root.set_reshard_after_backward(True)  # type: ignore[operator]
            root.set_requires_gradient_sync(True)  # type: ignore[operator]
            for unit in root.modules():  # each unit's own (these setters do not recurse)
                if isinstance(unit, FSDPModule):
                    unit.set_gradient_divide_factor(float(self.replicas if average else 1))
                    unit.set_force_sum_reduction_for_comms(self.sum_only)  # gloo has no PREMUL_SUM
            for state in fully_shard.state(root)._state_ctx.all_states:  # type: ignore[attr-defined]
                for group in state._fsdp_param_groups:
                    group.post_backward()  # the reduce-scatter into the sharded .grad; the parameters resharded
            self._begun.append(root)

    def held(self) -> Iterator[torch.Tensor]:
        return iter(())

    def finish(self, tracer: Tracer) -> None:
        from torch.distributed.fsdp import fully_shard

        begun, self._begun = self._begun, []
        for root in begun:
            fully_shard.state(root)._root_post_backward_final_callback()  # type: ignore[attr-defined]
            self.accumulate(root)
        if not begun:  # a forward-only step (eval): no backward resharded what its forwards gathered
            for root in self.roots.values():
                reshard(root)


@dataclass(frozen=True)
class TieGroup:
    """A tie group this rank holds: the group of ranks that hold it, and this rank's copies of its weights."""

    transport: Transport  # the holding ranks of every replica: the sum spans them all
    params: list[nn.Parameter]
    replicas: int  # data-parallel replicas in the group: averaged over them, unless the step sums them


@dataclass
class TieSum(GradientSync):
    """TR: each tie group's gradients summed over the ranks that hold it."""

    groups: dict[int, TieGroup]  # tie group -> what this rank sums for it
    after_shards: bool = False  # FSDP: start at the finish, after the AR's reduce-scatter made the shards
    _deferred: list[tuple[Instruction, bool]] = field(default_factory=list, init=False)

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

    def start(self, op: Instruction, stream: tuple[Action, ...], average: bool, tracer: Tracer) -> None:
        if self.after_shards:
            self._deferred.append((op, average))
            return
        self._sum(op, average, tracer)

    def finish(self, tracer: Tracer) -> None:
        deferred, self._deferred = self._deferred, []
        for op, average in deferred:
            self._sum(op, average, tracer)
        super().finish(tracer)

    def _sum(self, op: Instruction, average: bool, tracer: Tracer) -> None:
        tie = self.groups.get(op.tie_group)
        if tie is None:
            raise PipelineError(f"{op}: this rank holds no weights of tie group {op.tie_group}")
        with tracer.span(op):
            grads = []
            for param in tie.params:
                if param.grad is None:  # unused here this step: its share of the sum is zero
                    param.grad = torch.zeros_like(param)
                grads.append(_aligned(param))
            what = f"the sum of tie group {op.tie_group}'s gradients over the ranks that hold it"
            self._reduce(op, grads, tie.transport, what, tie.replicas if average else 1)

    @property
    def params(self) -> set[int]:
        """id() of every parameter it synchronises."""
        return {id(p) for tie in self.groups.values() for p in tie.params}


def _aligned(param: nn.Parameter) -> torch.Tensor:
    """A parameter's gradient placed as the parameter is (a DTensor's gradient may come replicated where the
    parameter is sharded, an embedding's for one): every holder then reduces the same shard."""
    grad = param.grad
    if is_dtensor(grad) and tuple(grad.placements) != tuple(param.placements):  # type: ignore[union-attr, attr-defined]
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)  # type: ignore[union-attr, attr-defined]
    return grad  # type: ignore[return-value]
