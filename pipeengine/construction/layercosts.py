"""LayerCosts: what the partitioner balances, one entry per layer, as the lean measurement
(pipeengine.construction.measure) or the planner's profile (pipeengine.planner.costmodel.LayerProfile) found it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from schedules import state_bytes

__all__ = ["LayerCosts", "Measured"]


class Measured(Protocol):
    """What LayerCosts reads of a layer profile: per layer, the bytes saved for backward and, where ``timed``, the
    forward and backward seconds (a LayerProfile, pipeengine.planner.costmodel, is one)."""

    @property
    def timed(self) -> bool: ...

    @property
    def saved(self) -> tuple[int, ...]: ...

    @property
    def forward(self) -> tuple[float, ...]: ...

    @property
    def backward(self) -> tuple[float, ...]: ...


@dataclass(frozen=True)
class LayerCosts:
    """What the partitioner balances, one entry per layer; None where it was not measured (no sample, or no
    timing asked). A view of a layer profile (``LayerCosts.of``); broadcast as rows by the engine."""

    params: tuple[int, ...]  # parameter count
    param_bytes: tuple[int, ...]
    activation_bytes: tuple[int, ...] | None  # saved for backward, per micro-batch
    forward: tuple[float, ...] | None  # seconds, median
    backward: tuple[float, ...] | None  # seconds, median

    def __len__(self) -> int:
        return len(self.params)

    @property
    def time(self) -> tuple[float, ...] | None:
        if self.forward is None or self.backward is None:
            return None
        return tuple(f + b for f, b in zip(self.forward, self.backward, strict=True))

    @property
    def memory(self) -> tuple[int, ...]:
        """Bytes a layer needs in training: its parameters with gradient and AdamW's two copies (state_bytes, as
        the planner counts them), plus what it saves for backward."""
        acts = self.activation_bytes or (0,) * len(self)
        return tuple(int(state_bytes(p)) + a for p, a in zip(self.param_bytes, acts, strict=True))

    def held_as(self, found: Mapping[int, tuple[int, int]], alike: bool) -> LayerCosts:
        """These costs with the layers of ``found`` as a tensor-parallel rank holds them ((parameters, bytes) by layer
        index), the others whole; with ``alike`` (a dry run, which builds some ranks alone), a layer not found as
        large as one found is taken to shard alike."""
        wholes = list(zip(self.params, self.param_bytes, strict=True))
        same = {wholes[i]: held for i, held in found.items()} if alike else {}
        held = [found.get(i) or same.get(whole, whole) for i, whole in enumerate(wholes)]
        return dataclasses.replace(self, params=tuple(n for n, _ in held), param_bytes=tuple(b for _, b in held))

    @classmethod
    def of(cls, profile: Measured | None, model: Iterable[nn.Module]) -> LayerCosts:
        """The partitioner's view of a profile (None: parameters only, nothing run)."""
        params = tuple(sum(p.numel() for p in layer.parameters()) for layer in model)
        param_bytes = tuple(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model)
        if profile is None:
            return cls(params, param_bytes, None, None, None)
        timed = profile.timed
        return cls(
            params, param_bytes, profile.saved, profile.forward if timed else None, profile.backward if timed else None
        )

    def to_rows(self) -> list[list[float]]:
        """As rows of floats (for a broadcast): params, bytes, activations, forward, backward; -1 is missing."""
        n = len(self)
        missing = [-1.0] * n
        return [
            [float(x) for x in self.params],
            [float(x) for x in self.param_bytes],
            [float(x) for x in self.activation_bytes] if self.activation_bytes is not None else missing,
            list(self.forward) if self.forward is not None else missing,
            list(self.backward) if self.backward is not None else missing,
        ]

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[float]]) -> LayerCosts:
        def optional(row: Sequence[float]) -> tuple[float, ...] | None:
            return None if row and row[0] < 0 else tuple(row)

        acts = optional(rows[2])
        return cls(
            tuple(int(x) for x in rows[0]),
            tuple(int(x) for x in rows[1]),
            tuple(int(x) for x in acts) if acts is not None else None,
            optional(rows[3]),
            optional(rows[4]),
        )
