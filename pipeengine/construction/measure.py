"""The lean layer measurement: each layer's times (F, B, I, W) and bytes on a micro-batch, measured once.

The engine's partition (pipeengine.construction.partition: ``measure``, LayerCosts) reads it, and the planner's
profile (pipeengine.planner.measure.profile_layers) is it with the planner's extras (tensor-parallel shards, the
allocator, the host path warm), so both count time and bytes alike. Parameters are timed and counted on copies, the
random state forked: the model is left as it was.

On the CPU each timed run starts with the processor's caches flushed (pipeengine.construction.caches: a buffer the
size of its last-level cache written over): a rank meets its stage's weights cold, since between two of its computes
other layers, other micro-batches, communication and the ranks sharing the machine run (the same layer timed back
to back, its weights still cached, runs faster than in a pipeline's step: docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from pipeengine.construction.caches import flusher
from pipeengine.construction.layercosts import LayerCosts
from pipeengine.core.compiling import compile_in_place
from pipeengine.core.dtensors import local, settled, tensor_parallel_numel
from pipeengine.core.specs import Tensors, map_tensors, unpack
from pipeengine.observe.ledger import Ledger, storage
from pipeengine.step.backward import backward_input

__all__ = [
    "COLUMNS",
    "Extras",
    "WithLoss",
    "compiled",
    "graded",
    "layer_bytes",
    "leaves",
    "measure",
    "nbytes",
    "profile_columns",
    "time_layer",
]

# per layer: seconds of each compute (median), then bytes (layer_bytes')
COLUMNS = (
    "forward",
    "backward",
    "backward_input",
    "backward_weight",
    "parameter_bytes",
    "parameter_count",
    "output",
    "gradient",
    "saved_other",
    "saves_input",
    "saves_output",
    "kept",
    "output_kept",
    "other_freed",
    "saved",
)


def measure(
    model: nn.Sequential,
    sample: torch.Tensor | Tensors | None = None,
    *,
    timed: bool = False,
    repeats: int = 5,
    device: str | torch.device | None = None,
    compile: bool | Mapping[str, object] = False,
) -> LayerCosts:
    """Costs of every layer for one micro-batch ``sample`` (the first stage's input), with profile_columns.

    Parameters always; the bytes each layer saves for its backward when a sample is given; forward
    and backward time when ``timed``: on ``device``, after one warm-up, the median of ``repeats`` runs.
    """
    if sample is None:
        if timed:
            raise ValueError("timing the layers needs a sample micro-batch: pass sample=")
        return LayerCosts.of(None, model)
    if timed and repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    rows = unpack(sample)[0].shape[0]
    columns = profile_columns(
        list(model), sample, rows, repeats if timed else 0, torch.device(device or "cpu"), compile
    )
    lean = _Lean(timed, columns["saved"], columns["forward"], columns["backward"])  # type: ignore[arg-type]
    return LayerCosts.of(lean, model)


@dataclass(frozen=True)
class _Lean:
    """What LayerCosts reads of the columns (LayerCosts.of)."""

    timed: bool
    saved: tuple[int, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]


class Extras(Protocol):
    """What the planner measures of each layer beyond the columns (pipeengine.planner.measure), at three points of
    profile_columns' pass over the layers."""

    def prepare(
        self, index: int, layer: nn.Module, probe: nn.Module, value: torch.Tensor | Tensors, flush: Callable[[], None]
    ) -> tuple[nn.Module, Callable[[], None]]:
        """Before the copy ``probe`` of ``layer`` is compiled: the probe to measure, and what runs before each of its
        timed computes (``flush``, or more)."""

    def measured(self, probe: nn.Module, value: torch.Tensor | Tensors, first: bool) -> None:
        """After the probe's times and bytes."""

    def passed(self, layer: nn.Module, value: torch.Tensor | Tensors) -> None:
        """After the probe's forward (without gradients) made ``value``, the next layer's input."""


def profile_columns(
    model: Sequence[nn.Module],
    sample: torch.Tensor | Tensors,
    rows: int,
    repeats: int,
    device: torch.device,
    compile: bool | Mapping[str, object] = False,
    progress: Callable[[], None] | None = None,
    extras: Extras | None = None,
) -> dict[str, tuple[float | int | bool, ...]]:
    """Every layer measured on the first ``rows`` rows of ``sample``, each fed the real output of the one before:
    per column of COLUMNS a value a layer. ``repeats`` 0: bytes only (one forward and backward a layer), times 0.0.
    A layer is measured compiled where the engine runs it so (``compiled``). ``progress()`` after each layer."""
    value = map_tensors(sample, lambda t: t[:rows].to(device))
    columns: dict[str, list[float | int | bool]] = {key: [] for key in COLUMNS}
    flush = flusher(device) if repeats else (lambda: None)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for index, layer in enumerate(model):
            probe = copy.deepcopy(layer).to(device)
            first = index == 0  # the user's batch: no gradient wanted for it
            before = flush  # what runs before each timed compute
            if extras is not None:
                probe, before = extras.prepare(index, layer, probe, value, flush)
            probe = compiled(probe, layer, compile)
            runs = range(repeats + 1) if repeats else range(0)  # the first a warm-up
            timings = [time_layer(probe, value, first, device, before) for _ in runs][1:]
            for index_, key in enumerate(("forward", "backward", "backward_input", "backward_weight")):
                columns[key].append(statistics.median(t[index_] for t in timings) if timings else 0.0)
            sizes = layer_bytes(probe, value, first)
            for key, size in sizes.items():
                columns[key].append(size)
            if extras is not None:
                extras.measured(probe, value, first)
            with torch.no_grad():
                value = map_tensors(probe(value), local)
                if extras is not None:
                    extras.passed(layer, value)
            del probe
            if progress is not None:
                progress()
    return {key: tuple(values) for key, values in columns.items()}


def compiled(probe: nn.Module, layer: nn.Module, compile: bool | Mapping[str, object]) -> nn.Module:
    """The copy of ``layer`` to measure, compiled where the engine runs it so: the user compiled it, or ``compile``
    (the engine's compile=: True or torch.compile's keywords); a copy does not keep nn.Module.compile's compiled call:
    compiled again, as the user or compile= compiled the layer, with the user's own options unknown: torch.compile's
    defaults. A compiled layer's I then makes its weight gradients too, and its W is nothing
    (pipeengine.step.backward), as the engine runs it."""
    if compile or getattr(layer, "_compiled_call_impl", None) is not None:
        compile_in_place(probe, {} if isinstance(compile, bool) else compile)
    return probe


class WithLoss(nn.Module):
    """The last layer followed by the loss: what the last stage runs in training."""

    def __init__(self, layer: nn.Module, loss: Callable[..., torch.Tensor], target: torch.Tensor | Tensors) -> None:
        super().__init__()
        self.layer, self.loss, self.target = layer, loss, target

    def forward(self, value: object) -> torch.Tensor:
        return self.loss(self.layer(value), self.target)


def leaves(value: torch.Tensor | Tensors, first: bool) -> Tensors:
    return unpack(map_tensors(value, lambda t: t.detach().requires_grad_(t.is_floating_point() and not first)))


def graded(layer: nn.Module, inputs: Tensors, value: torch.Tensor | Tensors) -> list[torch.Tensor]:
    """The layer's outputs on ``inputs`` (``value``'s leaves: passed as a tuple where ``value`` is one) that a
    backward starts from, each settled (a tensor-parallel collective waited for)."""
    return [settled(o) for o in unpack(layer(inputs if isinstance(value, tuple) else inputs[0])) if o.requires_grad]


def time_layer(
    layer: nn.Module, value: torch.Tensor | Tensors, first: bool, device: torch.device, flush: Callable[[], None]
) -> tuple[float, ...]:
    """Forward, full backward, input-gradient (I) and weight-gradient (W) seconds of one layer on one input,
    each through the engine's own code (pipeengine.step.backward for I and W, as a zero-bubble stage runs them),
    each after ``flush()`` (the CPU's caches emptied)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    params = [p for p in layer.parameters() if p.requires_grad]

    def forward(timed: bool = True) -> tuple[Tensors, list[torch.Tensor], float]:
        inputs = leaves(value, first)
        with torch.enable_grad():
            sync()
            if timed:
                flush()
            start = time.perf_counter()
            outputs = graded(layer, inputs, value)
            sync()
        return inputs, outputs, time.perf_counter() - start

    inputs, outputs, forward_time = forward()
    grads = tuple(torch.ones_like(o) for o in outputs)
    flush()
    start = time.perf_counter()
    if outputs:
        torch.autograd.backward(outputs, grads)
    sync()
    backward_time = time.perf_counter() - start
    inputs, outputs, _ = forward(timed=False)
    flush()
    start = time.perf_counter()
    weight_pass = backward_input(tuple(outputs), grads, inputs, params)[1] if outputs else None
    sync()
    input_time = time.perf_counter() - start
    flush()
    start = time.perf_counter()
    if weight_pass is not None:
        weight_pass.run()
    sync()
    weight_time = time.perf_counter() - start
    layer.zero_grad(set_to_none=True)
    return forward_time, backward_time, input_time, weight_time


def layer_bytes(layer: nn.Module, value: torch.Tensor | Tensors, first: bool) -> dict[str, int | bool]:
    """What one micro-batch's forward through the layer leaves for its backward, by storage."""
    inputs = leaves(value, first)
    target = layer.target if isinstance(layer, WithLoss) else ()
    ledger = Ledger(ignore=[*layer.parameters(), *unpack(target)])
    with ledger.watching(), torch.enable_grad():
        outputs = tuple(settled(o) for o in unpack(layer(inputs if isinstance(value, tuple) else inputs[0])))
        saved = {key: entry.bytes for key, entry in ledger.saved.items()}  # storage -> bytes
    mine = dict(storage(t) for t in inputs if t.numel())
    made = dict(storage(t) for t in outputs if t.numel())
    # the last stage keeps a new scalar (the loss, weighted) and lets the loss's own output go: count its elements
    output = sum(t.numel() * t.element_size() for t in outputs) if isinstance(layer, WithLoss) else sum(made.values())
    gradient = sum(t.numel() * t.element_size() for t in outputs if t.is_floating_point())
    other = [key for key in saved if key not in mine and key not in made]
    kept, output_kept, other_freed = 0, any(key in saved for key in made), 0
    needing = tuple(o for o in outputs if o.requires_grad)
    if needing and any(x.requires_grad for x in inputs):  # what I keeps for W, as a zero-bubble stage's would
        params = [p for p in layer.parameters() if p.requires_grad]
        grads = tuple(torch.ones_like(o) for o in needing)
        _, weight_pass = backward_input(needing, grads, inputs, params)
        storages = dict(storage(g) for root in weight_pass.roots for g in root.kept if g is not None)
        kept = sum(storages.values())
        # the output outlives I only if W needs it: the nodes above W's restart points go with the output
        shown = weight_pass.fallback[0] if weight_pass.fallback is not None else ()
        del outputs, needing
        output_kept = all(ledger.holds(key, shown) for key in made)
        other_freed = sum(saved[key] for key in other if not ledger.holds(key, shown))
    return {
        "kept": kept,
        "parameter_bytes": sum(nbytes(p) for p in layer.parameters()),
        "parameter_count": sum(tensor_parallel_numel(p) for p in layer.parameters()),
        "saved": sum(saved.values()),
        "output": output,
        "gradient": gradient,
        "saved_other": sum(saved[key] for key in other),
        "saves_input": any(key in saved for key in mine),
        "saves_output": any(key in saved for key in made),
        "output_kept": output_kept,
        "other_freed": other_freed,
    }


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of a parameter: a tensor-parallel shard where the plan split it."""
    return tensor_parallel_numel(tensor) * tensor.element_size()
