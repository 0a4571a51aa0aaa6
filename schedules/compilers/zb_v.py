"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): two chunks per rank in a V, backward split into I and W.

Stage r and stage 2p-1-r run on rank r, so the first and the last stage share rank 0. It
keeps 1F1B's peak memory on every rank with a near-zero bubble.
"""

from __future__ import annotations

from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule

__all__ = ["zb_v"]

F, IN, W = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


def zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V: two chunks per rank in a V, stage r and stage 2p-1-r on rank r (the first and last on rank 0).

    Warm-up on chunk 0, then forwards of chunk 1 each followed by its I and W; the steady
    state runs F, I, W on chunk 0 then on chunk 1; the cool-down runs the remaining I
    and then the deferred W. With fewer than 2p-1 micro-batches the order is that of
    2p-1 with the missing micro-batches left out. Unit-cost timing, p=2, m=4::

        rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3 .
        rank 1: .   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3
    """
    p, m = num_ranks, num_microbatches
    streams = tuple(_zb_v_rank(rank, p, m) for rank in range(p))
    placement = tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return Schedule("zb-v", p, m, 2, placement, streams)


def _zb_v_rank(rank: int, p: int, m: int) -> tuple[Instruction, ...]:
    n = max(2 * p - 1, m)  # the order is built for a full pipe, then cut to m
    down, up = rank, 2 * p - 1 - rank  # this rank's stage in chunk 0 and in chunk 1
    order: list[Instruction] = []
    done = {(down, F): 0, (up, F): 0, (down, IN): 0, (up, IN): 0}  # how many of each so far

    def next_of(stage: int, kind: Kind) -> int:
        done[(stage, kind)] += 1
        order.append(Instruction(stage, kind, done[(stage, kind)] - 1))
        return done[(stage, kind)] - 1

    def backward(stage: int) -> None:  # I then W of the same micro-batch
        order.append(Instruction(stage, W, next_of(stage, IN)))

    for _ in range(2 * (p - rank) - 1):
        next_of(down, F)
    for _ in range(rank):
        next_of(up, F)
        next_of(down, F)
    for _ in range(p - rank):
        next_of(up, F)
        backward(up)
    while done[(up, F)] < done[(down, F)] or done[(down, F)] < n:
        if done[(down, F)] < n:
            next_of(down, F)
        backward(down)
        next_of(up, F)
        backward(up)
    owed = {down: done[(down, IN)], up: done[(up, IN)]}  # the first W not yet run on each chunk
    for _ in range(rank):
        next_of(down, IN)
        next_of(up, IN)
    for _ in range(p - rank):
        next_of(down, IN)
        order.append(Instruction(down, W, owed[down]))
        owed[down] += 1
    order += [Instruction(up, W, mb) for mb in range(owed[up], n)]
    order += [Instruction(down, W, mb) for mb in range(owed[down], n)]
    return tuple(op for op in order if op.microbatch < m)
