"""DualPipeV: DeepSeek-V3's DualPipe cut in half (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024;
the order of deepseek-ai/DualPipe's dualpipev.py).

Two chunks per rank in a V, as ZB-V: stage r and stage 2p-1-r on rank r, so a micro-batch runs
down the ranks and back, and its loss is on rank 0. Each rank runs eight phases; in the middle
one it alternates a forward of one chunk with a full backward of the other (F0 B1, F1 B0), the
pairs DualPipe overlaps on a GPU (one pair's communication under the other's compute). Here a
pair is two instructions in a row: the order, not the overlap. Near the ends some backwards are
split (I now, W later, oldest first) to fill the ramps.

    phase  count        per iteration (chunk 0 = stage r, chunk 1 = stage 2p-1-r)
    1      2(p-r-1)     F0
    2      r+1          F0 F1
    3      p-r-1        I1 W F1
    4      m-2p+r+1     F0 B1 F1 B0
    5      p-r-1        B1 F1 B0
    6      r+1          B1 B0, split (I) from the middle iteration on
    7      p-r-1        W I0
    8      r+1          W

Needs m >= 2p. Published (per rank, chunk costs F, B, W; F&B a pair): bubble (p-1)(F&B + B - 3W),
activations of 2p+1 chunks, where 1F1B over 2p such stages on 2p ranks idles (2p-1)(F+B).
"""

from __future__ import annotations

from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule

__all__ = ["check_dualpipe_v", "dualpipe_v"]

F, B, IN, W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


def check_dualpipe_v(num_ranks: int, num_microbatches: int) -> None:
    if num_microbatches < 2 * num_ranks:
        raise ValueError(
            f"'dualpipe-v' needs at least 2 micro-batches per rank (m >= 2p = {2 * num_ranks}), got "
            f"num_microbatches={num_microbatches}: use {2 * num_ranks} or more, or fewer ranks"
        )


def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV's compute order for p ranks and m >= 2p micro-batches."""
    check_dualpipe_v(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    streams = tuple(tuple(_Rank(p, m, r).order()) for r in range(p))
    placement = tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return Schedule("dualpipe-v", p, m, 2, placement, streams)


class _Rank:
    """One rank's stream: per chunk, the next micro-batch to forward and to backward; W owed, oldest first."""

    def __init__(self, p: int, m: int, rank: int) -> None:
        self.p, self.m, self.rank = p, m, rank
        self.stages = (rank, 2 * p - 1 - rank)
        self.forwarded, self.backwarded = [0, 0], [0, 0]
        self.owed: list[Instruction] = []
        self.stream: list[Instruction] = []

    def forward(self, chunk: int) -> None:
        self.stream.append(Instruction(self.stages[chunk], F, self.forwarded[chunk]))
        self.forwarded[chunk] += 1

    def backward(self, chunk: int, split: bool = False) -> None:
        stage, mb = self.stages[chunk], self.backwarded[chunk]
        self.stream.append(Instruction(stage, IN if split else B, mb))
        if split:
            self.owed.append(Instruction(stage, W, mb))
        self.backwarded[chunk] += 1

    def weight(self) -> None:
        self.stream.append(self.owed.pop(0))

    def order(self) -> list[Instruction]:
        p, m, r = self.p, self.m, self.rank
        for _ in range(2 * (p - r - 1)):
            self.forward(0)
        for _ in range(r + 1):
            self.forward(0)
            self.forward(1)
        for _ in range(p - r - 1):
            self.backward(1, split=True)
            self.weight()
            self.forward(1)
        for _ in range(m - 2 * p + r + 1):
            self.forward(0)
            self.backward(1)
            self.forward(1)
            self.backward(0)
        for _ in range(p - r - 1):
            self.backward(1)
            self.forward(1)
            self.backward(0)
        half, split = (r + 1) // 2, False
        for i in range(r + 1):
            split = split or (i == half and r % 2 == 1)
            self.backward(1, split)
            split = split or (i == half and r % 2 == 0)
            self.backward(0, split)
        for _ in range(p - r - 1):
            self.weight()
            self.backward(0, split=True)
        while self.owed:
            self.weight()
        return self.stream
