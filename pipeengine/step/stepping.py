"""A step: the call header, the batch cut into micro-batches, the boundaries inferred, the loss counted, the
program run, and the step's loss returned the same on every rank.

    train_step(x, y)                      eval_step(x)
      header: every rank learns the batch   header
      boundaries (meta device, cached)      boundaries
      loss_count: the step's units          -
      program(train, gradient-free b's)     program(eval)
      run: executor under the tracer        run
      loss: last stage -> pipeline -> replicas   outputs on the last stage's rank

The step path runs down: engine -> Stepper -> Executor -> Mailbox -> Transport, with the program cache (Programs,
below: the streams a rank's transport runs, made and proved once per kind of step); nothing here reaches back into
construction. The tracing (train.tracing, handed to the stepper) is
entered only for a traced step or one under the user's torch.profiler: an untraced step runs the executor under its
own null tracer (step.executor.UNTRACED) and enters nothing outside step/, core/ and comm/ (tests/test_layout.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeengine.comm.base import Transport
from pipeengine.comm.calls import Call, Calls
from pipeengine.comm.topology import Topology
from pipeengine.core.config import EngineConfig
from pipeengine.core.specs import Boundary, Tensors, infer_boundaries, unpack
from pipeengine.parallel.data import share_buffers
from pipeengine.step.executor import Executor, StepInputs, StepResult
from pipeengine.step.losses import count_units
from schedules import Schedule, forward_only, lower, validate, with_gradient_sync, with_tie_sync

if TYPE_CHECKING:
    from pipeengine.train.tracing import Tracing

__all__: list[str] = []


class Stepper:
    """A rank's steps: what it runs them with is handed to it (the executor, the program cache, the tracing)."""

    def __init__(
        self,
        executor: Executor,
        programs: Programs,
        topology: Topology,
        layers: StageLayers,
        config: EngineConfig,
        loss_fn: Callable[..., torch.Tensor],
        calls: Calls,
        tracing: Tracing,
        params: Callable[[], list[nn.Parameter]],
    ) -> None:
        self.executor, self.programs, self.topology, self.layers = executor, programs, topology, layers
        self.config, self.loss_fn, self.calls, self.tracing, self.params = config, loss_fn, calls, tracing, params
        self.num_microbatches: int = config.num_microbatches  # type: ignore[assignment]  # set by now (auto too)
        self.first, self.last = layers.placement[0] == topology.pp_rank, layers.placement[-1] == topology.pp_rank
        self.last_program: Schedule | None = None  # the streams the transport ran for the last step
        self._boundaries: dict[Boundary, list[Boundary]] = {}
        self._steps = {True: 0, False: 0}  # training and evaluation steps run, for error messages
        self._summed_checked = False  # loss_count: whether loss_fn was found to return a sum (step.losses)
        topology.world.engines += 1
        self._engine = topology.world.engines  # which engine of this world: in-process ranks infer its boundaries once

    def train(self, inputs: object, targets: object, loss_scale: float) -> float:
        """Forward and backward over all micro-batches; the mean loss (as one process has it) on every rank."""
        header = self.calls.exchange(
            Call.TRAIN, inputs, targets, first=self.first, last=self.last, num_microbatches=self.num_microbatches
        )
        boundaries = self.infer(header.microbatch_inputs)
        no_gradient = frozenset(b for b, boundary in enumerate(boundaries[:-1]) if not boundary.grad_specs)
        targets_split = None
        if self.last:
            targets_split = [mb if isinstance(targets, tuple) else mb[0] for mb in self.split(targets)]
        topology, last = self.topology, self.layers.placement[-1]
        total = None
        if self.config.loss_count is not None:  # the first step also checks that loss_fn returns a sum
            check = None if self._summed_checked else (self.loss_fn, boundaries[-1])
            total = count_units(self.config.loss_count, targets_split, topology, last, check)
            self._summed_checked = True
        step = StepInputs(
            True,
            self._steps[True],
            self.split(inputs) if self.first else None,
            targets_split,
            header.microbatch_inputs,
            boundaries,
            loss_weight=1.0 / (total or self.num_microbatches),
            loss_scale=loss_scale,
            average_replicas=total is None,  # a global count: replicas' shares add up
        )
        result = self.run(self.programs.get(True, no_gradient), step)
        loss = torch.zeros((), dtype=torch.float32, device=self.executor.pipeline.device)
        if self.last:
            losses = torch.stack([result.losses[mb] for mb in range(self.num_microbatches)]).double()
            loss = (losses.sum() / total if total is not None else losses.mean()).float()
        topology.pipeline.broadcast(loss, last, f"the step's loss from rank {last}")
        if topology.data is not None:  # every replica's share: over the global count, or the mean of the means
            topology.data.all_reduce(loss, "the losses of the other data-parallel replicas")
            if total is None:
                loss /= topology.data_parallel
        return float("nan") if loss.is_meta else loss.item()  # meta: a dry run's step (shapes only, no values)

    def eval(self, inputs: object) -> torch.Tensor | Tensors | None:
        """Forward only; the last stage's rank returns the outputs of the whole batch, others None."""
        header = self.calls.exchange(
            Call.EVAL, inputs, None, first=self.first, last=self.last, num_microbatches=self.num_microbatches
        )
        boundaries = self.infer(header.microbatch_inputs)
        split = self.split(inputs) if self.first else None
        step = StepInputs(False, self._steps[False], split, None, header.microbatch_inputs, boundaries)
        result = self.run(self.programs.get(False), step)
        if not self.last:
            return None
        parts = [result.outputs[mb] for mb in range(self.num_microbatches)]
        joined = tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))
        return boundaries[-1].pack(joined)

    def run(self, program: Schedule, step: StepInputs) -> StepResult:
        self._steps[step.train] += 1
        self.last_program = program
        if self.tracing.enabled or torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
            with self.tracing.step(self.executor, program, step, self.params()) as tracer:
                result = self.executor.run(program, step, tracer)
        else:  # untraced, no profiler recording: nothing of the tracing entered
            result = self.executor.run(program, step)
        data = self.topology.data
        if data is not None and any(module.training for module in self.layers.stages.values()):
            share_buffers(self.layers.stages.values(), data)  # replica 0's (batch norm's statistics)
        return result

    def split(self, value: object) -> list[Tensors]:
        """Per micro-batch tuples of tensors, on this rank's device (the header checked the shapes)."""
        tensors = unpack(value)  # type: ignore[arg-type]
        size = tensors[0].shape[0] // self.num_microbatches
        pieces = [t.detach().to(self.executor.pipeline.device, non_blocking=True).split(size) for t in tensors]
        return [tuple(piece[mb] for piece in pieces) for mb in range(self.num_microbatches)]

    def infer(self, inputs: Boundary) -> Sequence[Boundary]:
        """Output boundary of every stage for this micro-batch input, cached per input signature."""
        boundaries = self._boundaries.get(inputs)
        if boundaries is None:
            boundaries = self.topology.world.computed_once(
                ("boundaries", self._engine, inputs),
                lambda: infer_boundaries(self.layers.meta, self.layers.bounds, inputs),
            )
            if self.config.dtype is not None:  # floating tensors cross in the autocast dtype (see precision)
                boundaries = [b.in_dtype(self.config.dtype) for b in boundaries[:-1]] + boundaries[-1:]
            self._boundaries[inputs] = boundaries
        return boundaries


@dataclass(frozen=True)
class StageLayers:
    """What a step knows of the stages: this rank's modules, every stage's layers (meta: to infer every boundary),
    where each stage begins and ends in the model, and which pipeline rank runs each."""

    stages: dict[int, nn.Module]
    meta: list[nn.Module]
    bounds: Sequence[tuple[int, int]]
    placement: Sequence[int]


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
