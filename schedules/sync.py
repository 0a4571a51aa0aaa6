"""Gradient synchronisation: the pass that adds a data-parallel all-reduce per stage.

Each stage's all-reduce (``sAR k``) goes right after the stage's last gradient compute (its
last B, or W under a split backward), so it runs while the rank computes other stages
and micro-batches, and is waited on at the end of the step.
"""

from __future__ import annotations

from schedules.instructions import Action, Instruction, Kind
from schedules.schedule import Schedule

__all__ = ["with_gradient_sync"]

_GRADIENT = (Kind.BACKWARD, Kind.BACKWARD_WEIGHT)  # computes that finish a stage's parameter gradients


def with_gradient_sync(schedule: Schedule) -> Schedule:
    """The schedule with one all-reduce per stage after its last parameter-gradient compute."""
    streams = []
    for stream in schedule.instructions:
        last: dict[int, int] = {}  # stage -> step of its last gradient compute
        for step, action in enumerate(stream):
            if isinstance(action, Instruction) and action.kind in _GRADIENT:
                last[action.stage] = step
        synced: list[Action] = []
        for step, action in enumerate(stream):
            synced.append(action)
            for stage, at in last.items():
                if at == step:
                    synced.append(Instruction(stage, Kind.ALL_REDUCE, action.microbatch))  # type: ignore[union-attr]
        streams.append(synced)
    return schedule.with_streams(streams)
