"""A user's nn.Sequential on a cluster: each layer traced on the meta device, the stages cut as the engine cuts them.

``Sequential(model, sample, seq)`` describes any ``nn.Sequential`` (the model ``PipelineEngine`` takes) to the
cluster search, as ``models.from_config`` describes a Hugging Face config, so ``search``, ``price`` and ``estimate``
take either. Nothing is allocated: the layers are copied to the meta device in the precision's dtype (``meta_copy``;
a model built under ``with torch.device("meta"):`` costs nothing to copy), and for each micro-batch size asked:

- each layer's forward and backward ops are traced on the meta device (``costs.trace``), its input the previous
  layer's output (the first layer's input, one micro-batch of ``sample``'s rows, takes no gradient, as a first stage's
  does), and priced per op as a roofline, as a transformer block is; layers alike (one class, one ``repr``, the same
  parameter and input shapes) are traced once;
- the bytes each layer saves for its backward are counted as the engine's partition counts them
  (``construction.measure.layer_bytes``, the allocator's view on the meta device), and its output's bytes are what a
  stage ending on it sends;
- the stages are cut as the engine's partition by time cuts them: ``construction.partition.solve``, the exact
  min-max of each layer's forward and backward seconds on the target;
- a rank's peak is the schedules memory model's, as a dry run's (``schedules.Memory`` replayed by ``simulate``): its
  stages' weights, gradients and Adam state as mixed precision keeps them (16 bytes a parameter; FSDP2 keeps the whole
  weights and gradients for the step and divides the 12 bytes of master and moments among the replicas), and each
  micro-batch's saved activations held from its forward to its backward; a recomputed stage (pipeengine's
  ``checkpoint``) holds its input instead, and the stage's activations while its backward (a split backward's I)
  recomputes them.

Timing follows the transformer's pricing (``layout``): a stage's exchange holds it until done (the bytes at its
boundary, over the pipeline's link tier), the replicas' sync after the last backward, the optimizer memory-bound.

Not priced: tensor parallelism (a tp_plan's shards are not traced: ``check`` refuses tp > 1, where a transformer's
config is priced at every tp) and the loss (the trace stops at the last layer's output).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeengine.construction.measure import layer_bytes
from pipeengine.construction.partition import solve
from pipeengine.core.specs import Tensors, map_tensors, meta_copy, unpack
from pipeengine.planner.cluster import collectives
from pipeengine.planner.cluster.costs import Op, fused_attention, trace
from pipeengine.planner.cluster.layout import (
    Parts,
    phase_seconds,
    rank_stages,
    schedule_of,
    state_per_parameter,
    sync_seconds,
)

if TYPE_CHECKING:
    from pipeengine.planner.cluster.hardware import Hardware
    from pipeengine.planner.cluster.layout import Layout, Runtime

__all__ = ["Sequential"]


class _Layer:
    """One layer at one micro-batch size: its ops, the bytes it takes in, sends on and saves for its backward."""

    __slots__ = ("input_bytes", "ops", "output_bytes", "saved_bytes")

    def __init__(self, ops: list[Op], input_bytes: float, output_bytes: float, saved_bytes: float) -> None:
        self.ops, self.input_bytes, self.output_bytes, self.saved_bytes = ops, input_bytes, output_bytes, saved_bytes


def _leaf(tensor: torch.Tensor, first: bool) -> torch.Tensor:
    """A layer's input as the engine gives it: a leaf taking a gradient where floating, but for the first layer's."""
    return tensor.detach().requires_grad_(tensor.is_floating_point() and not first)


def _bytes(value: torch.Tensor | Tensors) -> float:
    return float(sum(t.numel() * t.element_size() for t in unpack(value)))


class Sequential:
    """An ``nn.Sequential`` described for the cluster planner (the module's docstring): ``seq`` tokens a sample
    (what tokens/s counts; 1 counts samples), ``dtype`` the precision it trains in."""

    def __init__(
        self, model: nn.Sequential, sample: torch.Tensor | Tensors, seq: int, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        if not isinstance(model, nn.Sequential):
            raise TypeError(f"Sequential plans an nn.Sequential, got a {type(model).__name__}: wrap its layers in one")
        if not len(model):
            raise ValueError("Sequential plans an nn.Sequential of one layer or more, got an empty one")
        if any(t.dim() == 0 for t in unpack(sample)):
            raise ValueError("sample: its tensors' first dimension is the batch; give at least one row")
        if seq < 1:
            raise ValueError(f"seq={seq}: tokens a sample, 1 or more (1 counts samples)")
        tokens = unpack(sample)[0]
        if not tokens.is_floating_point() and tokens.dim() >= 2 and tokens.shape[1] != seq:
            raise ValueError(
                f"seq={seq}, but the sample's sequences are {tokens.shape[1]} tokens (its second "
                f"dimension): give seq={tokens.shape[1]}, or a sample of {seq} tokens"
            )
        self._layers = [meta_copy(layer).to(dtype) for layer in model]
        self._sample = map_tensors(
            sample, lambda t: torch.empty(t.shape[1:], dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
        )
        self.layers, self.seq = len(model), seq
        self.dtype_bytes = torch.empty((), dtype=dtype).element_size()
        self._owned = [{id(p): float(p.numel()) for p in layer.parameters()} for layer in model]  # tied: one id
        self.parameters = float(sum(p.numel() for p in model.parameters()))  # a weight shared by two layers once
        self._profiles: dict[int, list[_Layer]] = {}
        self._seconds: dict[tuple[int, str, str], list[dict[str, float]]] = {}
        self._bounds: dict[tuple[int, int, str, str], list[tuple[int, int]]] = {}
        self._held: dict[tuple[object, ...], list[float]] = {}

    def flops_per_step(self, global_batch: int) -> float:
        """The model's FLOPs a step: its traced forward and backward, recomputation not counted (model FLOPs), from
        the smallest micro-batch traced so far (the FLOPs of a layer grow with its rows)."""
        size = min(self._profiles, default=global_batch)
        return sum(op.flops for layer in self.profile(size) for op in layer.ops) / size * global_batch

    def profile(self, micro_batch: int) -> list[_Layer]:
        """Each layer's ops and bytes at this micro-batch size (traced once a size); a ValueError where the model's
        forward fails at that size on the meta device (batch norm over one row, say)."""
        found = self._profiles.get(micro_batch)
        if found is None:
            try:
                found = self._traced(micro_batch)
            except (RuntimeError, ValueError) as error:
                raise ValueError(
                    f"micro_batch={micro_batch}: the model fails at this size on the meta device "
                    f"({type(error).__name__}: {error})"
                ) from error
            self._profiles[micro_batch] = found
        return found

    def _parameters(self, layers: Iterable[int]) -> float:
        """The parameters these layers hold, a weight they share once."""
        return float(sum({key: n for i in layers for key, n in self._owned[i].items()}.values()))

    def _traced(self, micro_batch: int) -> list[_Layer]:
        value: torch.Tensor | Tensors = map_tensors(self._sample, lambda t: t.expand(micro_batch, *t.shape).clone())
        alike: dict[object, tuple[list[Op], float]] = {}
        out = []
        for index, layer in enumerate(self._layers):
            first = index == 0
            grad = map_tensors(value, functools.partial(_leaf, first=first))
            key = (
                type(layer),
                repr(layer),
                tuple((tuple(p.shape), p.dtype) for p in layer.parameters()),
                first,
                tuple((tuple(t.shape), t.dtype) for t in unpack(value)),
            )
            if key not in alike:
                ops = trace(layer, grad)
                with fused_attention():  # what a GPU saves: no score matrix (as trace prices the time)
                    alike[key] = (ops, float(layer_bytes(layer, value, first)["saved"]))
            ops, saved = alike[key]
            with torch.device("meta"), torch.no_grad():
                following = map_tensors(layer(value), torch.Tensor.detach)
            out.append(_Layer(ops, _bytes(value), _bytes(following), saved))
            value = following
        return out

    def check(self, layout: Layout, hw: Hardware) -> None:
        """What this description can price: tp=1, and pp x chunks stages of one layer or more."""
        del hw
        if layout.tp != 1:
            raise ValueError(
                f"tp={layout.tp}: a generic nn.Sequential is priced without tensor parallelism on "
                "clusters (its tp_plan's shards are not traced): use tp=1, or describe a transformer by "
                "its Hugging Face config.json to price every tp"
            )
        if layout.pp * layout.chunks > self.layers:
            raise ValueError(
                f"pp={layout.pp} x chunks={layout.chunks} stages, but the model has {self.layers} "
                "layers: every stage holds one layer or more"
            )

    def _seconds_of(self, micro_batch: int, hw: Hardware, dtype: str) -> list[dict[str, float]]:
        key = (micro_batch, repr(hw), dtype)
        found = self._seconds.get(key)
        if found is None:
            found = self._seconds[key] = [phase_seconds(layer.ops, hw, dtype) for layer in self.profile(micro_batch)]
        return found

    def _stages(self, micro_batch: int, stages: int, hw: Hardware, dtype: str) -> list[tuple[int, int]]:
        """The engine's partition by time of the layers into ``stages`` (solved once a size)."""
        key = (micro_batch, stages, repr(hw), dtype)
        found = self._bounds.get(key)
        if found is None:
            seconds = self._seconds_of(micro_batch, hw, dtype)
            found = self._bounds[key] = solve([s["forward"] + s["backward"] for s in seconds], stages)
        return found

    def parts(self, layout: Layout, hw: Hardware, dtype: str, runtime: Runtime, exact: bool = True) -> Parts:
        """The stage times, sync and peak of ``layout`` (the module's docstring); ``exact=False``: the peak's lower
        bound (each rank's state and one micro-batch's activations of its largest stage), what the search prunes
        by before ``price`` replays the memory model."""
        p, b, m, stages = layout.pp, layout.micro_batch, layout.num_microbatches, layout.pp * layout.chunks
        rows, seconds = self.profile(b), self._seconds_of(b, hw, dtype)
        bounds = self._stages(b, stages, hw, dtype)

        def total(values: Callable[[int], float]) -> list[float]:
            return [float(sum(values(i) for i in range(lo, hi))) for lo, hi in bounds]

        forward = total(lambda i: seconds[i]["forward"])
        weight = total(lambda i: seconds[i]["weight"])
        backward = total(lambda i: seconds[i]["backward"])
        if layout.recompute:
            backward = [b_ + f for b_, f in zip(backward, forward, strict=True)]
        params = [self._parameters(range(lo, hi)) for lo, hi in bounds]
        accumulate = [n * runtime.accumulate_bytes / hw.memory_bandwidth * (m - 1) / m for n in params]
        weight = [w + a for w, a in zip(weight, accumulate, strict=True)]
        backward = [b_ + a for b_, a in zip(backward, accumulate, strict=True)]
        inputs = [rows[lo].input_bytes for lo, _ in bounds]
        outputs = [rows[hi - 1].output_bytes for _, hi in bounds]
        if p > 1:  # each exchange holds its stage until done, as the transformer's pricing has it
            link = collectives.group_link(hw, p, 1)
            forward = [
                f + collectives.send_recv(outputs[s] if s < stages - 1 else inputs[s], link)
                for s, f in enumerate(forward)
            ]
            backward = [
                b_ + collectives.send_recv(inputs[s] if s else outputs[s], link) for s, b_ in enumerate(backward)
            ]
        ranks = rank_stages(layout)
        per = state_per_parameter(layout)
        state = [self._parameters(i for s in mine for i in range(*bounds[s])) * per for mine in ranks]
        replicas, optimizer = sync_seconds(max(state) / per, self.dtype_bytes, layout, hw, runtime, backward)
        saved = total(lambda i: rows[i].saved_bytes)
        if exact:
            peak = max(s + a for s, a in zip(state, self._activations(layout, inputs, saved), strict=True))
        else:  # one micro-batch of the rank's largest stage
            held = [inputs[s] + saved[s] if layout.recompute else saved[s] for s in range(stages)]
            peak = max(s + max(held[stage] for stage in mine) for s, mine in zip(state, ranks, strict=True))
        return Parts(forward, backward, weight, 0.0, replicas, optimizer, peak, tuple(hi - lo for lo, hi in bounds))

    def _activations(self, layout: Layout, inputs: list[float], saved: list[float]) -> list[float]:
        """The most activation bytes each pipeline rank holds in the step: the schedules memory model replayed
        without the state, which stays through the step (the module's docstring)."""
        from schedules import Costs, Memory, simulate

        if layout.pp == 1:  # one rank runs its micro-batches one after another: one held at a time
            return [max(i + s if layout.recompute else s for i, s in zip(inputs, saved, strict=True))]
        key = (
            layout.schedule,
            layout.pp,
            layout.num_microbatches,
            layout.chunks,
            layout.micro_batch,
            layout.recompute,
            tuple(inputs),
            tuple(saved),
        )
        found = self._held.get(key)
        if found is None:
            if layout.recompute:
                memory = Memory(state=0.0, activation=inputs, backward_transient=saved, input_transient=saved)
            else:
                memory = Memory(state=0.0, activation=saved)
            schedule = schedule_of(layout.schedule, layout.pp, layout.num_microbatches, layout.chunks)
            found = self._held[key] = [float(x) for x in simulate(schedule, Costs(memory=memory)).peak_memory]
        return found
