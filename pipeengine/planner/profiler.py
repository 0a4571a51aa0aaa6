"""The one layer profiler: each layer's times (F, B, I, W) and bytes on a micro-batch, measured once.

The partitioner (pipeengine.planner.partition: LayerCosts, ``measure``) and the planner
(pipeengine.planner.tune: ``stage_costs``) both read it, so both count time and bytes alike.
Parameters are timed and counted on copies, the random state forked: the model is left as it was.
A stage's time is the sum of its layers'. Its bytes are counted as the engine's memory ledger counts a
step (pipeengine.observe.ledger): what one micro-batch holds from F to B is the stage's input (not the
first stage's: the user's batch), its output, what each layer saves beyond its input and output,
and a layer's output inside the stage only if that layer or the next one saves it::

    activation(a..b) = input(a) + sum saved_other(l) + sum out(l) [l or l+1 saves it] + out(b-1)

A split backward's I keeps, until W, everything saved and the gradient arriving at each node with
weights beneath it (measured per layer through pipeengine.runtime.backward), and lets the stage's output go
unless W needs it (something beneath W's restart points saved it), and what each layer saved for
nodes above them (measured per layer: such tensors are the layer's own); on the first stage, whose
input needs no gradient, W is the whole backward and keeps the received gradient instead. A step's
state (weights, gradients, the optimizer's copies) is schedules.state_bytes of the parameters.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipeengine.core.specs import Tensors, map_tensors, unpack
from pipeengine.observe.ledger import Ledger
from pipeengine.parallel.fsdp import priced
from pipeengine.planner import transients
from pipeengine.runtime.backward import backward_input
from schedules import Costs, Memory, state_bytes

__all__ = ["LayerCosts", "LayerProfile", "measure", "profile_layers"]


@dataclass(frozen=True)
class LayerProfile:
    """Per layer, on micro-batches of ``rows`` rows: seconds and bytes."""

    rows: int
    forward: tuple[float, ...]  # seconds, median (zeros where not timed)
    backward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    parameter_bytes: tuple[int, ...]
    parameter_count: tuple[int, ...]  # elements: bytes / count is the dtype's size, whatever it is
    output: tuple[int, ...]  # bytes of the layer's output (the boundary after it)
    gradient: tuple[int, ...]  # bytes of its output's gradient (the floating part)
    saved_other: tuple[int, ...]  # saved for backward beyond the layer's input and output
    saves_input: tuple[bool, ...]
    saves_output: tuple[bool, ...]
    kept: tuple[int, ...]  # what a split backward's I keeps for W (the gradient at each node with weights)
    output_kept: tuple[bool, ...]  # whether the output is still held after I (something W needs saved it)
    other_freed: tuple[int, ...]  # of saved_other, what I lets go (saved by nodes W does not need)
    saved: tuple[int, ...]  # everything the layer saves for its backward (its input and output too), parameters not
    timed: bool = True
    # per layer, (index among the model's parameters, bytes) of each parameter it holds: a weight tied across layers
    # (an embedding and its head) has one index, and a rank that holds it twice holds it once
    parameters: tuple[tuple[tuple[int, int], ...], ...] = ()
    allocations: tuple[transients.Allocation, ...] = ()  # as the allocator saw each layer (where it was watched)

    def stage_costs(
        self, bounds: Sequence[tuple[int, int]], *, overhead: float = 0.0, latency: float = 0.0,
        per_byte: float = 0.0, optimizer_copies: int = 2, buffered_sends: bool = True,
        placement: Sequence[int] | None = None, data_parallel: int = 1, fsdp: bool = False,
    ) -> Costs:  # fmt: skip
        """The simulator's Costs (time and memory) for stages of these layers (``bounds``: [start, end) each).

        ``overhead``: seconds of host time per compute beyond its kernels; ``latency`` and ``per_byte``
        price a message across a boundary. ``placement`` (stage -> rank): a parameter that several stages of a
        rank hold (a tied embedding and head, both on rank 0 of a V) is that rank's state once, with the first.
        With the allocator's measurements: each compute's transient peak, the gradients made by a stage's first
        B or W (an optimizer's zero_grad sets them to None), the all-reduce's flat buffers (``data_parallel``
        > 1) and the optimizer step over each rank's parameters (AdamW), as the simulator's memory model has them.
        ``fsdp``: the state sharded over the ``data_parallel`` replicas, the parameters gathered whole from a
        stage's first F to its AR and its whole gradients from its first B or W to the AR.
        """

        def total(values: Sequence[float], a: int, b: int) -> float:
            return float(sum(values[a:b]))

        activation, after_input, state, boundary, gradient, keeps_out, keeps_in = [], [], [], [], [], [], []
        for index, (a, b) in enumerate(bounds):
            held = (self.output[a - 1] if a > 0 else 0) + total(self.saved_other, a, b) + self.output[b - 1]
            held += sum(self.output[k] for k in range(a, b - 1) if self.saves_output[k] or self.saves_input[k + 1])
            last = index == len(bounds) - 1
            if a > 0:  # I keeps the gradient arriving at each node with weights, for W; the output goes, unless saved
                kept = total(self.kept, a, b) - total(self.other_freed, a, b)
                kept -= 0 if self.output_kept[b - 1] else self.output[b - 1]  # on the last stage: the loss
            else:  # the first stage's W is its whole backward: it keeps the received gradient instead
                kept = 0 if last else self.gradient[b - 1]
            activation.append(held)
            after_input.append(held + kept)
            keeps_out.append(1.0 if a == 0 or self.output_kept[b - 1] else 0.0)  # the first stage keeps all for W
            keeps_in.append(1.0 if a == 0 or self.saves_input[a] else 0.0)
            state.append(state_bytes(self._state_of(index, bounds, placement), optimizer_copies))
            boundary.append(0.0 if last else float(self.output[b - 1]))
            gradient.append(0.0 if last else float(self.gradient[b - 1]))
        memory = Memory(state=state, activation=activation, after_input=after_input, boundary=boundary,
                        gradient=gradient, buffered_sends=buffered_sends, output_after_input=keeps_out,
                        input_after_input=keeps_in)  # fmt: skip
        if self.allocations:
            memory = self._allocated(memory, bounds, placement, state, optimizer_copies, data_parallel)
        if fsdp:  # each stage's state over the replicas, gathered whole during the step
            memory = priced(memory, state, optimizer_copies, data_parallel, bool(self.allocations))
        return Costs(
            forward=[total(self.forward, a, b) + overhead for a, b in bounds],
            backward=[total(self.backward, a, b) + overhead for a, b in bounds],
            backward_input=[total(self.backward_input, a, b) + overhead for a, b in bounds],
            backward_weight=[total(self.backward_weight, a, b) + overhead for a, b in bounds],
            latency=latency, per_byte=per_byte, message_bytes=boundary, memory=memory,
        )  # fmt: skip


    def _allocated(
        self, memory: Memory, bounds: Sequence[tuple[int, int]], placement: Sequence[int] | None,
        state: list[float], optimizer_copies: int, data_parallel: int,
    ) -> Memory:  # fmt: skip
        """The memory model with what the allocator saw: transients, late gradients, sync buffers, the optimizer."""
        columns: dict[str, list[float]] = {}
        for a, b in bounds:
            for name, value in transients.stage(self.allocations, a, b).items():
                columns.setdefault(name, []).append(value)
        grads = [s / (2 + optimizer_copies) for s in state]  # the stage's parameters (once per rank), as gradients
        ranks = list(placement) if placement is not None else list(range(len(bounds)))
        optimizer = [0.0] * len(bounds)
        for rank in set(ranks):
            mine = [s for s, r in enumerate(ranks) if r == rank]
            layers = [self.allocations[k] for s in mine for k in range(*bounds[s])]
            optimizer[mine[0]] = transients.optimizer(layers)
        return dataclasses.replace(memory, **columns, grads_late=grads, optimizer=optimizer,  # type: ignore[arg-type]
                                   sync=grads if data_parallel > 1 else 0.0)  # fmt: skip

    def _state_of(self, stage: int, bounds: Sequence[tuple[int, int]], placement: Sequence[int] | None) -> float:
        """Bytes of a stage's parameters not held by an earlier stage of its rank (each layer's, without ties)."""
        a, b = bounds[stage]
        if not self.parameters:
            return float(sum(self.parameter_bytes[a:b]))
        mine = {key: size for layer in range(a, b) for key, size in self.parameters[layer]}
        if placement is not None:
            for earlier, (c, d) in enumerate(bounds[:stage]):
                if placement[earlier] == placement[stage]:
                    for layer in range(c, d):
                        for key, _ in self.parameters[layer]:
                            mine.pop(key, None)
        return float(sum(mine.values()))


@dataclass(frozen=True)
class LayerCosts:
    """What the partitioner balances, one entry per layer; None where it was not measured (no sample, or no
    timing asked). A view of a LayerProfile (``LayerCosts.of``); broadcast as rows by the engine."""

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

    @classmethod
    def of(cls, profile: LayerProfile | None, model: Iterable[nn.Module]) -> LayerCosts:
        """The partitioner's view of a profile (None: parameters only, nothing run)."""
        params = tuple(sum(p.numel() for p in layer.parameters()) for layer in model)
        param_bytes = tuple(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model)
        if profile is None:
            return cls(params, param_bytes, None, None, None)
        timed = profile.timed
        return cls(params, param_bytes, profile.saved, profile.forward if timed else None,
                   profile.backward if timed else None)  # fmt: skip

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
    compile: bool | Mapping[str, object] = False,
) -> LayerCosts:
    """Costs of every layer for one micro-batch ``sample`` (the first stage's input), with profile_layers.

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
    profile = profile_layers(model, sample, rows, repeats=repeats, device=torch.device(device or "cpu"), timed=timed,
                             compile=compile)  # fmt: skip
    return LayerCosts.of(profile, model)


def parameter_keys(model: Iterable[nn.Module]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per layer, (index among the model's distinct parameters, bytes) of each distinct parameter it holds."""
    index: dict[int, int] = {}
    layers = []
    for layer in model:
        held = dict.fromkeys(layer.parameters())  # a layer's own repeats once
        layers.append(tuple((index.setdefault(id(p), len(index)), p.numel() * p.element_size()) for p in held))
    return tuple(layers)


def profile_layers(
    model: nn.Sequential, sample: torch.Tensor | Tensors, rows: int, *, repeats: int = 3, device: torch.device,
    threads: int | None = None, loss: Callable[..., torch.Tensor] | None = None, target: object = None,
    timed: bool = True, allocator: bool = False, compile: bool | Mapping[str, object] = False,
    progress: Callable[[], None] | None = None,
) -> LayerProfile:  # fmt: skip
    """Measure every layer on the first ``rows`` rows of ``sample`` (each fed the real output of the one before),
    with ``threads`` torch threads (a rank's share of the cores; default: this process's). With ``loss`` and
    ``target`` (the batch's), ``loss(output, target's first rows)`` is measured as part of the last layer (the
    target itself is the user's, not counted). ``timed=False``: bytes only (one forward and backward a layer).
    ``allocator``: watch each compute's allocations too (pipeengine.planner.transients; one thread of this process
    may profile at a time). A layer is measured compiled where the engine runs it so: the user compiled it, or
    ``compile`` (the engine's compile=: True or torch.compile's keywords); a compiled layer's I then makes its weight
    gradients too, and its W is nothing (pipeengine.runtime.backward), as the engine runs it. ``progress()`` is called
    after each layer."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        layers = list(model)
        if loss is not None and target is not None:  # the loss runs on the last stage: that layer's, for stages
            part = map_tensors(target, lambda t: t[:rows].to(device).clone())  # type: ignore[arg-type]
            layers[-1] = _WithLoss(layers[-1], loss, part)
        profile = _profile(layers, sample, rows, repeats if timed else 0, device, allocator, compile, progress)
        return dataclasses.replace(profile, parameters=parameter_keys(model), timed=timed)
    finally:
        torch.set_num_threads(previous)


class _WithLoss(nn.Module):
    """The last layer followed by the loss: what the last stage runs in training."""

    def __init__(self, layer: nn.Module, loss: Callable[..., torch.Tensor], target: torch.Tensor | Tensors) -> None:
        super().__init__()
        self.layer, self.loss, self.target = layer, loss, target

    def forward(self, value: object) -> torch.Tensor:
        return self.loss(self.layer(value), self.target)


def _profile(
    model: Sequence[nn.Module], sample: torch.Tensor | Tensors, rows: int, repeats: int, device: torch.device,
    allocator: bool, compile: bool | Mapping[str, object] = False, progress: Callable[[], None] | None = None,
) -> LayerProfile:  # fmt: skip
    value = map_tensors(sample, lambda t: t[:rows].to(device))
    columns: dict[str, list[float | int | bool]] = {
        key: []
        for key in ("forward", "backward", "backward_input", "backward_weight", "parameter_bytes", "parameter_count",
                    "output", "gradient", "saved_other", "saves_input", "saves_output", "kept", "output_kept",
                    "other_freed", "saved")
    }  # fmt: skip
    allocations: list[transients.Allocation] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for index, layer in enumerate(model):
            probe = _probe(layer, device, compile)
            first = index == 0  # the user's batch: no gradient wanted for it
            timings = [_time(probe, value, first, device) for _ in range(repeats + 1)][1:] if repeats else []
            for index_, key in enumerate(("forward", "backward", "backward_input", "backward_weight")):
                columns[key].append(statistics.median(t[index_] for t in timings) if timings else 0.0)
            sizes = _bytes(probe, value, first)
            for key, size in sizes.items():
                columns[key].append(size)
            if allocator:
                allocations.append(transients.allocation(probe, lambda v=value, f=first: _leaves(v, f),  # type: ignore[misc]
                                                      isinstance(value, tuple), device))  # fmt: skip
            with torch.no_grad():
                value = probe(value)
            del probe
            if progress is not None:
                progress()
    profile = LayerProfile(rows, **{key: tuple(values) for key, values in columns.items()})  # type: ignore[arg-type]
    return dataclasses.replace(profile, allocations=tuple(allocations))


def _probe(layer: nn.Module, device: torch.device, compile: bool | Mapping[str, object]) -> nn.Module:
    """A copy of the layer to measure (a copy does not keep nn.Module.compile's compiled call: compiled again, as the
    user or compile= compiled the layer, with the user's own options unknown: torch.compile's defaults)."""
    probe = copy.deepcopy(layer).to(device)
    if compile or getattr(layer, "_compiled_call_impl", None) is not None:
        probe.compile(**({} if isinstance(compile, bool) else dict(compile)))
    return probe


def _leaves(value: torch.Tensor | Tensors, first: bool) -> Tensors:
    return unpack(map_tensors(value, lambda t: t.detach().requires_grad_(t.is_floating_point() and not first)))


def _time(layer: nn.Module, value: torch.Tensor | Tensors, first: bool, device: torch.device) -> tuple[float, ...]:
    """Forward, full backward, input-gradient (I) and weight-gradient (W) seconds of one layer on one input,
    each through the engine's own code (pipeengine.runtime.backward for I and W, as a zero-bubble stage runs them)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    params = [p for p in layer.parameters() if p.requires_grad]

    def forward() -> tuple[Tensors, list[torch.Tensor], float]:
        inputs = _leaves(value, first)
        with torch.enable_grad():
            sync()
            start = time.perf_counter()
            outputs = [o for o in unpack(layer(inputs if isinstance(value, tuple) else inputs[0])) if o.requires_grad]
            sync()
        return inputs, outputs, time.perf_counter() - start

    inputs, outputs, forward_time = forward()
    grads = tuple(torch.ones_like(o) for o in outputs)
    start = time.perf_counter()
    if outputs:
        torch.autograd.backward(outputs, grads)
    sync()
    backward_time = time.perf_counter() - start
    inputs, outputs, _ = forward()
    start = time.perf_counter()
    weight_pass = backward_input(tuple(outputs), grads, inputs, params)[1] if outputs else None
    sync()
    middle = time.perf_counter()
    if weight_pass is not None:
        weight_pass.run()
    sync()
    end = time.perf_counter()
    layer.zero_grad(set_to_none=True)
    return forward_time, backward_time, middle - start, end - middle


def _bytes(layer: nn.Module, value: torch.Tensor | Tensors, first: bool) -> dict[str, int | bool]:
    """What one micro-batch's forward through the layer leaves for its backward, by storage."""
    inputs = _leaves(value, first)
    target = layer.target if isinstance(layer, _WithLoss) else ()
    ledger = Ledger(ignore=[*layer.parameters(), *unpack(target)])
    with ledger.watching(), torch.enable_grad():
        outputs = unpack(layer(inputs if isinstance(value, tuple) else inputs[0]))
        saved = dict(ledger.saved)  # storage -> [bytes, holders]
    mine = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in inputs if t.numel()}
    made = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in outputs if t.numel()}
    # the last stage keeps a new scalar (the loss, weighted) and lets the loss's own output go: count its elements
    output = sum(t.numel() * t.element_size() for t in outputs) if isinstance(layer, _WithLoss) else sum(made.values())
    gradient = sum(t.numel() * t.element_size() for t in outputs if t.is_floating_point())
    other = [key for key in saved if key not in mine and key not in made]
    kept, output_kept, other_freed = 0, any(key in saved for key in made), 0
    needing = tuple(o for o in outputs if o.requires_grad)
    if needing and any(x.requires_grad for x in inputs):  # what I keeps for W, as a zero-bubble stage's would
        params = [p for p in layer.parameters() if p.requires_grad]
        grads = tuple(torch.ones_like(o) for o in needing)
        _, weight_pass = backward_input(needing, grads, inputs, params)
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                    for _, held, _ in weight_pass.roots for g in held if g is not None}  # fmt: skip
        kept = sum(storages.values())
        # the output outlives I only if W needs it: the nodes above W's restart points go with the output
        shown = weight_pass.fallback[0] if weight_pass.fallback is not None else ()
        del outputs, needing
        output_kept = all(ledger.holds(key, shown) for key in made)
        other_freed = sum(saved[key][0] for key in other if not ledger.holds(key, shown))
    return {
        "kept": kept,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in layer.parameters()),
        "parameter_count": sum(p.numel() for p in layer.parameters()),
        "saved": sum(entry[0] for entry in saved.values()),
        "output": output,
        "gradient": gradient,
        "saved_other": sum(saved[key][0] for key in other),
        "saves_input": any(key in saved for key in mine),
        "saves_output": any(key in saved for key in made),
        "output_kept": output_kept,
        "other_freed": other_freed,
    }
