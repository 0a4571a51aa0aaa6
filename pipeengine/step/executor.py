"""The executor: interprets one rank's instruction stream; it never decides order.

Each instruction goes to the handler of its kind (a kind without one is refused): computes to the
stage workers, sends and recvs to the step's mailbox (pipeengine.step.mailbox), AR and TR to
the gradient synchronisations (pipeengine.parallel.gradsync's Syncs). What a compute consumes and produces
is schedules.ir.dataflow's. Data flows one way: the step's inputs in, a StepResult (losses,
outputs) back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pipeengine.comm.base import Transport
from pipeengine.core.specs import Boundary, Tensors
from pipeengine.errors import PipelineError, PlanError
from pipeengine.parallel.gradsync import Syncs
from pipeengine.step.mailbox import Mailbox
from pipeengine.step.stage import StageWorker
from schedules import Action, Dataflow, Instruction, Kind, Post, Schedule

if TYPE_CHECKING:
    from pipeengine.observe.trace import Spans

__all__: list[str] = []


class _Untraced:
    """An untraced step's tracer: no spans, no samples, and nothing of pipeengine.observe entered (a traced step, or
    one under the user's torch.profiler, runs under pipeengine.train.tracing's instead)."""

    ledger = None
    _nothing = nullcontext()

    def span(self, action: Action, wait: bool = False) -> nullcontext[None]:
        return self._nothing

    def sample(self, action: Action, held: Iterable[torch.Tensor]) -> None:
        """Never called: there is no ledger."""


UNTRACED = _Untraced()


@dataclass(frozen=True)
class StepInputs:
    """What one step runs on: the micro-batches of this rank's ends, the boundaries, how the loss counts."""

    train: bool
    number: int  # which training (or evaluation) step this is, for error messages
    inputs: Sequence[Tensors] | None  # per micro-batch, on the first stage's rank
    targets: Sequence[object] | None  # per micro-batch, on the last stage's rank (training)
    first_input: Boundary  # the first stage's input, one micro-batch
    boundaries: Sequence[Boundary]  # per stage, its output for one micro-batch (shapes, dtypes, gradients)
    loss_weight: float = 1.0  # each micro-batch's loss counts this much in the step's loss
    loss_scale: float = 1.0  # fp16: backpropagate the loss times this
    average_replicas: bool = True  # average gradients over data-parallel replicas (sum them: a global token mean)


@dataclass
class StepResult:
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # micro-batch -> its loss (last stage, training)
    outputs: dict[int, Tensors] = field(default_factory=dict)  # micro-batch -> the last stage's output (evaluation)


class Executor:
    """One rank's interpreter: its stage workers, its pipeline transport, and the gradient synchronisations its
    streams start (by instruction kind: AR, TR; see pipeengine.parallel.gradsync)."""

    def __init__(
        self,
        rank: int,
        workers: dict[int, StageWorker],
        pipeline: Transport,
        syncs: Syncs | None = None,
    ) -> None:
        self.rank = rank
        self.workers = workers
        self.pipeline = pipeline
        self.syncs = syncs if syncs is not None else Syncs()
        self._flows: dict[int, Dataflow] = {}

    def flow(self, program: Schedule) -> Dataflow:
        flow = self._flows.get(id(program))
        if flow is None:
            flow = self._flows[id(program)] = Dataflow.of(program)
        return flow

    def run(self, program: Schedule, step: StepInputs, traced: Spans | None = None) -> StepResult:
        """Run this rank's stream of ``program``; return the losses (training) or outputs (evaluation)."""
        flow = self.flow(program)
        tracer: Spans = UNTRACED if traced is None else traced
        state = _Step(self, program, flow, step, tracer, Mailbox(self.pipeline, program, flow, step.boundaries, tracer))
        stream = program.instructions[self.rank]
        index, action = -1, None
        try:
            if step.train and self.syncs.by_kind:
                self.syncs.begin(step.average_replicas)
            for index, action in enumerate(stream):  # noqa: B007  (read in the except clause)
                state.mailbox.reap()
                handler = _post if isinstance(action, Post) else HANDLERS.get(action.kind)
                if handler is None:
                    raise PipelineError(f"the executor has no handler for {action.kind} ({action})")  # type: ignore[union-attr]
                handler(state, action)  # type: ignore[arg-type]  # a Post goes to _post
                if tracer.ledger is not None:
                    tracer.sample(action, state.held())
            index, action = len(stream), None
            state.mailbox.complete()
            if self.syncs.by_kind:
                self.syncs.finish(tracer, step.train)
        except Exception as error:
            context = state.where(index, action)
            if isinstance(error, PlanError):  # the user's plan refused, on every rank: a ValueError still
                raise PlanError(f"{context}: {error}") from error
            if isinstance(error, PipelineError):
                if not str(error).startswith("rank "):  # raised here without context: give it one
                    raise type(error)(f"{context}: {error}") from error
                raise
            raise PipelineError(f"{context}: {type(error).__name__}: {error}") from error
        return state.result


@dataclass
class _Step:
    """One step on one rank: its mailbox, the computes it dispatches, and where a failure happened."""

    executor: Executor
    program: Schedule
    flow: Dataflow
    step: StepInputs
    tracer: Spans
    mailbox: Mailbox
    result: StepResult = field(default_factory=StepResult)

    def where(self, index: int, action: Action | None) -> str:
        """Where a failure happened: built only when one does."""
        kind = "training" if self.step.train else "evaluation"
        head = f"rank {self.executor.rank}, "
        if action is None:
            return head + f"end of {kind} step {self.step.number}"
        text = f"instruction {index} of {kind} step {self.step.number}: {action}"
        if isinstance(action, Instruction) and action.kind.is_compute:
            text += f" (stage {action.stage}, micro-batch {action.microbatch})"
        return head + text

    def held(self) -> Iterator[torch.Tensor]:
        """Every tensor this rank holds for the step now: its workers', and messages not yet taken or sent."""
        for worker in self.executor.workers.values():
            yield from worker.held()
        yield from self.mailbox.held()
        yield from self.executor.syncs.held()

    def post(self, action: Action) -> None:
        self.mailbox.post(action)

    def forward(self, op: Instruction) -> None:
        s, mb, step = op.stage, op.microbatch, self.step
        needs = self.flow.consumed_key(op)
        if needs < 0:  # the first stage reads the batch
            inputs, packed = step.inputs[mb], step.first_input.is_tuple  # type: ignore[index]  # this rank has them
        else:
            boundary = step.boundaries[s - 1]
            inputs, packed = self.mailbox.take(needs, boundary if step.train else None), boundary.is_tuple
        last = s == self.program.num_stages - 1
        worker = self.executor.workers[s]
        with self.tracer.span(op), torch.set_grad_enabled(step.train):
            out, loss = worker.forward(
                mb,
                inputs,
                packed,
                train=step.train,
                target=step.targets[mb] if last and step.train else None,  # type: ignore[index]
                expected=None if last else step.boundaries[s],
                loss_weight=step.loss_weight,
                loss_scale=step.loss_scale,
            )
        if loss is not None:
            self.result.losses[mb] = loss
        made = self.flow.produced_key(op)
        if made >= 0:
            self.mailbox.put(made, out)
        elif last and not step.train:
            self.result.outputs[mb] = out

    def backward(self, op: Instruction) -> None:
        """B, or I (the input half of a split backward)."""
        needs = self.flow.consumed_key(op)
        grads = self.mailbox.take(needs, None) if needs >= 0 else None
        worker = self.executor.workers[op.stage]
        with self.tracer.span(op):
            if op.kind is Kind.BACKWARD:
                input_grads = worker.backward(op.microbatch, grads)
            else:
                input_grads = worker.backward_input(op.microbatch, grads)
        made = self.flow.produced_key(op)
        if made >= 0:
            self.mailbox.put(made, input_grads)

    def weights(self, op: Instruction) -> None:
        with self.tracer.span(op):
            self.executor.workers[op.stage].backward_weight(op.microbatch)

    def synchronise(self, op: Instruction) -> None:
        """AR or TR: start the gradient synchronisation it names (finished at the step's end)."""
        stream = self.program.instructions[self.executor.rank]
        self.executor.syncs.start(op, stream, self.step.average_replicas, self.tracer)


_post = _Step.post
HANDLERS: dict[Kind, Callable[[_Step, Instruction], None]] = {  # every kind, or the executor refuses it
    Kind.FORWARD: _Step.forward,
    Kind.BACKWARD: _Step.backward,
    Kind.BACKWARD_INPUT: _Step.backward,
    Kind.BACKWARD_WEIGHT: _Step.weights,
    Kind.ALL_REDUCE: _Step.synchronise,
    Kind.TIE_REDUCE: _Step.synchronise,
    Kind.SEND_ACTIVATION: _Step.post,
    Kind.SEND_GRADIENT: _Step.post,
    Kind.RECV_ACTIVATION: _Step.post,
    Kind.RECV_GRADIENT: _Step.post,
}
