"""A rank's mailbox for one step: what it produced until sent or taken, the recvs it posted, the sends in flight.

The executor posts what the stream says, when it says; a compute takes its input here (handed
over on this rank, or received: waited on just before the compute). A send's tensors stay alive
until the send completes, checked without blocking between instructions; the rest is completed at
the step's end. Keys are schedules.ir.dataflow's message keys.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from pipeengine.comm.base import Tensors, Transfer, Transport
from pipeengine.core.specs import Boundary
from pipeengine.errors import PeerError
from pipeengine.observe.trace import Spans
from schedules import Action, Dataflow, Message, Schedule, ops_of

__all__: list[str] = []


@dataclass
class Mailbox:
    transport: Transport  # the pipeline
    program: Schedule
    flow: Dataflow
    boundaries: Sequence[Boundary]  # per stage, its output for one micro-batch: what a recv's buffers hold
    tracer: Spans
    outbox: dict[int, Tensors] = field(default_factory=dict)  # message key -> produced, until sent or taken here
    pending: dict[int, Transfer] = field(default_factory=dict)  # message key -> posted recv
    sending: deque[Transfer] = field(default_factory=deque)  # posted sends, oldest first

    def put(self, key: int, tensors: Tensors) -> None:
        """A compute produced a message: it waits here to be sent, or taken by a stage of this rank."""
        self.outbox[key] = tensors

    def post(self, action: Action) -> None:
        """Post the sends and recvs of an action together (one batch)."""
        placement, transfers = self.program.placement, []
        with self.tracer.span(action):
            for op in ops_of(action):
                message = Message.of(op)
                key = self.flow.key(message)
                if op.kind.is_send:
                    produced = self.outbox.pop(key)
                    tensors = tuple((t if message.gradient else t.detach()).contiguous() for t in produced)
                    transfer = Transfer(True, tensors, placement[message.receiver], op)
                    self.sending.append(transfer)
                else:
                    boundary = self.boundaries[message.boundary]
                    specs = boundary.grad_specs if message.gradient else boundary.specs
                    buffers = tuple(torch.empty(s.shape, dtype=s.dtype, device=self.transport.device) for s in specs)
                    transfer = Transfer(False, buffers, placement[message.sender], op)
                    self.pending[key] = transfer
                transfers.append(transfer)
            self.transport.post(transfers)

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
            with self.tracer.span(transfer.what, wait=True):  # type: ignore[arg-type]  # the instruction
                self.transport.wait(transfer)
        except Exception as error:
            verb, direction = ("completing", "to") if transfer.send else ("waiting for", "from")
            raise PeerError(
                f"{verb} {transfer.what} ({Message.of(transfer.what)}, {direction} rank {transfer.peer}) failed after "  # type: ignore[arg-type]
                f"{time.perf_counter() - began:.1f} s: {error}"
            ) from error

    def reap(self) -> None:
        """Let go of every send that has completed (its tensors may be freed), not only the oldest ones."""
        if self.sending:
            done = self.transport.done
            self.sending = deque(t for t in self.sending if not done(t))

    def complete(self) -> None:
        """Complete the sends still in flight: the step's messages are all out."""
        if self.sending:
            began = time.perf_counter()
            try:
                self.transport.complete(list(self.sending))
            except Exception as error:
                peers = sorted({t.peer for t in self.sending})
                raise PeerError(
                    f"completing the step's sends to ranks {peers} failed after "
                    f"{time.perf_counter() - began:.1f} s: {error}"
                ) from error

    def held(self) -> Iterator[torch.Tensor]:
        """The messages not yet taken or sent."""
        for tensors in self.outbox.values():
            yield from tensors
        for transfer in (*self.pending.values(), *self.sending):
            yield from transfer.tensors
