"""GPipe: all forwards, then all backwards (Huang et al., 2019)."""

from __future__ import annotations

from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule

__all__ = ["gpipe"]


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """Every rank runs its stage forward on all micro-batches, then backward on all.

    Peak in-flight micro-batches: m on every rank. Unit-cost timing (F=1, B=2), p=4, m=4::

        rank 0: 0F0 0F1 0F2 0F3 .   .   .   .   .   .   .   .   .   0B0 0B0 0B1 0B1 0B2 0B2 0B3 0B3
        rank 1: .   1F0 1F1 1F2 1F3 .   .   .   .   .   .   1B0 1B0 1B1 1B1 1B2 1B2 1B3 1B3 .   .
        rank 2: .   .   2F0 2F1 2F2 2F3 .   .   .   2B0 2B0 2B1 2B1 2B2 2B2 2B3 2B3 .   .   .   .
        rank 3: .   .   .   3F0 3F1 3F2 3F3 3B0 3B0 3B1 3B1 3B2 3B2 3B3 3B3 .   .   .   .   .   .
    """
    streams = tuple(
        tuple(Instruction(rank, Kind.FORWARD, mb) for mb in range(num_microbatches))
        + tuple(Instruction(rank, Kind.BACKWARD, mb) for mb in range(num_microbatches))
        for rank in range(num_ranks)
    )
    return Schedule("gpipe", num_ranks, num_microbatches, 1, tuple(range(num_ranks)), streams)
