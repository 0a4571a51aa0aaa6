"""Where a model is cut: each stage's layers [start, end), checked; a stage as a module under the model's names."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

__all__ = ["Bounds", "bounds_from_counts", "check_bounds", "check_counts", "stage_module"]

Bounds = list[tuple[int, int]]  # per stage: layers [start, end)


def check_bounds(bounds: Sequence[tuple[int, int]], num_layers: int) -> Bounds:
    """Bounds must tile the layers in order, each stage non-empty."""
    expected_start = 0
    for stage, (start, end) in enumerate(bounds):
        if start != expected_start or end <= start:
            raise ValueError(
                f"stage {stage} covers layers [{start}, {end}); stages must cover layers 0..{num_layers - 1} "
                f"in order, each with at least one layer (got {list(bounds)})"
            )
        expected_start = end
    if expected_start != num_layers:
        raise ValueError(f"the stages cover {expected_start} layers, the model has {num_layers} (got {list(bounds)})")
    return list(bounds)


def bounds_from_counts(counts: Sequence[int], num_layers: int) -> Bounds:
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return check_bounds([(a, a + n) for a, n in zip(starts, counts, strict=True)], num_layers)


def check_counts(counts: Sequence[int], num_stages: int) -> list[int]:
    """An explicit partition: the layers of each stage, one count per stage of the schedule."""
    counts = list(counts)
    if len(counts) != num_stages:
        raise ValueError(f"partition lists {len(counts)} stages, the schedule has {num_stages}: {counts}")
    return counts


def stage_module(model: nn.Sequential, start: int, end: int) -> nn.Sequential:
    """Layers [start, end) as an nn.Sequential whose parameter names are the model's ("6.weight")."""
    named = list(model.named_children())[start:end]
    return nn.Sequential(OrderedDict(named))
