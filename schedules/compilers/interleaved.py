"""Interleaved 1F1B: v model chunks per rank, looped placement (Narayanan et al., 2021, sec. 2.2)."""

from __future__ import annotations

from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule

__all__ = ["check_rounds", "interleaved_1f1b"]


def check_rounds(num_ranks: int, num_microbatches: int) -> None:
    """Micro-batches go through the chunks in rounds of p: m must be a multiple of p."""
    p, m = num_ranks, num_microbatches
    if m % p != 0:
        nearest = " or ".join(str(n) for n in (m - m % p, m - m % p + p) if n > 0)
        raise ValueError(
            f"interleaved 1F1B sends micro-batches through the chunks in rounds of p={p}, so the number "
            f"of micro-batches must be a multiple of {p}, got {m}; use {nearest}"
        )


def interleaved_1f1b(num_ranks: int, num_microbatches: int, chunks: int) -> Schedule:
    """Megatron-LM's interleaved schedule: stage k runs on rank k mod p.

    Micro-batches go through the chunks in rounds of p, so m must be a multiple of p.
    Rank r warms up with (v-1)*p + 2*(p-r-1) forwards (capped at v*m), then alternates.
    Bubble (p-1)/(v*m+p-1) at unit costs. Unit-cost timing (F=1, B=2), p=2, m=2, v=2 (stages 0, 2 on rank 0)::

        rank 0: 0F0 0F1 2F0 2F1 .   .   2B0 2B0 .   2B1 2B1 0B0 0B0 0B1 0B1
        rank 1: .   1F0 1F1 3F0 3B0 3B0 3F1 3B1 3B1 1B0 1B0 1B1 1B1 .   .
    """
    p, m, v = num_ranks, num_microbatches, chunks
    check_rounds(p, m)
    total = m * v  # (chunk, micro-batch) pairs per rank

    def virtual(k: int, kind: Kind, rank: int) -> Instruction:
        # k-th forward (or backward) of a rank: chunk advances every p, micro-batch group every p*v
        chunk = (k // p) % v
        if kind is Kind.BACKWARD:
            chunk = v - 1 - chunk
        microbatch = (k // (p * v)) * p + k % p
        return Instruction(chunk * p + rank, kind, microbatch)

    streams = []
    for rank in range(p):
        warmup = min((v - 1) * p + 2 * (p - rank - 1), total)
        order = [virtual(k, Kind.FORWARD, rank) for k in range(warmup)]
        for k in range(total - warmup):
            order.append(virtual(warmup + k, Kind.FORWARD, rank))
            order.append(virtual(k, Kind.BACKWARD, rank))
        order += [virtual(k, Kind.BACKWARD, rank) for k in range(total - warmup, total)]
        streams.append(tuple(order))
    placement = tuple(stage % p for stage in range(p * v))
    return Schedule("interleaved", p, m, v, placement, tuple(streams))
