"""A layer's cost on a device from its traced ops (pipeengine.planner.cluster.costs.trace): totals per phase and
kind, and seconds per phase as a roofline per op at the device's peak, efficiency and memory bandwidth."""

from __future__ import annotations

import time as _time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeengine.planner.cluster.costs import KINDS, PHASES, Kind, Op, Phase, trace

__all__ = ["Efficiency", "LayerCost", "PhaseCost", "PhaseTimes"]


@dataclass(frozen=True)
class PhaseCost:
    """A phase's totals per kind."""

    flops: dict[Kind, int]
    bytes: dict[Kind, int]


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds of a forward and of a backward on the device."""

    forward: float
    backward: float


Efficiency = float | Callable[[Op], float]


def _efficiency(efficiency: Efficiency, op: Op) -> float:
    value = efficiency(op) if callable(efficiency) else efficiency
    if not 0 < value <= 1:
        raise ValueError(f"an efficiency is a fraction of the peak in (0, 1]: {value} for {op.name} at {op.shapes}")
    return value


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")


@dataclass(frozen=True)
class LayerCost:
    """A layer's recorded ops, their totals per phase and kind, and their time on a device (a roofline per op)."""

    ops: tuple[Op, ...]
    trace_seconds: float = field(default=0.0, compare=False)  # how long the trace took here

    @classmethod
    def of(
        cls,
        module: torch.nn.Module,
        *example_inputs: Any,
        backward: bool = True,
        example_kwargs: Mapping[str, Any] | None = None,
        fused: bool = True,
    ) -> LayerCost:
        """Trace ``module`` on meta inputs (``trace``) and keep its ops."""
        start = _time.perf_counter()
        ops = trace(module, *example_inputs, backward=backward, example_kwargs=example_kwargs, fused=fused)
        return cls(tuple(ops), _time.perf_counter() - start)

    def phase(self, phase: Phase) -> PhaseCost:
        flops: dict[Kind, int] = dict.fromkeys(KINDS, 0)
        moved: dict[Kind, int] = dict.fromkeys(KINDS, 0)
        for op in self.ops:
            if op.phase == phase:
                flops[op.kind] += op.flops
                moved[op.kind] += op.bytes
        return PhaseCost(flops, moved)

    @property
    def forward(self) -> PhaseCost:
        return self.phase("forward")

    @property
    def backward(self) -> PhaseCost:
        return self.phase("backward")

    def flops(self, phase: Phase | None = None, kind: Kind | None = None) -> int:
        return sum(op.flops for op in self.ops if phase in (None, op.phase) and kind in (None, op.kind))

    def bytes(self, phase: Phase | None = None, kind: Kind | None = None) -> int:
        return sum(op.bytes for op in self.ops if phase in (None, op.phase) and kind in (None, op.kind))

    def time(
        self,
        peak_flops: float,
        matmul_efficiency: Efficiency,
        memory_bandwidth: float,
        vector_flops: float | None = None,
        attention_efficiency: Efficiency | None = None,
    ) -> PhaseTimes:
        """Seconds per phase: the sum over ops of max(compute time, memory time).

        ``peak_flops``: the tensor-core peak (FLOP/s) at the layer's dtype; ``matmul_efficiency``: the fraction
        of it a matmul reaches, a number or a function of the op (its shapes, its dtype: measured or preset);
        ``attention_efficiency``: the same for attention kernels (default: the matmul's); ``memory_bandwidth``:
        bytes/s; ``vector_flops``: the peak of the non-tensor-core units, for other ops (default: peak_flops; ops
        outside the flop registry count no FLOPs, so those are priced by their bytes).
        """
        vector = peak_flops if vector_flops is None else vector_flops
        _positive(peak_flops=peak_flops, memory_bandwidth=memory_bandwidth, vector_flops=vector)
        attention = matmul_efficiency if attention_efficiency is None else attention_efficiency
        seconds: dict[Phase, float] = dict.fromkeys(PHASES, 0.0)
        for op in self.ops:
            if op.kind == "matmul":
                compute = op.flops / (peak_flops * _efficiency(matmul_efficiency, op)) if op.flops else 0.0
            elif op.kind == "attention":
                compute = op.flops / (peak_flops * _efficiency(attention, op)) if op.flops else 0.0
            else:
                compute = op.flops / vector
            seconds[op.phase] += max(compute, op.bytes / memory_bandwidth)
        return PhaseTimes(seconds["forward"], seconds["backward"])
