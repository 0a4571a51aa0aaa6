"""1F1B (PipeDream-flush): warm-up forwards, one-forward-one-backward, cool-down backwards.

Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", 2021.
"""

from __future__ import annotations

from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule

__all__ = ["one_f_one_b"]


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Rank i runs min(p-i-1, m) warm-up forwards, then alternates F and B, then drains.

    Same bubble as GPipe, but rank i holds at most min(p-i, m) micro-batches.
    Unit-cost timing (F=1, B=2), p=4, m=5::

        rank 0: 0F0 0F1 0F2 0F3 .   .   .   .   .   .   0B0 0B0 0F4 0B1 0B1 .   0B2 0B2 .   0B3 0B3 .   0B4 0B4
        rank 1: .   1F0 1F1 1F2 .   .   .   .   1B0 1B0 1F3 1B1 1B1 1F4 1B2 1B2 .   1B3 1B3 .   1B4 1B4 .   .
        rank 2: .   .   2F0 2F1 .   .   2B0 2B0 2F2 2B1 2B1 2F3 2B2 2B2 2F4 2B3 2B3 .   2B4 2B4 .   .   .   .
        rank 3: .   .   .   3F0 3B0 3B0 3F1 3B1 3B1 3F2 3B2 3B2 3F3 3B3 3B3 3F4 3B4 3B4 .   .   .   .   .   .
    """
    p, m = num_ranks, num_microbatches
    streams = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        order = [Instruction(rank, Kind.FORWARD, mb) for mb in range(warmup)]
        for k in range(m - warmup):
            order.append(Instruction(rank, Kind.FORWARD, warmup + k))
            order.append(Instruction(rank, Kind.BACKWARD, k))
        order += [Instruction(rank, Kind.BACKWARD, mb) for mb in range(m - warmup, m)]
        streams.append(tuple(order))
    return Schedule("1f1b", p, m, 1, tuple(range(p)), tuple(streams))
