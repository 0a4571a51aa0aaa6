"""The executor: interprets one rank's instruction stream; it never decides order.

Communication is posted when the stream says (recvs early, batched with sends; on
gloo the engine hands it streams that post every recv first, schedules.receives_first),
a recv is waited on just before the compute that needs it, and a send's tensors are
kept alive until the send completes, checked without blocking between instructions.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from pipeengine.comm import P2P, Transfer
from pipeengine.errors import PeerError, PipelineError
from pipeengine.specs import Boundary, Tensors
from pipeengine.stage import StageWorker
from pipeengine.trace import Tracer
from schedules import Instruction, Kind, Post, Schedule, ops_of, peer

__all__: list[str] = []

_F, _B, _W, _AR = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_WEIGHT, Kind.ALL_REDUCE
_SF, _SB, _RF, _RB = Kind.SEND_ACTIVATION, Kind.SEND_GRADIENT, Kind.RECV_ACTIVATION, Kind.RECV_GRADIENT


@dataclass
class Step:
    """What one step runs on: the micro-batches of this rank's ends, and the boundaries between stages."""

    train: bool
    inputs: Sequence[Tensors] | None  # per micro-batch, on the first stage's rank
    targets: Sequence[object] | None  # per micro-batch, on the last stage's rank (training)
    first_input: Boundary  # the first stage's input, one micro-batch
    outputs: Sequence[Boundary]  # per stage, its output for one micro-batch


class Executor:
    def __init__(
        self,
        rank: int,
        workers: dict[int, StageWorker],
        p2p: P2P,
        device: torch.device,
        data_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank = rank
        self.workers = workers
        self.p2p = p2p
        self.device = device
        self.data_group = data_group  # the replicas of this pipeline position (data parallelism)
        self._owners: dict[tuple[Instruction | Post, ...], dict[int, list[nn.Parameter]]] = {}

    def owned(self, stream: tuple[Instruction | Post, ...]) -> dict[int, list[nn.Parameter]]:
        """Per stage, the parameters its all-reduce averages: a weight shared by stages of this rank
        goes with the stage whose all-reduce comes last, when all its gradient is in."""
        owners = self._owners.get(stream)
        if owners is None:
            order = [a.stage for a in stream if isinstance(a, Instruction) and a.kind is Kind.ALL_REDUCE]
            last_stage = {}
            for stage in order:
                for param in self.workers[stage].module.parameters():
                    last_stage[id(param)] = (stage, param)
            owners = {stage: [] for stage in order}
            for stage, param in last_stage.values():
                owners[stage].append(param)
            self._owners[stream] = owners
        return owners

    def run(self, schedule: Schedule, step: Step, tracer: Tracer | None = None) -> dict[int, Tensors]:
        """Run this rank's stream; return the last stage's outputs per micro-batch (evaluation)."""
        state = _Run(self, schedule, step, tracer)
        where = ""
        try:
            for index, action in enumerate(schedule.instructions[self.rank]):
                where = f"rank {self.rank}, step {index}: {action}"
                state.reap_sends()
                if isinstance(action, Post) or action.kind.is_send or action.kind.is_recv:
                    state.post(action)
                    continue
                where += f" (stage {action.stage}, micro-batch {action.microbatch})"
                if action.kind is _F:
                    state.forward(action, where)
                elif action.kind is _AR:
                    state.all_reduce(action)
                elif action.kind is _W:
                    state.weights(action)
                else:  # B, or I (the input half of a split backward)
                    state.backward(action, where)
            where = f"rank {self.rank}, end of step"
            state.finish(where)
        except PipelineError:
            raise
        except Exception as error:
            raise PipelineError(f"{where}: {type(error).__name__}: {error}") from error
        return state.results


@dataclass
class _Run:
    """The state of one step on one rank."""

    executor: Executor
    schedule: Schedule
    step: Step
    tracer: Tracer | None
    handoff: dict[tuple[Kind, int, int], Tensors] = field(default_factory=dict)  # (kind, stage, mb) -> produced
    pending: dict[Instruction, Transfer] = field(default_factory=dict)  # posted recvs
    sending: deque[Transfer] = field(default_factory=deque)  # posted sends, oldest first
    results: dict[int, Tensors] = field(default_factory=dict)  # last stage's outputs (evaluation)
    reducing: list[tuple[Instruction, dist.Work, torch.Tensor, list[torch.Tensor]]] = field(default_factory=list)

    def reap_sends(self) -> None:
        while self.sending and all(w.is_completed() for w in self.sending[0].works):
            self.sending.popleft()  # its tensors may be freed now

    def post(self, action: Instruction | Post) -> None:
        start = self.tracer.mark() if self.tracer else 0.0
        placement, outputs, device = self.schedule.placement, self.step.outputs, self.executor.device
        transfers = []
        for op in ops_of(action):
            peer_rank = placement[peer(op).stage]
            if op.kind is _SF:
                tensors = tuple(t.detach().contiguous() for t in self.handoff.pop((_F, op.stage, op.microbatch)))
            elif op.kind is _SB:
                tensors = tuple(g.contiguous() for g in self.handoff.pop((_B, op.stage, op.microbatch)))
            else:
                boundary = outputs[op.stage - 1] if op.kind is _RF else outputs[op.stage]
                specs = boundary.specs if op.kind is _RF else boundary.grad_specs
                tensors = tuple(torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs)
            transfer = Transfer(op, tensors, peer_rank)
            if op.kind.is_send:
                self.sending.append(transfer)
            else:
                self.pending[op] = transfer
            transfers.append((op.kind.is_send, transfer))
        self.executor.p2p.post(transfers)
        if self.tracer:
            self.tracer.add(action, start, self.tracer.mark())

    def forward(self, op: Instruction, where: str) -> None:
        s, mb, last, step = op.stage, op.microbatch, self.schedule.num_stages - 1, self.step
        if s == 0:
            inputs, packed = step.inputs[mb], step.first_input.is_tuple  # type: ignore[index]  # this rank has them
        else:
            boundary = step.outputs[s - 1]
            leaves = boundary if step.train else None
            inputs, packed = self.take(Instruction(s, _RF, mb), (_F, s - 1, mb), leaves, where), boundary.is_tuple
        target = step.targets[mb] if s == last and step.train else None  # type: ignore[index]
        start = self.tracer.mark() if self.tracer else 0.0
        with torch.set_grad_enabled(step.train):
            out = self.executor.workers[s].forward(mb, inputs, packed, target, step.train)
        if self.tracer:
            self.tracer.add(op, start, self.tracer.mark())
        if s < last:
            self.handoff[(_F, s, mb)] = out
        elif not step.train:
            self.results[mb] = out

    def backward(self, op: Instruction, where: str) -> None:
        s, mb = op.stage, op.microbatch
        grads = None
        if s < self.schedule.num_stages - 1:
            grads = self.take(Instruction(s, _RB, mb), (_B, s + 1, mb), None, where)
        start = self.tracer.mark() if self.tracer else 0.0
        worker = self.executor.workers[s]
        input_grads = worker.backward(mb, grads) if op.kind is _B else worker.backward_input(mb, grads)
        if self.tracer:
            self.tracer.add(op, start, self.tracer.mark())
        if s > 0:
            self.handoff[(_B, s, mb)] = input_grads

    def weights(self, op: Instruction) -> None:
        start = self.tracer.mark() if self.tracer else 0.0
        self.executor.workers[op.stage].backward_weight(op.microbatch)
        if self.tracer:
            self.tracer.add(op, start, self.tracer.mark())

    def take(self, recv: Instruction, local: tuple[Kind, int, int], leaves: Boundary | None, where: str) -> Tensors:
        """The tensors a compute consumes: handed over on this rank, or received (waited on here).

        With ``leaves`` (a training forward's input), they become leaf tensors that require
        grad as the boundary says; otherwise (gradients, evaluation) they are plain tensors.
        """
        if local in self.handoff:  # the neighbouring stage runs on this rank
            tensors = self.handoff.pop(local)
        else:
            transfer = self.pending.pop(recv)
            what = "activation" if recv.kind is _RF else "gradient"
            self.wait(transfer, f"{where}: waiting for {recv} (the {what} of micro-batch {recv.microbatch} "
                                f"from rank {transfer.peer})")  # fmt: skip
            tensors = transfer.tensors
        if leaves is None:
            return tuple(t.detach() for t in tensors)
        # a stage's inputs are leaves: autograd stops at the boundary and leaves their gradient in .grad
        return tuple(t.detach().requires_grad_(s.requires_grad) for t, s in zip(tensors, leaves.specs, strict=True))

    def wait(self, transfer: Transfer, what: str) -> None:
        """Block until a transfer is done; a failure is the peer's (PeerError), with how long we waited."""
        tracer = self.tracer
        start = tracer.mark() if tracer else 0.0
        began = time.perf_counter()
        try:
            self.executor.p2p.wait(transfer)
        except Exception as error:
            raise PeerError(f"{what} failed after {time.perf_counter() - began:.1f} s: {error}") from error
        if tracer:
            tracer.add(transfer.op, start, tracer.mark(), wait=True)

    def all_reduce(self, op: Instruction) -> None:
        """Start averaging a stage's gradients over the data-parallel replicas (waited on in finish)."""
        start = self.tracer.mark() if self.tracer else 0.0
        params = self.executor.owned(self.schedule.instructions[self.executor.rank])[op.stage]
        buckets: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in params:
            if param.grad is not None:  # the same on every replica: the same model, the same graph
                buckets.setdefault(param.grad.dtype, []).append(param.grad)
        for grads in buckets.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            work = dist.all_reduce(flat, group=self.executor.data_group, async_op=True)
            self.reducing.append((op, work, flat, grads))
        if self.tracer:
            self.tracer.add(op, start, self.tracer.mark())

    def finish(self, where: str) -> None:
        """Complete the sends still in flight and the gradient all-reduces: the step is over."""
        for transfer in self.sending:
            self.wait(transfer, f"{where}: completing {transfer.op} to rank {transfer.peer}")
        replicas = dist.get_world_size(self.executor.data_group) if self.reducing else 1
        for op, work, flat, grads in self.reducing:
            start, began = (self.tracer.mark() if self.tracer else 0.0), time.perf_counter()
            try:
                work.wait()
            except Exception as error:
                waited = time.perf_counter() - began
                what = f"the gradient all-reduce of stage {op.stage} over the data-parallel replicas"
                raise PeerError(f"{where}: {what} failed after {waited:.1f} s: {error}") from error
            flat /= replicas
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
            if self.tracer:
                self.tracer.add(op, start, self.tracer.mark(), wait=True)
