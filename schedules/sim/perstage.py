"""Per-stage numbers: one for every stage, or one per stage; checked and expanded in one place."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PerStage", "expand"]

PerStage = float | Sequence[float]


def expand(name: str, value: PerStage, num_stages: int) -> list[float]:
    """One float per stage; a ValueError naming ``name`` for a wrong count or a negative value."""
    if isinstance(value, (int, float)):
        values = [float(value)] * num_stages
    else:
        values = [float(x) for x in value]
        if len(values) != num_stages:
            raise ValueError(f"{name} has {len(values)} values, the schedule has {num_stages} stages")
    if any(x < 0 for x in values):
        raise ValueError(f"{name} must not be negative, got {values}")
    return values
