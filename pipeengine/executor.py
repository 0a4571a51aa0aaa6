"""The executor: interprets one rank's instruction stream; it never decides order.

Each instruction goes to the handler of its kind (a kind without one is refused). What a
compute consumes and produces is schedules.dataflow's: a message between two stages of this
rank is handed over in memory, one from another rank is a recv posted when the stream says
and waited on just before the compute that needs it. A send's tensors stay alive until the
send completes, checked without blocking between instructions. Data flows one way: the
step's inputs in, a StepResult (losses, outputs) back.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeengine.errors import PeerError, PipelineError
from pipeengine.memory import held_by
from pipeengine.specs import Boundary, Tensors
from pipeengine.stage import StageWorker
from pipeengine.trace import NULL_TRACER, Tracer
from pipeengine.transport import Pending, Transfer, Transport
from schedules import Action, Dataflow, Instruction, Kind, Message, Post, Schedule, ops_of

__all__: list[str] = []


@dataclass(frozen=True)
class StepInputs:
    """What one step runs on: the micro-batches of this rank's ends, the boundaries, how the loss counts."""

    train: bool
    number: int  # which training (or evaluation) step this is, for error messages
    inputs: Sequence[Tensors] | None  # per micro-batch, on the first stage's rank
    targets: Sequence[object] | None  # per micro-batch, on the last stage's rank (training)
    first_input: Boundary  # the first stage's input, one micro-batch
    outputs: Sequence[Boundary]  # per stage, its output for one micro-batch
    loss_weight: float = 1.0  # each micro-batch's loss counts this much in the step's loss
    loss_scale: float = 1.0  # fp16: backpropagate the loss times this
    average_replicas: bool = True  # average gradients over data-parallel replicas (sum them: a global token mean)


@dataclass(frozen=True)
class TieSum:
    """A tie group this rank holds: the group of ranks that hold it, and this rank's copies of its weights."""

    transport: Transport  # the holding ranks of every replica: the sum spans them all
    params: list[nn.Parameter]
    replicas: int  # data-parallel replicas in the group: averaged over them, unless the step sums them


@dataclass
class StepResult:
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # micro-batch -> its loss (last stage, training)
    outputs: dict[int, Tensors] = field(default_factory=dict)  # micro-batch -> the last stage's output (evaluation)


class Executor:
    def __init__(
        self,
        rank: int,
        workers: dict[int, StageWorker],
        pipeline: Transport,
        data: Transport | None = None,
        ties: dict[int, TieSum] | None = None,
    ) -> None:
        self.rank = rank
        self.workers = workers
        self.pipeline = pipeline
        self.data = data  # the replicas of this pipeline position (data parallelism)
        self.ties = ties or {}  # tie group -> what this rank sums for it (pipeengine.ties)
        self._tied = {id(p) for tie in self.ties.values() for p in tie.params}  # summed by TR, not by AR
        self._owners: dict[tuple[Action, ...], dict[int, list[nn.Parameter]]] = {}
        self._flows: dict[int, Dataflow] = {}

    def owned(self, stream: tuple[Action, ...]) -> dict[int, list[nn.Parameter]]:
        """Per stage, the parameters its all-reduce averages: a weight shared by stages of this rank
        goes with the stage whose all-reduce comes last, when all its gradient is in."""
        owners = self._owners.get(stream)
        if owners is None:
            order = [a.stage for a in stream if isinstance(a, Instruction) and a.kind is Kind.ALL_REDUCE]
            last_stage = {}
            for stage in order:
                for param in self.workers[stage].module.parameters():
                    if id(param) not in self._tied:
                        last_stage[id(param)] = (stage, param)
            owners = {stage: [] for stage in order}
            for stage, param in last_stage.values():
                owners[stage].append(param)
            self._owners[stream] = owners
        return owners

    def flow(self, program: Schedule) -> Dataflow:
        flow = self._flows.get(id(program))
        if flow is None:
            flow = self._flows[id(program)] = Dataflow.of(program)
        return flow

    def run(self, program: Schedule, step: StepInputs, tracer: Tracer = NULL_TRACER) -> StepResult:
        """Run this rank's stream of ``program``; return the losses (training) or outputs (evaluation)."""
        state = _Run(self, program, self.flow(program), step, tracer)
        stream = program.instructions[self.rank]
        index, action = -1, None
        try:
            for index, action in enumerate(stream):  # noqa: B007  (read in the except clause)
                state.reap_sends()
                handler = _post if isinstance(action, Post) else HANDLERS.get(action.kind)
                if handler is None:
                    raise PipelineError(f"the executor has no handler for {action.kind} ({action})")  # type: ignore[union-attr]
                handler(state, action)  # type: ignore[arg-type]  # a Post goes to _post
                if tracer.ledger is not None:
                    tracer.sample(action, state.held())
            index, action = len(stream), None
            state.finish()
        except Exception as error:
            context = state.where(index, action)
            if isinstance(error, PipelineError):
                if not str(error).startswith("rank "):  # raised here without context: give it one
                    raise type(error)(f"{context}: {error}") from error
                raise
            raise PipelineError(f"{context}: {type(error).__name__}: {error}") from error
        return state.result


@dataclass
class _Run:
    """The state of one step on one rank."""

    executor: Executor
    program: Schedule
    flow: Dataflow
    step: StepInputs
    tracer: Tracer
    outbox: dict[int, Tensors] = field(default_factory=dict)  # message key -> produced, until sent or taken here
    pending: dict[int, Transfer] = field(default_factory=dict)  # message key -> posted recv
    sending: deque[Transfer] = field(default_factory=deque)  # posted sends, oldest first
    result: StepResult = field(default_factory=StepResult)
    reducing: list[tuple[Instruction, Pending, torch.Tensor, list[torch.Tensor], int]] = field(default_factory=list)

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
            yield from held_by(worker)
        for tensors in self.outbox.values():
            yield from tensors
        for transfer in (*self.pending.values(), *self.sending):
            yield from transfer.tensors

    def reap_sends(self) -> None:
        """Let go of every send that has completed (its tensors may be freed), not only the oldest ones."""
        if self.sending:
            done = self.executor.pipeline.done
            self.sending = deque(t for t in self.sending if not done(t))

    def post(self, action: Action) -> None:
        outputs, placement = self.step.outputs, self.program.placement
        transfers = []
        with self.tracer.span(action):
            for op in ops_of(action):
                message = Message.of(op)
                key = self.flow.key(message)
                if op.kind.is_send:
                    produced = self.outbox.pop(key)
                    tensors = tuple((t if message.gradient else t.detach()).contiguous() for t in produced)
                    transfer = Transfer(op, tensors, placement[message.receiver])
                    self.sending.append(transfer)
                else:
                    boundary = outputs[message.boundary]
                    specs = boundary.grad_specs if message.gradient else boundary.specs
                    buffers = tuple(torch.empty(s.shape, dtype=s.dtype, device=self.executor.pipeline.device)
                                    for s in specs)  # fmt: skip
                    transfer = Transfer(op, buffers, placement[message.sender])
                    self.pending[key] = transfer
                transfers.append(transfer)
            self.executor.pipeline.post(transfers)

    def forward(self, op: Instruction) -> None:
        s, mb, step = op.stage, op.microbatch, self.step
        needs = self.flow.consumed_key(op)
        if needs < 0:  # the first stage reads the batch
            inputs, packed = step.inputs[mb], step.first_input.is_tuple  # type: ignore[index]  # this rank has them
        else:
            boundary = step.outputs[s - 1]
            inputs, packed = self.take(needs, boundary if step.train else None), boundary.is_tuple
        last = s == self.program.num_stages - 1
        worker = self.executor.workers[s]
        with self.tracer.span(op), torch.set_grad_enabled(step.train):
            out, loss = worker.forward(
                mb, inputs, packed, train=step.train, target=step.targets[mb] if last and step.train else None,  # type: ignore[index]
                expected=None if last else step.outputs[s], loss_weight=step.loss_weight, loss_scale=step.loss_scale,
            )  # fmt: skip
        if loss is not None:
            self.result.losses[mb] = loss
        made = self.flow.produced_key(op)
        if made >= 0:
            self.outbox[made] = out
        elif last and not step.train:
            self.result.outputs[mb] = out

    def backward(self, op: Instruction) -> None:
        """B, or I (the input half of a split backward)."""
        needs = self.flow.consumed_key(op)
        grads = self.take(needs, None) if needs >= 0 else None
        worker = self.executor.workers[op.stage]
        with self.tracer.span(op):
            if op.kind is Kind.BACKWARD:
                input_grads = worker.backward(op.microbatch, grads)
            else:
                input_grads = worker.backward_input(op.microbatch, grads)
        made = self.flow.produced_key(op)
        if made >= 0:
            self.outbox[made] = input_grads

    def weights(self, op: Instruction) -> None:
        with self.tracer.span(op):
            self.executor.workers[op.stage].backward_weight(op.microbatch)

    def take(self, key: int, leaves: Boundary | None) -> Tensors:
        """The tensors a compute consumes: handed over on this rank, or received (waited on here).

        With ``leaves`` (a training forward's input), they become leaf tensors that require
        grad as the boundary says; otherwise (gradients, evaluation) they are plain tensors.
        """
        if not self.flow.crosses_key(key):  # the neighbouring stage runs on this rank
            tensors = self.outbox.pop(key)
        else:
            transfer = self.pending.pop(key)
            self.wait(transfer)
            tensors = transfer.tensors
        if leaves is None:
            return tuple(t.detach() for t in tensors)
        # a stage's inputs are leaves: autograd stops at the boundary and leaves their gradient in .grad
        return tuple(t.detach().requires_grad_(s.requires_grad) for t, s in zip(tensors, leaves.specs, strict=True))

    def wait(self, transfer: Transfer) -> None:
        """Block until a transfer is done; a failure is the peer's (PeerError), with how long we waited."""
        began = time.perf_counter()
        try:
            with self.tracer.span(transfer.op, wait=True):
                self.executor.pipeline.wait(transfer)
        except Exception as error:
            verb = "waiting for" if transfer.op.kind.is_recv else "completing"
            direction = "from" if transfer.op.kind.is_recv else "to"
            raise PeerError(
                f"{verb} {transfer.op} ({Message.of(transfer.op)}, {direction} rank {transfer.peer}) failed after "
                f"{time.perf_counter() - began:.1f} s: {error}"
            ) from error

    def all_reduce(self, op: Instruction) -> None:
        """Start averaging a stage's gradients over the data-parallel replicas (waited on in finish)."""
        data = self.executor.data
        if data is None:
            raise PipelineError(f"{op}: a gradient all-reduce needs data parallelism (data_parallel > 1)")
        with self.tracer.span(op):
            params = self.executor.owned(self.program.instructions[self.executor.rank])[op.stage]
            buckets: dict[torch.dtype, list[torch.Tensor]] = {}
            for param in params:
                if param.grad is not None:  # the same on every replica: the same model, the same graph
                    buckets.setdefault(param.grad.dtype, []).append(param.grad)
            for grads in buckets.values():
                flat = torch.cat([g.reshape(-1) for g in grads])
                what = f"the gradient all-reduce of stage {op.stage} over the data-parallel replicas"
                divisor = data.size if self.step.average_replicas else 1
                self.reducing.append((op, data.start_all_reduce(flat, what), flat, grads, divisor))

    def tie_reduce(self, op: Instruction) -> None:
        """Start summing this rank's copies of a tie group's weights with the other holders' (waited on in finish)."""
        tie = self.executor.ties.get(op.microbatch)
        if tie is None:
            raise PipelineError(f"{op}: this rank holds no weights of tie group {op.microbatch}")
        with self.tracer.span(op):
            grads = []
            for param in tie.params:
                if param.grad is None:  # unused here this step: its share of the sum is zero
                    param.grad = torch.zeros_like(param)
                grads.append(param.grad)
            flat = torch.cat([g.reshape(-1) for g in grads])
            what = f"the sum of tie group {op.microbatch}'s gradients over the ranks that hold it"
            divisor = tie.replicas if self.step.average_replicas else 1
            self.reducing.append((op, tie.transport.start_all_reduce(flat, what), flat, grads, divisor))

    def finish(self) -> None:
        """Complete the sends still in flight and the gradient all-reduces: the step is over."""
        if self.sending:
            began = time.perf_counter()
            try:
                self.executor.pipeline.complete(list(self.sending))
            except Exception as error:
                peers = sorted({t.peer for t in self.sending})
                raise PeerError(f"completing the step's sends to ranks {peers} failed after "
                                f"{time.perf_counter() - began:.1f} s: {error}") from error  # fmt: skip
        for op, pending, flat, grads, replicas in self.reducing:
            with self.tracer.span(op, wait=True):
                pending.wait()
            if replicas > 1:
                flat /= replicas
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()


_post = _Run.post
HANDLERS: dict[Kind, Callable[[_Run, Instruction], None]] = {  # every kind, or the executor refuses it
    Kind.FORWARD: _Run.forward,
    Kind.BACKWARD: _Run.backward,
    Kind.BACKWARD_INPUT: _Run.backward,
    Kind.BACKWARD_WEIGHT: _Run.weights,
    Kind.ALL_REDUCE: _Run.all_reduce,
    Kind.TIE_REDUCE: _Run.tie_reduce,
    Kind.SEND_ACTIVATION: _Run.post,
    Kind.SEND_GRADIENT: _Run.post,
    Kind.RECV_ACTIVATION: _Run.post,
    Kind.RECV_GRADIENT: _Run.post,
}
