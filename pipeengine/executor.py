"""The executor: interprets one rank's instruction stream; it never decides order.

Communication is posted when the stream says (recvs early, batched with sends),
a recv is waited on just before the compute that needs it, and a send's tensors are
kept alive until the send completes, checked without blocking between instructions.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeengine.comm import P2P, Transfer
from pipeengine.errors import PeerError, PipelineError
from pipeengine.specs import Boundary, Tensors
from pipeengine.stage import StageWorker
from schedules import Batch, Instruction, Kind, Schedule

__all__: list[str] = []

_F, _B = Kind.FORWARD, Kind.BACKWARD
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
    def __init__(self, rank: int, workers: dict[int, StageWorker], p2p: P2P, device: torch.device) -> None:
        self.rank = rank
        self.workers = workers
        self.p2p = p2p
        self.device = device

    def run(self, schedule: Schedule, step: Step) -> dict[int, Tensors]:
        """Run this rank's stream; return the last stage's outputs per micro-batch (evaluation)."""
        placement, last = schedule.placement, schedule.num_stages - 1
        handoff: dict[tuple[Kind, int, int], Tensors] = {}  # (kind, stage, mb) -> tensors produced here
        pending: dict[Instruction, Transfer] = {}  # posted recvs, by their instruction
        sending: deque[Transfer] = deque()  # posted sends, oldest first
        results: dict[int, Tensors] = {}
        stream = schedule.instructions[self.rank]
        where = ""
        try:
            for index, action in enumerate(stream):
                where = f"rank {self.rank}, step {index}: {action}"
                if isinstance(action, Instruction) and action.kind.is_compute:
                    where += f" (stage {action.stage}, micro-batch {action.microbatch})"
                while sending and all(w.is_completed() for w in sending[0].works):
                    sending.popleft()  # its tensors may be freed now
                if isinstance(action, Batch) or not action.kind.is_compute:
                    self._post(action, placement, step, handoff, pending, sending)
                    continue
                s, mb = action.stage, action.microbatch
                worker = self.workers[s]
                if action.kind is _F:
                    if s == 0:
                        inputs = step.inputs[mb]  # type: ignore[index]  # the first stage's rank has inputs
                        packed = step.first_input.is_tuple
                    else:
                        boundary = step.outputs[s - 1]
                        inputs = self._take(
                            Instruction(s, _RF, mb),
                            (_F, s - 1, mb),
                            placement[s - 1],
                            boundary if step.train else None,
                            handoff,
                            pending,
                            where,
                        )
                        packed = boundary.is_tuple
                    target = step.targets[mb] if s == last and step.train else None  # type: ignore[index]
                    with torch.set_grad_enabled(step.train):
                        out = worker.forward(mb, inputs, packed, target, step.train)
                    if s == last:
                        if not step.train:
                            results[mb] = out
                    else:
                        handoff[(_F, s, mb)] = out
                elif action.kind is _B:
                    grads = None
                    if s < last:
                        grads = self._take(
                            Instruction(s, _RB, mb), (_B, s + 1, mb), placement[s + 1], None, handoff, pending, where
                        )
                    input_grads = worker.backward(mb, grads)
                    if s > 0:
                        handoff[(_B, s, mb)] = input_grads
                else:
                    raise PipelineError(f"{where}: this executor runs F and B; {action.kind.name} is not supported yet")
            for transfer in sending:
                where = f"rank {self.rank}, end of step: completing a send to rank {transfer.peer}"
                try:
                    self.p2p.wait(transfer)
                except Exception as error:
                    raise PeerError(f"{where}: {error}") from error
        except PipelineError:
            raise
        except Exception as error:
            raise PipelineError(f"{where}: {type(error).__name__}: {error}") from error
        return results

    def _post(
        self,
        action: Instruction | Batch,
        placement: tuple[int, ...],
        step: Step,
        handoff: dict[tuple[Kind, int, int], Tensors],
        pending: dict[Instruction, Transfer],
        sending: deque[Transfer],
    ) -> None:
        transfers = []
        for op in action.ops if isinstance(action, Batch) else (action,):
            peer = placement[op.peer_stage]
            if op.kind is _SF:
                transfer = Transfer(
                    tuple(t.detach().contiguous() for t in handoff.pop((_F, op.stage, op.microbatch))), peer
                )
            elif op.kind is _SB:
                transfer = Transfer(tuple(g.contiguous() for g in handoff.pop((_B, op.stage, op.microbatch))), peer)
            else:
                boundary = step.outputs[op.stage - 1] if op.kind is _RF else step.outputs[op.stage]
                specs = boundary.specs if op.kind is _RF else boundary.grad_specs
                buffers = tuple(torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs)
                transfer = Transfer(buffers, peer)
                pending[op] = transfer
            if op.kind.is_send:
                sending.append(transfer)
            transfers.append((op.kind.is_send, transfer))
        self.p2p.post(transfers)

    def _take(
        self,
        recv: Instruction,
        local: tuple[Kind, int, int],
        peer: int,
        leaves: Boundary | None,
        handoff: dict[tuple[Kind, int, int], Tensors],
        pending: dict[Instruction, Transfer],
        where: str,
    ) -> Tensors:
        """The tensors a compute consumes: handed over on this rank, or received (waited on here).

        With ``leaves`` (a training forward's input), they become leaf tensors that require
        grad as the boundary says; otherwise (gradients, evaluation) they are plain tensors.
        """
        if local in handoff:  # the neighbouring stage runs on this rank
            tensors = handoff.pop(local)
        else:
            transfer = pending.pop(recv)
            started = time.perf_counter()
            try:
                self.p2p.wait(transfer)
            except Exception as error:
                what = "activation" if recv.kind is _RF else "gradient"
                raise PeerError(
                    f"{where}: waiting for {recv} (the {what} of micro-batch {recv.microbatch} from rank {peer}) "
                    f"failed after {time.perf_counter() - started:.1f} s: {error}"
                ) from error
            tensors = transfer.tensors
        if leaves is None:
            return tuple(t.detach() for t in tensors)
        # a stage's inputs are leaves: autograd stops at the boundary and leaves their gradient in .grad
        return tuple(t.detach().requires_grad_(s.requires_grad) for t, s in zip(tensors, leaves.specs, strict=True))
