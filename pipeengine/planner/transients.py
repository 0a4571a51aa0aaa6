"""What the allocator sees that the ledger does not, per layer, measured once, and composed into a stage's.

A compute holds more while it runs than between computes: its temporaries, the loss's, the gradient
of a parameter before ``.grad`` takes it. Per layer, the allocator (pipeengine.observe.allocator)
watches each compute on one micro-batch (quietly: torch's line about freeing memory allocated before
the watch began is not passed on): its peak above the level it started at and its end level,
F, B, I and W as a stage runs them, a first B and W (no ``.grad`` yet to add to) and later ones, and
the optimizer step over the layer's parameters (AdamW: its temporaries above its state). A stage runs
its layers in order (F) or in reverse (B, I, W), so its peak is the largest of a layer's peak on top
of what the layers before it left::

    F(a..b) = max over l of ( sum end_F(k), k < l ) + peak_F(l)
    B(a..b) = max over l of ( sum end_B(k) - incoming(k), k >= l ) + peak_B(l)     (I alike; W has no incoming)

The first stage's W is its whole backward in one autograd call, which accumulates into ``.grad`` as B does:
B's composition; so is a checkpointed stage's W (``one_pass``).

The optimizer over a rank's parameters: its largest layer's temporaries (torch's for-loop AdamW frees
one tensor's before the next: measured over 1 to 4 Linear layers, equal and unequal, the rank's step
allocates what its largest layer's does, to 0.01 MiB).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipeengine.core.dtensors import settle, settled
from pipeengine.core.specs import Tensors, unpack
from pipeengine.observe.allocator import AllocatorWatch, AllocatorWatches
from pipeengine.step.backward import backward_input

__all__: list[str] = []

COMPUTES = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Allocation:
    """One layer's computes as the allocator saw them (bytes above the level each started at)."""

    peak: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # F, B, I, W: the most held while it ran
    end: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # and when it ended
    first_peak: tuple[float, float] = (0.0, 0.0)  # the first B and W: they make the gradients
    optimizer: float = 0.0  # an AdamW step's temporaries over its parameters
    incoming: float = 0.0  # the gradient of its output it was given: in a stage, freed once its backward used it


def allocation(layer: nn.Module, leaves: Callable[[], Tensors], packed: bool, device: torch.device) -> Allocation:
    """Watch one layer's computes on one input (``leaves()`` makes fresh leaf inputs). Its gradients are left None."""
    params = [p for p in layer.parameters() if p.requires_grad]

    def forward() -> tuple[Tensors, tuple[torch.Tensor, ...]]:
        inputs = leaves()
        with torch.enable_grad():
            out = unpack(layer(inputs if packed else inputs[0]))
        return inputs, tuple(settled(o) for o in out if o.requires_grad)

    def made(inputs: Tensors) -> list[torch.Tensor | None]:
        """The gradients a backward made: a tensor-parallel layer's may be its collectives' (waited inside a watch)."""
        return [*(t.grad for t in inputs), *(p.grad for p in params)]

    with AllocatorWatches(device, quiet=True) as watches:  # one session: what each compute frees, counted alike
        with watches.block("F"):
            inputs, outputs = forward()  # what it keeps stays referenced here: the watch's end counts it
        grads = tuple(torch.ones_like(o) for o in outputs)
        del inputs, outputs
        for steady in (False, True):  # the first finds .grad None (it makes the gradients), the second adds to them
            inputs, outputs = forward()
            with watches.block("B" if steady else "first B"):
                if outputs:
                    torch.autograd.backward(outputs, grads)
                settle(made(inputs))
        layer.zero_grad(set_to_none=True)
        for steady in (False, True):
            inputs, outputs = forward()
            with watches.block("I"):
                weight_pass = backward_input(outputs, grads, inputs, params)[1] if outputs else None
                settle(made(inputs))
            with watches.block("W" if steady else "first W"):
                if weight_pass is not None:
                    weight_pass.run()
                settle(made(inputs))
            del weight_pass
    layer.zero_grad(set_to_none=True)
    peak = tuple(watches.peak[compute] for compute in COMPUTES)
    end = tuple(watches.end[compute] for compute in COMPUTES)
    return Allocation(
        tuple(float(x) for x in peak),  # type: ignore[arg-type]
        tuple(float(x) for x in end),  # type: ignore[arg-type]
        (float(watches.peak["first B"]), float(watches.peak["first W"])),
        optimizer_step(params, device),
        float(sum(g.numel() * g.element_size() for g in grads)),
    )


def optimizer_step(params: Sequence[nn.Parameter], device: torch.device) -> float:
    """An AdamW step's temporaries over copies of ``params``, its state made by a first step."""
    if not params:
        return 0.0
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for copy in copies:
        copy.grad = torch.zeros_like(copy)
    optimizer = torch.optim.AdamW(copies)
    optimizer.step()
    with AllocatorWatch(device, quiet=True) as watch:
        optimizer.step()
    return float(watch.peak)


def stage(allocations: Sequence[Allocation], a: int, b: int, one_pass: bool = False) -> dict[str, float]:
    """A stage of layers [a, b): the simulator's transients (schedules.sim.memory_model), composed. ``one_pass``: its
    W is one autograd call from its outputs (step.backward's, for a checkpointed stage), as the first stage's."""
    layers = allocations[a:b]

    def composed(
        index: int,
        backward: bool,
        peaks: Callable[[Allocation], float] | None = None,
        kept: Callable[[Allocation], float] = lambda layer: 0.0,
    ) -> float:
        order = list(reversed(layers)) if backward else list(layers)
        below, top = 0.0, 0.0
        for position, layer in enumerate(order):
            # going down a stage, a layer's input gradient is the next one's incoming gradient, freed once its
            # first node has used it, before the layer's peak; the stage's own incoming gradient (a received
            # buffer) is held by the executor through the whole compute
            incoming = layer.incoming if backward and index != 3 and position else 0.0
            peak = peaks(layer) if peaks else layer.peak[index]
            held = layer.end[index] + kept(layer)  # what the layer leaves, with what it keeps: its end is a peak too
            top = max(top, below - incoming + max(peak, held))
            below += held - incoming
        return top

    # the first stage's input needs no gradient: its I does nothing, and its W is its whole backward, one autograd
    # call accumulating each gradient into .grad as B's does (step.backward's fallback); a checkpointed stage's W is
    # one such call too
    first = a == 0
    return {
        "transient": composed(0, False),
        "backward_transient": composed(1, True),
        "input_transient": 0.0 if first else composed(2, True),
        "weight_transient": composed(1, True) if first or one_pass else composed(3, True),
        "first_transient": max(
            composed(1, True, lambda layer: layer.first_peak[0]), composed(3, True, lambda layer: layer.first_peak[1])
        ),
    }


def optimizer(allocations: Sequence[Allocation]) -> float:
    """The optimizer step's temporaries over every parameter of these layers (one rank's)."""
    if not allocations:
        return 0.0
    return max(layer.optimizer for layer in allocations)
