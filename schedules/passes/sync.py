"""Gradient synchronisation passes: a data-parallel all-reduce per stage, and a sum per group of tied weights.

Each goes right after the last gradient compute (B, or W under a split backward) that touches
what it reduces on that rank, so it runs while the rank computes other stages and micro-batches,
and is waited on at the end of the step:

    sARk   stage s's gradients averaged over the data-parallel replicas (after its last B or W)
    sTRg   the weights of tie group g (schedule.tied[g]) summed over the ranks that hold them, after
           the last B or W on this rank of any stage of the group that it hosts (stage s); none on a
           rank that holds the whole group (a V placement's first and last stage): that tie is local
"""

from __future__ import annotations

from schedules.ir.instructions import Action, Instruction, Kind
from schedules.ir.schedule import Schedule

__all__ = ["tie_ranks", "with_gradient_sync", "with_tie_sync"]

_GRADIENT = (Kind.BACKWARD, Kind.BACKWARD_WEIGHT)  # computes that finish a stage's parameter gradients


def with_gradient_sync(schedule: Schedule) -> Schedule:
    """The schedule with one all-reduce per stage after its last parameter-gradient compute."""
    streams = []
    for stream in schedule.instructions:
        last = _last_gradients(stream)
        synced: list[Action] = []
        for index, action in enumerate(stream):
            synced.append(action)
            synced += [
                Instruction(stage, Kind.ALL_REDUCE, action.microbatch)  # type: ignore[union-attr]
                for stage, at in last.items()
                if at == index
            ]
        streams.append(synced)
    return schedule.with_streams(streams)


def tie_ranks(schedule: Schedule, group: int) -> tuple[int, ...]:
    """The ranks that hold tie group ``group``'s stages, in order."""
    return tuple(sorted({schedule.placement[s] for s in schedule.tied[group]}))


def with_tie_sync(schedule: Schedule) -> Schedule:
    """The schedule with, on each rank of every tie group that spans ranks, one TR after the group's last gradient."""
    spanning = [g for g in range(len(schedule.tied)) if len(tie_ranks(schedule, g)) > 1]
    streams = []
    for stream in schedule.instructions:
        last = _last_gradients(stream)
        after = {}  # group -> (index, stage) of the last gradient compute of its stages on this rank
        for group in spanning:
            mine = [(last[s], s) for s in schedule.tied[group] if s in last]
            if mine:
                after[group] = max(mine)
        synced: list[Action] = []
        for index, action in enumerate(stream):
            synced.append(action)
            synced += [
                Instruction(stage, Kind.TIE_REDUCE, group) for group, (at, stage) in after.items() if at == index
            ]
        streams.append(synced)
    return schedule.with_streams(streams)


def _last_gradients(stream: tuple[Action, ...]) -> dict[int, int]:
    """Stage -> the index of its last gradient compute (B or W) in a rank's stream."""
    last: dict[int, int] = {}
    for index, action in enumerate(stream):
        if isinstance(action, Instruction) and action.kind in _GRADIENT:
            last[action.stage] = index
    return last
