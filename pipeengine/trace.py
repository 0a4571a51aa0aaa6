"""Tracing: when each instruction ran on this rank, gathered to rank 0 as a schedules.Timeline.

CPU marks are time.perf_counter(). After a traced step, rank 0 estimates every rank's
clock offset by ping-pong (NTP's rule: of a few round trips, trust the fastest, error
at most half its round trip) and puts all spans on its own clock:

    rank 0   t0 ──ping──►        ◄──pong(t_r)── t1      offset_r = t_r - (t0 + t1) / 2
    rank r          └─ reads its clock t_r ─┘

CUDA marks are events on the compute stream, read once at the end of the traced step
(the only place tracing synchronises), with time zero taken as the step header's
all_gather returns on each rank: aligned to about the collective's skew.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from schedules import Action, Span, Timeline

__all__: list[str] = []

Mark = float | torch.cuda.Event
PINGS = 8  # round trips per rank for the clock offset


class Tracer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.records: list[tuple[Action, Mark, Mark, bool]] = []
        self.origin: Mark = 0.0

    def begin(self) -> None:
        """Start a step's trace: time zero is now."""
        self.records = []
        self.origin = self.mark()

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, action: Action, start: Mark, end: Mark, wait: bool = False) -> None:
        self.records.append((action, start, end, wait))

    def spans(self, rank: int) -> list[Span]:
        """This rank's spans in seconds since the step began."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()
            origin = self.origin

            def seconds(mark: Mark) -> float:
                return float(origin.elapsed_time(mark)) / 1e3  # type: ignore[union-attr, arg-type]
        else:

            def seconds(mark: Mark) -> float:
                return float(mark) - float(self.origin)  # type: ignore[arg-type]

        return [Span(rank, action, seconds(a), seconds(b), wait) for action, a, b, wait in self.records]

    def gather(self, num_ranks: int, label: str, group: dist.ProcessGroup | None) -> Timeline | None:
        """Every rank's spans on rank 0's clock, as one Timeline on group rank 0; None on the others."""
        rank = dist.get_rank(group)
        offsets = [0.0] * num_ranks if self.cuda else _clock_offsets(rank, num_ranks, group, self.device)
        origin = 0.0 if self.cuda else float(self.origin)  # type: ignore[arg-type]
        mine = (origin, self.spans(rank))
        gathered: list[tuple[float, list[Span]]] | None = [(0.0, [])] * num_ranks if rank == 0 else None
        dist.gather_object(mine, gathered, group_dst=0, group=group)
        if gathered is None:
            return None
        base = gathered[0][0]
        spans = []
        for r, (their_origin, their_spans) in enumerate(gathered):
            shift = their_origin - offsets[r] - base  # their time zero, on rank 0's clock, since rank 0's zero
            spans += [Span(s.rank, s.action, s.start + shift, s.end + shift, s.wait) for s in their_spans]
        return Timeline(num_ranks, spans, label=label, unit="s", measured=True)


def _clock_offsets(rank: int, num_ranks: int, group: dist.ProcessGroup | None, device: torch.device) -> list[float]:
    """On rank 0: each rank's clock minus rank 0's (seconds); zeros elsewhere."""
    offsets = [0.0] * num_ranks
    stamp = torch.zeros(1, dtype=torch.float64, device=device)
    for peer in range(1, num_ranks):
        if rank == 0:
            best = (float("inf"), 0.0)
            for _ in range(PINGS):
                sent = time.perf_counter()
                dist.send(stamp, group_dst=peer, group=group)
                dist.recv(stamp, group_src=peer, group=group)
                back = time.perf_counter()
                best = min(best, (back - sent, float(stamp.item()) - (sent + back) / 2))
            offsets[peer] = best[1]
        elif rank == peer:
            for _ in range(PINGS):
                dist.recv(stamp, group_src=0, group=group)
                stamp.fill_(time.perf_counter())
                dist.send(stamp, group_dst=0, group=group)
    return offsets
