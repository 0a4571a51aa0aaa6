"""Dataflow: which message each compute consumes and produces, defined once for every pass.

Stages form a chain. Boundary ``b`` lies between stage b and stage b+1; across it travel,
per micro-batch, an activation and, unless the boundary is gradient-free, its gradient::

    stage b   ── F ──►  activation (b, mb)  ──► F    stage b+1
    stage b   ◄─ B/I ─  gradient   (b, mb)  ◄── B/I  stage b+1

Lowering, validation, simulation and the runtime's executor all ask this module; a
schedule whose stages are not a chain, or whose computes pair up differently, changes
only here. A message between two stages on one rank is handed over in memory; one that
crosses ranks becomes a send on the sender's rank and a recv on the receiver's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from schedules.ir.instructions import Instruction, Kind

__all__ = ["Dataflow", "Message"]

_F, _B, _I = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT
_SF, _RF, _SB, _RB = Kind.SEND_ACTIVATION, Kind.RECV_ACTIVATION, Kind.SEND_GRADIENT, Kind.RECV_GRADIENT

# kind -> (offset from the instruction's stage to the boundary, is the message a gradient)
_CONSUMES = {_F: (-1, False), _B: (0, True), _I: (0, True)}
_PRODUCES = {_F: (0, False), _B: (-1, True), _I: (-1, True)}
_CARRIES = {_SF: (0, False), _RF: (-1, False), _SB: (-1, True), _RB: (0, True)}


@dataclass(frozen=True, slots=True)
class Message:
    """The activation (or gradient) of one micro-batch across boundary ``boundary`` (stage b | b+1)."""

    boundary: int
    microbatch: int
    gradient: bool

    @property
    def sender(self) -> int:
        """The stage that produces it."""
        return self.boundary + 1 if self.gradient else self.boundary

    @property
    def receiver(self) -> int:
        """The stage that consumes it."""
        return self.boundary if self.gradient else self.boundary + 1

    def send(self) -> Instruction:
        return Instruction(self.sender, _SB if self.gradient else _SF, self.microbatch)

    def recv(self) -> Instruction:
        return Instruction(self.receiver, _RB if self.gradient else _RF, self.microbatch)

    def key(self, num_microbatches: int) -> int:
        """One int per message, the same for its send and its recv: ``(boundary * m + mb) << 1 | gradient``."""
        return ((self.boundary * num_microbatches + self.microbatch) << 1) | self.gradient

    @classmethod
    def from_key(cls, key: int, num_microbatches: int) -> Message:
        boundary, microbatch = divmod(key >> 1, num_microbatches)
        return cls(boundary, microbatch, bool(key & 1))

    @classmethod
    def of(cls, op: Instruction) -> Message:
        """The message a send or recv instruction carries."""
        offset, gradient = _CARRIES[op.kind]
        return cls(op.stage + offset, op.microbatch, gradient)

    def __str__(self) -> str:
        what = "gradient" if self.gradient else "activation"
        return f"the {what} of micro-batch {self.microbatch} from stage {self.sender} to stage {self.receiver}"


def peer(op: Instruction) -> Instruction:
    """The instruction that matches a send (its recv) or a recv (its send)."""
    message = Message.of(op)
    return message.recv() if op.kind.is_send else message.send()


class Dataflow:
    """The messages of a chain of ``num_stages`` stages: what each compute consumes and produces.

    ``no_gradient``: boundaries that carry no gradient (the tensors crossing them need none,
    e.g. frozen first stages): no compute produces or consumes a gradient across them.
    """

    __slots__ = ("num_stages", "num_microbatches", "placement", "no_gradient")

    def __init__(
        self, num_stages: int, num_microbatches: int, placement: Sequence[int], no_gradient: Collection[int] = ()
    ) -> None:
        self.num_stages, self.num_microbatches = num_stages, num_microbatches
        self.placement = tuple(placement)
        self.no_gradient = frozenset(no_gradient)

    @classmethod
    def of(cls, schedule: object) -> Dataflow:
        """The dataflow of a Schedule (anything with num_stages, num_microbatches, placement, no_gradient)."""
        return cls(
            schedule.num_stages,  # type: ignore[attr-defined]
            schedule.num_microbatches,  # type: ignore[attr-defined]
            schedule.placement,  # type: ignore[attr-defined]
            schedule.no_gradient,  # type: ignore[attr-defined]
        )

    def _key(self, op: Instruction, table: dict[Kind, tuple[int, bool]]) -> int:
        rule = table.get(op.kind)
        if rule is None:
            return -1
        boundary = op.stage + rule[0]
        if not 0 <= boundary < self.num_stages - 1 or (rule[1] and boundary in self.no_gradient):
            return -1
        return ((boundary * self.num_microbatches + op.microbatch) << 1) | rule[1]

    def consumed_key(self, op: Instruction) -> int:
        """The key of the message a compute needs before it runs, or -1 (the first stage's F, the last's B, W)."""
        return self._key(op, _CONSUMES)

    def produced_key(self, op: Instruction) -> int:
        """The key of the message a compute makes, or -1 (the last stage's F, the first stage's B or I, W)."""
        return self._key(op, _PRODUCES)

    def carried_key(self, op: Instruction) -> int:
        """The key of the message a send or recv carries."""
        offset, gradient = _CARRIES[op.kind]
        return (((op.stage + offset) * self.num_microbatches + op.microbatch) << 1) | gradient

    def crosses_key(self, key: int) -> bool:
        """Whether the message of a key goes between ranks: its boundary's two stages are on two ranks."""
        boundary = (key >> 1) // self.num_microbatches
        return self.placement[boundary] != self.placement[boundary + 1]

    def consumes(self, op: Instruction) -> Message | None:
        """The message a compute needs before it runs (None: the first stage's F, the last's B, any W)."""
        key = self._key(op, _CONSUMES)
        return None if key < 0 else Message.from_key(key, self.num_microbatches)

    def produces(self, op: Instruction) -> Message | None:
        """The message a compute makes (None: the last stage's F, the first stage's B or I, any W)."""
        key = self._key(op, _PRODUCES)
        return None if key < 0 else Message.from_key(key, self.num_microbatches)

    def crosses(self, message: Message) -> bool:
        """Whether a message goes between ranks (a send and a recv) rather than over a handoff in memory."""
        return self.placement[message.sender] != self.placement[message.receiver]

    def key(self, message: Message) -> int:
        return message.key(self.num_microbatches)

    @property
    def num_keys(self) -> int:
        """How many message keys there are: keys run over range(num_keys)."""
        return 2 * self.num_stages * self.num_microbatches
