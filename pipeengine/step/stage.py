"""A stage worker: one stage's layers, run forward and backward per micro-batch.

Autograd is cut at every stage boundary: a stage's inputs are leaf tensors, so its
backward stops there and leaves the input gradients in ``.grad`` to be sent upstream::

    recv x (leaf) ──► layers ──► y ── send ──►        forward
    send x.grad ◄── backward(y, dy) ◄── recv dy        backward
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import partial
from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeengine.core.dtensors import is_dtensor
from pipeengine.core.specs import Boundary, Tensors, map_tensors, pack, unpack
from pipeengine.step.backward import WeightPass, backward_input
from pipeengine.step.precision import autocast

__all__: list[str] = []

LossFn = Callable[..., torch.Tensor]
Context = contextlib.AbstractContextManager[None]


class Sharding(Protocol):
    """What a sharded stage (FSDP2's units in it: pipeengine.parallel.fsdp.Sharded) asks of its steps: its
    parameters gathered whole where its graph needs them again, and a forward run as FSDP wants it run."""

    def gather(self) -> None: ...

    def forward(self) -> Context: ...


class StageWorker:
    def __init__(
        self,
        index: int,
        module: nn.Module,
        *,
        is_last: bool,
        loss_fn: LossFn,
        checkpointed: bool = False,
        precision: torch.dtype | None = None,
        sharding: Sharding | None = None,
    ) -> None:
        self.index = index
        self.module = module
        self.is_last = is_last
        self.loss_fn = loss_fn
        self.checkpointed = checkpointed  # keep only the stage input; recompute the rest in backward
        self.precision = precision  # autocast dtype; floating outputs cross the boundary in it
        self.saved: dict[int, tuple[Tensors, Tensors]] = {}  # micro-batch -> (inputs, outputs) for backward
        self.weight_passes: dict[int, WeightPass] = {}  # micro-batch -> its pending W (zero-bubble)
        self.sharding = sharding  # None: no FSDP in this stage, and nothing of it runs in its steps

    def forward(
        self,
        mb: int,
        inputs: Tensors,
        packed: bool,
        *,
        train: bool,
        target: object = None,
        expected: Boundary | None = None,
        loss_weight: float = 1.0,
        loss_scale: float = 1.0,
    ) -> tuple[Tensors, torch.Tensor | None]:
        """Run the layers: (outputs, None); on the last stage of a training step, ((), the loss).

        ``expected``: the output the receiver sized its buffers for (checked, never a hang or a
        truncation). The loss is backpropagated times ``loss_weight`` (its share of the step's
        loss) and ``loss_scale`` (fp16); the loss returned is the loss_fn's value, detached.
        """
        argument = pack(inputs, packed)
        device = next((t.device for t in inputs), torch.device("cpu"))
        casting = autocast(device, self.precision) if self.precision is not None else nullcontext()  # mixed only
        with casting, self.sharding.forward() if self.sharding else nullcontext():
            if self.checkpointed and train:
                cpu = device.type == "cpu"  # its random state kept here, not by checkpoint (_Recompute says why)
                value = checkpoint(
                    self.module,
                    argument,
                    use_reentrant=False,
                    preserve_rng_state=not cpu,
                    context_fn=partial(self._recompute_context, cpu),
                )
            else:
                value = self.module(argument)
            if self.is_last and train:
                loss = self.loss_fn(value, target)
        if not self.is_last:
            if self.precision is not None:  # floating tensors cross the boundary in the autocast dtype
                dtype = self.precision
                value = map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)
            outputs = unpack(value)
            self._check(value, train, expected)
            if train:
                self.saved[mb] = (inputs, outputs)
            return outputs, None
        if not train:
            return unpack(value), None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}"
            )
        scaled = loss.float() * (loss_weight * loss_scale)  # e.g. 1/m each: the mean over micro-batches
        self.saved[mb] = (inputs, (scaled,))
        # a copy: a loss's scalar can sit on a larger storage (CPU mse_loss reduces in its elementwise buffer and
        # returns a 0-d view of it, a micro-batch's output in size), which the step's losses would keep alive
        return (), loss.detach().float().clone()

    def _recompute_context(self, cpu: bool) -> tuple[Context, Context]:
        """Activation checkpointing runs the forward again in backward, in training mode: the buffers it would update
        a second time (batch norm's running statistics) are put back as the first forward left them, and on a CPU
        stage the CPU's random state is the forward's again (dropout draws the same masks)."""
        buffers = list(self.module.buffers())
        random = torch.get_rng_state() if cpu else None  # checkpoint calls this just before the forward
        return nullcontext(), _Recompute(buffers, random) if buffers or cpu else nullcontext()

    def held(self) -> Iterator[torch.Tensor]:
        """What this worker keeps between its computes: inputs and outputs for backward, W's kept gradients."""
        for inputs, outputs in self.saved.values():
            yield from inputs
            yield from outputs
        for weight_pass in self.weight_passes.values():
            for root in weight_pass.roots:
                yield from (g for g in root.kept if g is not None)
            if weight_pass.fallback is not None:
                outputs, grads, _ = weight_pass.fallback
                yield from outputs
                yield from (g for g in grads if g is not None)

    def backward(self, mb: int, grad_outputs: Tensors | None) -> Tensors:
        """Backpropagate one micro-batch; return the gradients of the inputs that need one, and free it."""
        inputs, outputs, grads = self._pop(mb, grad_outputs)
        if outputs:
            torch.autograd.backward(outputs, grads)  # None for a scalar loss
        return tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs if x.requires_grad)

    def backward_input(self, mb: int, grad_outputs: Tensors | None) -> Tensors:
        """The input gradients alone (zero-bubble I); the weight pass is kept for backward_weight."""
        inputs, outputs, grads = self._pop(mb, grad_outputs)
        if self.sharding is not None:  # FSDP: the graph used the whole parameters
            self.sharding.gather()
        params = list(self.module.parameters())
        input_grads, self.weight_passes[mb] = backward_input(outputs, grads, inputs, params, self.checkpointed)
        return input_grads

    def backward_weight(self, mb: int) -> None:
        """The parameter gradients of a micro-batch whose input gradients were taken (zero-bubble W). FSDP with
        reshard_after_forward: a forward between its I and its W freed the whole parameters its graph saved (a
        V-Half stage forwards the next micro-batch first): gathered again."""
        if self.sharding is not None:
            self.sharding.gather()
        self.weight_passes.pop(mb).run()  # then its graph, and the activations it held, are freed

    def _pop(self, mb: int, grad_outputs: Tensors | None) -> tuple[Tensors, Tensors, Tensors]:
        """A micro-batch's inputs, the outputs to backpropagate from, and their gradients."""
        inputs, outputs = self.saved.pop(mb)
        needing = tuple(o for o in outputs if o.requires_grad)
        if self.is_last:
            return inputs, needing, (None,) * len(needing)  # type: ignore[return-value]  # d(loss)/d(loss) = 1
        if grad_outputs is None:  # no gradient comes back across the output boundary: nothing to do
            return inputs, (), ()
        return inputs, needing, tuple(grad_outputs)

    def _check(self, value: object, train: bool, expected: Boundary | None) -> None:
        """The output must be what the receiver's buffers were sized for: never a hang or a truncation."""
        if expected is None:
            return
        got = Boundary.of(value, f"the output of stage {self.index}")
        same = got.is_tuple == expected.is_tuple and len(got.specs) == len(expected.specs)
        same = same and all(
            g.shape == e.shape and g.dtype == e.dtype and (not train or g.requires_grad == e.requires_grad)
            for g, e in zip(got.specs, expected.specs, strict=True)
        )
        if any(type(t) is not torch.Tensor and is_dtensor(t) for t in unpack(value)):  # type: ignore[arg-type]
            raise ValueError(
                f"stage {self.index} produced a DTensor ({got}); a stage boundary crosses as plain tensors, each rank "
                "of a stage sending its own to its peer: end the stage with a style whose output is a plain, "
                "replicated tensor (RowwiseParallel, use_local_output=True)"
            )
        if not same:
            hint = ""
            if len(got.specs) == len(expected.specs) and any(
                g.shape[:-1] == e.shape[:-1] and g.shape[-1:] != e.shape[-1:]
                for g, e in zip(got.specs, expected.specs, strict=True)
            ):
                hint = (
                    "; it looks like this rank's shard of the output: a stage that ends in a layer sharding its "
                    "output (ColwiseParallel, SequenceParallel) sends a shard, and the next stage expects the whole "
                    "tensor: end each stage with a replicated output (RowwiseParallel after ColwiseParallel)"
                )
            if [s.requires_grad for s in got.specs] != [s.requires_grad for s in expected.specs]:
                hint = (
                    "; whether it needs a gradient differs: set requires_grad before building the PipelineEngine "
                    "(every rank infers the boundaries from its copy of the model)"
                )
            raise ValueError(
                f"stage {self.index} produced {got}, but its receiver expects {expected} (inferred on the meta "
                f"device){hint}"
            )


class _Recompute:
    """Around each recompute: puts the buffers back as they were on entering, on leaving; with ``random`` (a CPU
    stage's), runs it from the forward's CPU random state and puts the state outside back after. Entered again at
    each recompute (a split backward's I and W may each recompute the forward), so not a one-shot generator.

    torch's checkpoint keeps the random state itself, but for CPU inputs it keeps the default accelerator's too
    (CUDA on a machine with a GPU) and refuses a forward during which that is first initialised: seen on a lent
    GPU, where a CPU rank's compiled stage initialised CUDA in its first forward. A CPU stage needs the CPU's alone,
    so it keeps that here and tells checkpoint not to (preserve_rng_state=False)."""

    def __init__(self, buffers: list[torch.Tensor], random: torch.Tensor | None) -> None:
        self.buffers = buffers
        self.random = random
        self.saved: list[list[torch.Tensor]] = [[] for _ in buffers]  # a stack each: entries may nest
        self.outside: list[torch.Tensor] = []

    def __enter__(self) -> None:
        for buffer, stack in zip(self.buffers, self.saved, strict=True):
            stack.append(buffer.detach().clone())
        if self.random is not None:
            self.outside.append(torch.get_rng_state())
            torch.set_rng_state(self.random)

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for buffer, stack in zip(self.buffers, self.saved, strict=True):
                buffer.copy_(stack.pop())
        if self.random is not None:
            torch.set_rng_state(self.outside.pop())
