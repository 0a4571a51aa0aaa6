"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with its backward split into I and W.

I (the input gradient) is sent upstream at once; W (the weight gradient) has no consumer, so it
waits and fills the bubbles. It keeps 1F1B's peak memory: at most p micro-batches hold
activations on any rank (held from F until W).
"""

from __future__ import annotations

from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule

__all__ = ["zb_h1"]

F, IN, W = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with B split, rank i running W(k-i) right after I(k), its last i W passes at the end.

    Rank i holds p - i micro-batches as in 1F1B plus i waiting for W: p at most, 1F1B's peak.
    Bubble (p-1)(F+B-W) against 1F1B's (p-1)(F+B+W). Unit-cost timing, p=3, m=4::

        rank 0: 0F0 0F1 0F2 .   .   0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
        rank 1: .   1F0 1F1 .   1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3
        rank 2: .   .   2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3
    """
    p, m = num_ranks, num_microbatches
    streams = tuple(_zb_h1_rank(rank, p, m) for rank in range(p))
    return Schedule("zb-h1", p, m, 1, tuple(range(p)), streams)


def _zb_h1_rank(rank: int, p: int, m: int) -> tuple[Instruction, ...]:
    warmup = min(p - rank - 1, m)
    order = [Instruction(rank, F, mb) for mb in range(warmup)]
    due = 0  # the next micro-batch whose W is owed
    for k in range(m):
        if k < m - warmup:
            order.append(Instruction(rank, F, warmup + k))
        order.append(Instruction(rank, IN, k))
        if k - rank >= due:  # `rank` weight passes stay waiting
            order.append(Instruction(rank, W, due))
            due += 1
    return tuple(order + [Instruction(rank, W, mb) for mb in range(due, m)])
