"""V-Half and V-Min: ZB-V's V placement with less activation memory (Qi et al., "Pipeline Parallelism with
Controllable Memory", NeurIPS 2024).

Each rank runs two chunks in a V (stage r and 2p-1-r on rank r, as ZB-V) and repeats one building
block per micro-batch: six unit slots holding F of chunk 0, F of chunk 1, the input-gradient I of
chunk 1, then of chunk 0, and two weight passes W in the slots left free. Where each pass starts
in the block, rank by rank, sets how long a micro-batch's activations live, hence the memory:
the sooner I follows F, the fewer micro-batches a rank holds. W passes go to the earliest free
slots after their I. A rank's order is its passes sorted by slot; lowering and the simulator then
run it as fast as the dependencies allow.

    slot of micro-batch 0 on rank i (+6 per micro-batch; g = 2 if 3 divides p for V-Min, 3 if 2 does for V-Half)
    schedule   chunk-0 F   chunk-1 F     chunk-1 I         chunk-0 I
    V-Min      i           2p - i - 1    2p + g + i        4p + g - i - 1
    V-Half     2i          3p - i - 2    3p + g + 2i - 1   6p + g - i - 2

Published (T_F = T_B = T_W; activation memory in micro-batches of a whole stage, a chunk being
half of one): V-Min holds (p+4)//3 with a bubble rate of about 2p/3m, V-Half (p+2)//2 with about
p/2m, where 1F1B holds p with about p/m.
"""

from __future__ import annotations

from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule

__all__ = ["v_half", "v_min"]

F, IN, W = Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
BLOCK = 6  # slots per micro-batch on a rank: F, F, I, I, W, W


def v_min(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Min: about a third of 1F1B's activation memory."""
    p, g = num_ranks, 2 if num_ranks % 3 == 0 else 0
    offsets = [(i, 2 * p - i - 1, 2 * p + g + i, 4 * p + g - i - 1) for i in range(p)]
    return _v_schedule("v-min", p, num_microbatches, offsets)


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Half: about half of 1F1B's activation memory."""
    p, g = num_ranks, 3 if num_ranks % 2 == 0 else 0
    offsets = [(2 * i, 3 * p - i - 2, 3 * p + g + 2 * i - 1, 6 * p + g - i - 2) for i in range(p)]
    return _v_schedule("v-half", p, num_microbatches, offsets)


def _v_schedule(name: str, p: int, m: int, offsets: list[tuple[int, int, int, int]]) -> Schedule:
    streams = []
    for rank, (forward0, forward1, input1, input0) in enumerate(offsets):
        down, up = rank, 2 * p - 1 - rank  # this rank's stage in chunk 0 and in chunk 1
        slots: dict[int, Instruction] = {}
        for mb in range(m):
            base = BLOCK * mb
            slots[forward0 + base] = Instruction(down, F, mb)
            slots[forward1 + base] = Instruction(up, F, mb)
            slots[input1 + base] = Instruction(up, IN, mb)
            slots[input0 + base] = Instruction(down, IN, mb)
        order: list[Instruction] = []
        owed: list[Instruction] = []  # the W of every I done, earliest first
        slot, last = 0, max(slots)
        while slot <= last or owed:
            op = slots.get(slot)
            if op is not None:
                order.append(op)
                if op.kind is IN:
                    owed.append(Instruction(op.stage, W, op.microbatch))
            elif owed:  # a free slot: the oldest weight pass owed
                order.append(owed.pop(0))
            slot += 1
        streams.append(tuple(order))
    placement = tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return Schedule(name, p, m, 2, placement, tuple(streams))
