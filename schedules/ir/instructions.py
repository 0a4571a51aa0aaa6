"""The instruction set: tiny frozen values with a short text form that parses back."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = ["Kind", "Instruction", "Post", "Batch", "Action", "ops_of", "parse"]


class Kind(enum.Enum):
    """What an instruction does. The value is its code in the text form."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    BACKWARD_INPUT = "I"  # gradient w.r.t. the stage input only (zero-bubble)
    BACKWARD_WEIGHT = "W"  # parameter gradients, deferred (zero-bubble)
    SEND_ACTIVATION = "SF"  # stage s sends its output to stage s+1
    RECV_ACTIVATION = "RF"  # stage s receives its input from stage s-1
    SEND_GRADIENT = "SB"  # stage s sends the gradient of its input to stage s-1
    RECV_GRADIENT = "RB"  # stage s receives the gradient of its output from stage s+1
    ALL_REDUCE = "AR"  # stage s starts averaging its gradients over data-parallel replicas (after micro-batch k)
    TIE_REDUCE = "TR"  # sTRk: after stage s, this rank starts summing the weights of tie group k over its holders

    # members are singletons: hashing by identity is C-speed (Enum's own __hash__ is Python)
    __hash__ = object.__hash__

    # set once per member below; plain attributes, read in every hot loop
    is_compute: bool
    is_send: bool
    is_recv: bool
    is_collective: bool
    indexes: str  # what the third field of its instructions holds: "micro-batch", or "tie group" (TR)


for _kind in Kind:
    _kind.is_compute = _kind.value in ("F", "B", "I", "W")
    _kind.is_send = _kind.value in ("SF", "SB")
    _kind.is_recv = _kind.value in ("RF", "RB")
    _kind.is_collective = _kind.value in ("AR", "TR")
    _kind.indexes = "tie group" if _kind.value == "TR" else "micro-batch"
_BY_CODE = {kind.value: kind for kind in Kind}
_TEXT = re.compile(r"^(\d+)(" + "|".join(sorted(_BY_CODE, key=len, reverse=True)) + r")(\d+)$")


@dataclass(frozen=True, slots=True)
class Instruction:
    """One operation of a stage on a micro-batch: ``1F3`` is stage 1, forward, micro-batch 3.

    For communication the stage is the local one: ``1SF3`` sends stage 1's output of
    micro-batch 3 and is matched by ``2RF3`` on the rank of stage 2 (see schedules.ir.dataflow).
    """

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Instruction({self})"

    @property
    def tie_group(self) -> int:
        """The tie group a TR sums (its third field)."""
        if self.kind is not Kind.TIE_REDUCE:
            raise ValueError(f"{self} is not a TR: its third field is a micro-batch, not a tie group")
        return self.microbatch


@dataclass(frozen=True, slots=True)
class Post:
    """Sends and recvs posted together (one ``batch_isend_irecv``): ``0SF3+0RB1``."""

    ops: tuple[Instruction, ...]

    def __post_init__(self) -> None:
        if not self.ops or not all(op.kind.is_send or op.kind.is_recv for op in self.ops):  # point-to-point only
            raise ValueError(f"a Post holds one or more send/recv instructions, got {self.ops}")

    def __str__(self) -> str:
        return "+".join(str(op) for op in self.ops)

    def __repr__(self) -> str:
        return f"Post({self})"


Batch = Post  # DESIGN.md's word for it: the messages posted as one batch_isend_irecv (not a batch of data)
Action = Instruction | Post


def ops_of(action: Action) -> tuple[Instruction, ...]:
    """The instructions of an action: a post's ops, or the instruction alone."""
    return action.ops if isinstance(action, Post) else (action,)


def parse(text: str) -> Action:
    """Parse the short form back: ``parse("1F3")``, ``parse("0SF3+0RB1")`` (a Post)."""
    parts = text.strip().split("+")
    ops = []
    for part in parts:
        match = _TEXT.match(part.strip())
        if match is None:
            codes = ", ".join(_BY_CODE)
            raise ValueError(
                f"cannot parse {part!r} as an instruction: expected <stage><kind><microbatch> "
                f"such as '1F3', with kind one of {codes}; join ops posted together with '+'"
            )
        stage, code, microbatch = match.groups()
        ops.append(Instruction(int(stage), _BY_CODE[code], int(microbatch)))
    if len(ops) == 1 and len(parts) == 1:
        return ops[0]
    return Post(tuple(ops))
