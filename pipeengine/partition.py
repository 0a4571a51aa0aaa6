"""Cut an nn.Sequential into contiguous stages that keep the original layer names."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

__all__ = ["uniform_partition", "stage_module"]

Bounds = list[tuple[int, int]]  # per stage: layers [start, end)


def uniform_partition(num_layers: int, num_stages: int) -> Bounds:
    """Equal layer counts; the first ``num_layers % num_stages`` stages get one layer more."""
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} stages but the model has {num_layers} layers: every stage needs at least one layer; "
            f"use at most {num_layers} ranks x chunks, or split the model into more nn.Sequential layers"
        )
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


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


def stage_module(model: nn.Sequential, start: int, end: int) -> nn.Sequential:
    """Layers [start, end) as an nn.Sequential whose parameter names are the model's ("6.weight")."""
    named = list(model.named_children())[start:end]
    return nn.Sequential(OrderedDict(named))
