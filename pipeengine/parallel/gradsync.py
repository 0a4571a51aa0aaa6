"""Gradient synchronisation: one protocol, started by the stream after the last backward that touches what it
synchronises (schedules.passes.sync places it), finished before the step returns, overlapping what runs between.

    Syncs.begin(average)                before a training step's first backward
    Syncs.start(op, stream, average)    at AR (stage s's gradients) or TR (tie group g's weights)
    Syncs.finish(train)                 at the step's end: each sync waited for and written back, in order; a
                                        training step's syncs that no instruction starts started there first

Each parallelism implements GradientSync in its own module:

    ReplicaMean    AR  the replicas' mean of a stage's gradients (pipeengine.parallel.data)
    ShardedReduce  AR  fsdp=True: FSDP2's reduce-scatter of a stage's gradients (pipeengine.parallel.fsdp)
    TieSum         TR  a tied weight's gradient summed over the ranks that hold it (pipeengine.parallel.ties)
    TensorSum      --  a parameter each tensor-parallel rank holds whole but computes only its part of the gradient
                       of (a norm over its own heads), summed over the stage's tensor-parallel ranks at the step's
                       end, after the replicas' AR (pipeengine.parallel.tensor); at the first training step's
                       end, after every reduction, each whole parameter's gradient checked equal over those ranks
                       (a plan that left one out refused on every rank: pipeengine.parallel.leftout)

The ordering is explicit: a sync names the kinds that must have *finished* before its reductions start
(``after``); Syncs defers its starts until then and finishes in an order that respects it (a tie sum under
FSDP adds reduced shards: it comes after the reduce-scatter). Which sync reduces a parameter is explicit too: a
sync ``claims`` the parameters only it reduces (the tied weights), and every other sync ``leave``s them.

What a sync holds is explicit for the memory trace (pipeengine.train.tracing): ``held()`` the flat buffers
in flight; ``bytes(stream)`` what each stage's AR and each tie group's TR flattens, and what a stage gathers
whole (its parameters and their gradients, FSDP); ``gathered()`` the parameters whose storage is state wherever
it lives; ``whole(module)`` a stage held gathered while it is measured. No caller asks which sync it has.

Gradients accumulated over earlier steps (no zero_grad between) are already synchronised: a reduction must add
only this step's share. A mean over replicas does (the mean of ``old + new_i`` is ``old + mean(new_i)``); a sum
would add ``old`` once per rank, so before a training step's first backward (``begin``) one rank of each summing
group keeps it (times the divisor it will be divided by) and the others zero theirs in place: no copy is held.
``average=False`` (a token-mean loss over the global count) sums over replicas instead of averaging: each
replica's share already carries its weight.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from pipeengine.comm.base import Pending, Transport
from pipeengine.core.dtensors import is_dtensor, local
from pipeengine.errors import PipelineError
from pipeengine.observe.trace import Spans
from schedules import Action, Instruction, Kind

__all__ = ["GradientSync", "SyncBytes", "Syncs"]


@dataclass(frozen=True)
class Gathered:
    """What FSDP holds of a stage beyond its shards (bytes): its parameters and gradients whole, and what its AR
    leaves held to the step's end (a unit's reduce-scatter input) and holds above its start while it runs."""

    parameters: float
    gradients: float
    reduce_held: float
    reduce_transient: float


@dataclass
class SyncBytes:
    """What a rank's gradient syncs hold, in bytes, for the memory trace."""

    flat: dict[int, float] = field(default_factory=dict)  # stage -> its AR's flat buffers, from its start to the end
    ties: dict[int, float] = field(default_factory=dict)  # tie group -> its TR's flat buffers
    gathered: dict[int, Gathered] = field(default_factory=dict)  # stage -> what FSDP gathers of it


@dataclass
class Reduction:
    """One flat buffer being reduced: the gradients it was made of, and what to divide the result by."""

    op: Instruction | None  # the instruction that started it; None: the step's end (GradientSync.end)
    pending: Pending
    flat: torch.Tensor
    grads: list[torch.Tensor]
    divisor: int

    def finish(self, tracer: Spans) -> None:
        with tracer.span(self.op, wait=True) if self.op is not None else contextlib.nullcontext():
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

    kind: ClassVar[Kind | None]  # the instruction that starts it: AR or TR; None: none, the step's end (``end``)
    started: list[Reduction] = field(default_factory=list, init=False)

    @property
    def after(self) -> tuple[Kind, ...]:
        """The kinds of sync that must have finished before this one's reductions start."""
        return ()

    def claims(self) -> set[int]:
        """id() of the parameters only this sync reduces: every other leaves them."""
        return set()

    def leave(self, params: set[int]) -> None:  # noqa: B027  (a sync that reduces all it holds leaves nothing)
        """id() of parameters another sync reduces."""

    def begin(self, average: bool) -> None:  # noqa: B027  (a mean needs nothing)
        """Before a training step's first backward: what .grad holds from earlier steps, counted once by a sum."""

    @abc.abstractmethod
    def start(self, op: Instruction, stream: tuple[Action, ...], average: bool, tracer: Spans) -> None:
        """Start synchronising what ``op`` names; ``stream`` is this rank's program, ``average`` as above."""

    def end(self, tracer: Spans) -> None:  # noqa: B027  (a sync its instructions start has nothing more to start)
        """At a training step's end, once the syncs it comes ``after`` have finished: start what no instruction
        starts (``kind`` None)."""

    def finish(self, tracer: Spans) -> None:
        """Wait for every reduction started this step and write the results back into the gradients."""
        started, self.started = self.started, []
        for reduction in started:
            reduction.finish(tracer)

    def held(self) -> Iterator[torch.Tensor]:
        """The flat buffers being reduced: held from the start to the step's end."""
        for reduction in self.started:
            yield reduction.flat

    def bytes(self, stream: tuple[Action, ...], into: SyncBytes) -> None:  # noqa: B027  (holds nothing of its own)
        """Add what this sync holds over a step of ``stream`` to ``into``."""

    def gathered(self) -> list[nn.Parameter]:
        """Parameters this sync's parallelism gathers whole during the step: state, not activations."""
        return []

    @contextlib.contextmanager
    def whole(self, module: nn.Module) -> Iterator[None]:
        """``module`` (a stage of this rank) with its parameters whole inside the block, as after its first F."""
        yield

    def _reduce(
        self, op: Instruction | None, grads: Iterable[torch.Tensor], transport: Transport, what: str, divisor: int
    ) -> None:
        """Start a sum of ``grads`` over ``transport``, one flat buffer per dtype."""
        buckets: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:  # a DTensor's shard: the replicas hold the same shard, at the same tensor index
            buckets.setdefault(grad.dtype, []).append(local(grad))
        for bucket in buckets.values():
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self.started.append(Reduction(op, transport.start_all_reduce(flat, what), flat, bucket, divisor))


class Syncs:
    """This rank's gradient syncs, one per instruction kind (and one that no instruction starts: TensorSum), run in
    the order their ``after`` asks."""

    def __init__(self, syncs: Iterable[GradientSync] = ()) -> None:
        self.by_kind = {sync.kind: sync for sync in syncs}
        claimed = {sync.kind: sync.claims() for sync in self.by_kind.values()}
        for sync in self.by_kind.values():
            others = set().union(*(ids for kind, ids in claimed.items() if kind != sync.kind))
            if others:
                sync.leave(others)
        self.order: list[GradientSync] = []
        while len(self.order) < len(self.by_kind):  # each after what it waits for (the kinds this rank has)
            ready = [
                s
                for s in self.by_kind.values()
                if s not in self.order and all(self.by_kind.get(k) in (None, *self.order) for k in s.after)
            ]
            if not ready:
                waits = [(str(s.kind), [str(k) for k in s.after]) for s in self.by_kind.values()]
                raise PipelineError(f"gradient syncs that wait for each other: {waits}")
            self.order.append(ready[0])
        self._deferred: dict[Kind | None, list[tuple[Instruction, tuple[Action, ...], bool]]] = {}

    def get(self, kind: Kind) -> GradientSync | None:
        return self.by_kind.get(kind)

    def begin(self, average: bool) -> None:
        for sync in self.order:
            sync.begin(average)

    def start(self, op: Instruction, stream: tuple[Action, ...], average: bool, tracer: Spans) -> None:
        sync = self.by_kind.get(op.kind)
        if sync is None:
            need = "data parallelism (data_parallel > 1)" if op.kind is Kind.ALL_REDUCE else "a tied weight"
            raise PipelineError(f"{op}: a gradient synchronisation this rank has none of: it needs {need}")
        if any(kind in self.by_kind for kind in sync.after):  # started at the step's end, when those have finished
            self._deferred.setdefault(sync.kind, []).append((op, stream, average))
        else:
            sync.start(op, stream, average, tracer)

    def finish(self, tracer: Spans, train: bool) -> None:
        """Every sync finished, in order; a training step's (``train``) syncs that no instruction starts started
        first, each once those it comes after have finished."""
        for sync in self.order:
            for op, stream, average in self._deferred.pop(sync.kind, []):
                sync.start(op, stream, average, tracer)
            if train:
                sync.end(tracer)
            sync.finish(tracer)

    def held(self) -> Iterator[torch.Tensor]:
        for sync in self.order:
            yield from sync.held()

    def bytes(self, stream: tuple[Action, ...]) -> SyncBytes:
        found = SyncBytes()
        for sync in self.order:
            sync.bytes(stream, found)
        return found

    @property
    def gathered(self) -> Callable[[], list[nn.Parameter]] | None:
        """The parameters gathered whole during a step, looked up when asked; None where no sync gathers any."""
        gathering = [sync for sync in self.order if sync.gathered()]
        if not gathering:
            return None
        return lambda: [param for sync in gathering for param in sync.gathered()]

    @contextlib.contextmanager
    def whole(self, module: nn.Module) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for sync in self.order:
                stack.enter_context(sync.whole(module))
            yield


def aligned(param: nn.Parameter) -> torch.Tensor:
    """A parameter's gradient placed as the parameter is (a DTensor's gradient may come replicated where the
    parameter is sharded, an embedding's for one): every holder then reduces the same shard."""
    grad = param.grad
    if is_dtensor(grad) and tuple(grad.placements) != tuple(param.placements):  # type: ignore[union-attr, attr-defined]
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)  # type: ignore[union-attr, attr-defined]
    return grad  # type: ignore[return-value]


def size(param: nn.Parameter) -> int:
    """Bytes of a parameter this rank holds (a DTensor's shard)."""
    mine = local(param)
    return mine.numel() * mine.element_size()
