"""Forward-only schedules, for evaluation: the forwards of a training schedule, lowered."""

from __future__ import annotations

from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule
from schedules.passes.lowering import lower

__all__ = ["forward_only"]


def forward_only(schedule: Schedule) -> Schedule:
    """Keep each rank's forwards in their training order and lower them again.

    No backward means no activation is held past its send, so the order of the
    training schedule's forwards is all that matters.
    """
    forwards = (
        (a for a in stream if isinstance(a, Instruction) and a.kind is Kind.FORWARD) for stream in schedule.instructions
    )
    return lower(schedule.with_streams(forwards, name=f"{schedule.name}/forward"))
