"""Per-layer costs of an nn.Sequential: parameters, memory, and measured forward/backward time.

A pure function of a model and a sample micro-batch, usable before launching anything.
Time is measured on a copy of each layer, so the model's parameters, gradients, buffers
(batch-norm statistics) and the random state are left exactly as they were.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipeengine.specs import Tensors, map_tensors, meta_copy, unpack

__all__ = ["LayerCosts", "measure"]

# per-parameter bytes held for training with an AdamW-like optimizer: weight, gradient, two moments
TRAINING_COPIES = 4


@dataclass(frozen=True)
class LayerCosts:
    """One entry per layer; None where it was not measured (no sample, or no timing asked)."""

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
        """Bytes a layer needs in training: its parameters with gradient and optimizer state, plus activations."""
        acts = self.activation_bytes or (0,) * len(self)
        return tuple(TRAINING_COPIES * p + a for p, a in zip(self.param_bytes, acts, strict=True))

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


def measure(
    model: nn.Sequential,
    sample: torch.Tensor | Tensors | None = None,
    *,
    timed: bool = False,
    repeats: int = 5,
    device: str | torch.device | None = None,
) -> LayerCosts:
    """Costs of every layer for one micro-batch ``sample`` (the first stage's input).

    Parameters always; activation bytes when a sample is given (meta device, no compute);
    forward and backward time when ``timed``: on ``device``, after one warm-up, the median
    of ``repeats`` runs, each layer fed the real output of the one before.
    """
    params = tuple(sum(p.numel() for p in layer.parameters()) for layer in model)
    param_bytes = tuple(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model)
    if sample is None:
        if timed:
            raise ValueError("timing the layers needs a sample micro-batch: pass sample=")
        return LayerCosts(params, param_bytes, None, None, None)
    activations = _activation_bytes(model, sample)
    if not timed:
        return LayerCosts(params, param_bytes, activations, None, None)
    forward, backward = _time_layers(model, sample, repeats, torch.device(device or "cpu"))
    return LayerCosts(params, param_bytes, activations, forward, backward)


def _activation_bytes(model: nn.Sequential, sample: torch.Tensor | Tensors) -> tuple[int, ...]:
    """Bytes each layer saves for its backward, counted on meta copies (parameters excluded)."""
    value = map_tensors(sample, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
    sizes = []
    for layer in model:
        copy_ = meta_copy(layer)
        weights = {id(p) for p in copy_.parameters()} | {id(b) for b in copy_.buffers()}
        saved: dict[int, int] = {}

        def pack(tensor: torch.Tensor, weights: set[int] = weights, saved: dict[int, int] = saved) -> torch.Tensor:
            base = tensor._base if tensor._base is not None else tensor
            if id(tensor) not in weights and id(base) not in weights:
                saved[id(tensor)] = tensor.numel() * tensor.element_size()
            return tensor

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            value = copy_(_leaves(value))
        sizes.append(sum(saved.values()))
    return tuple(sizes)


def _time_layers(
    model: nn.Sequential, sample: torch.Tensor | Tensors, repeats: int, device: torch.device
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    forward, backward = [], []
    value = map_tensors(sample, lambda t: t.to(device))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for layer in model:
            probe = copy.deepcopy(layer).to(device)
            times = [_run_once(probe, value, device) for _ in range(repeats + 1)][1:]  # the first warms up
            forward.append(statistics.median(t[0] for t in times))
            backward.append(statistics.median(t[1] for t in times))
            with torch.no_grad():
                value = probe(value)
            del probe
    return tuple(forward), tuple(backward)


def _run_once(layer: nn.Module, value: torch.Tensor | Tensors, device: torch.device) -> tuple[float, float]:
    """Forward and backward time of one layer on one input, synchronised on CUDA."""
    inputs = _leaves(value)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.enable_grad():
        output = unpack(layer(inputs))
    sync()
    middle = time.perf_counter()
    needs = [o for o in output if o.requires_grad]
    if needs:
        torch.autograd.backward(needs, [torch.ones_like(o) for o in needs])
    sync()
    end = time.perf_counter()
    layer.zero_grad(set_to_none=True)
    return middle - start, end - middle


def _leaves(value: torch.Tensor | Tensors) -> torch.Tensor | Tensors:
    """Fresh leaf inputs, floating ones requiring grad, as a stage receives them."""
    return map_tensors(value, lambda t: t.detach().requires_grad_(t.is_floating_point()))
