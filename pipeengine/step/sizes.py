"""A stage's sizes, measured: its worker run once on a sample micro-batch under a ledger (and the allocator's watch),
what it holds after each compute counted as the simulator's memory model counts it (schedules.sim.memory_model).

    stage_sizes(worker, inputs, ...)   a StageSizes; the worker's gradients, buffers and random state unchanged
    optimizer_transient(optimizer, params)   the optimizer step's temporaries, watched by the allocator

Traced training steps call them (pipeengine.train.tracing) once per batch shape and program.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from pipeengine.core.dtensors import settle
from pipeengine.core.specs import Boundary, Tensors
from pipeengine.observe.allocator import AllocatorWatch
from pipeengine.observe.ledger import Ledger, StageSizes, storage
from pipeengine.step.stage import StageWorker

__all__ = ["optimizer_transient", "stage_sizes"]


def stage_sizes(
    worker: StageWorker,
    inputs: Tensors,
    packed: bool,
    target: object,
    output: Boundary | None,
    *,
    split: bool,
    parameter_bytes: float,
    optimizer_copies: float,
    allocator: bool = False,
) -> StageSizes:
    """Run a stage's forward and backward once on a sample micro-batch, counting what it holds after each.

    The stage's gradients, buffers and random state are as they were afterwards. ``inputs`` are
    the stage input as the executor makes it (leaves needing grad as the boundary says); the
    first stage's input is the user's batch, never counted. ``parameter_bytes``: the stage's
    parameters not already held by another stage of the rank, for the step-long state. ``allocator``:
    watch each compute's allocations too (pipeengine.observe.allocator), for its transient peak.
    """
    params = list(dict.fromkeys(worker.module.parameters()))
    targets = target if isinstance(target, tuple) else (target,)
    user = [*(inputs if worker.index == 0 else ()), *(t for t in targets if isinstance(t, torch.Tensor))]
    ledger = Ledger(ignore=[*params, *user])  # the user's batch (inputs, targets) is theirs, not the engine's
    devices = [t.device for t in inputs if t.device.type == "cuda"][:1]
    device = next((t.device for t in inputs), torch.device("cpu"))
    watch = _Watch(worker, inputs, params, device, allocator)
    first = 0.0  # the stage's first B (or W): it makes the parameters' gradients, which later ones add to
    with _as_it_was(worker, params):
        if allocator:  # once without gradients, as the step's first micro-batch finds them, for ``first``
            with torch.random.fork_rng(devices=devices):
                _run_stage(worker, inputs, packed, target, output, split, device, watch.watched)
            first = watch.transients[3] if split else watch.transients[1]
        with torch.random.fork_rng(devices=devices), ledger.watching():
            held = _held(worker, ledger, inputs, packed, target, output, split, device, watch.watched)
    activation, after_input, keeps_output, keeps_input = held
    transients = watch.transients
    return StageSizes(
        state=parameter_bytes * (2 + optimizer_copies),
        activation=float(activation),
        after_input=float(after_input),
        boundary=float(sum(s.nbytes for s in output.specs)) if output is not None else 0.0,
        gradient=float(sum(s.nbytes for s in output.grad_specs)) if output is not None else 0.0,
        output_after_input=keeps_output,
        input_after_input=keeps_input,
        transients=(transients[0], transients[1], transients[2], transients[3]),
        first_transient=first,
    )


class _Watch:
    """Each compute's peak above its start, by kind (F, B, I, W), where the allocator is watched."""

    def __init__(
        self, worker: StageWorker, inputs: Tensors, params: list[nn.Parameter], device: torch.device, allocator: bool
    ) -> None:
        self.worker, self.inputs, self.params, self.device, self.allocator = worker, inputs, params, device, allocator
        self.transients = [0.0, 0.0, 0.0, 0.0]

    @contextlib.contextmanager
    def watched(self, kind: int) -> Iterator[None]:
        """The compute's peak above its start (its gradient for a parameter is whole before .grad takes it)."""
        if not self.allocator:
            yield
            return
        with AllocatorWatch(self.device) as watch:
            yield
            saved = self.worker.saved.get(-1)  # what it made, its collectives waited on inside the watch
            settle([*(saved[1] if saved else ()), *(t.grad for t in self.inputs), *(p.grad for p in self.params)])
        self.transients[kind] = float(watch.peak)


@contextlib.contextmanager
def _as_it_was(worker: StageWorker, params: list[nn.Parameter]) -> Iterator[None]:
    """The stage's gradients set aside (None inside), its buffers copied: both as they were afterwards, and the
    sample micro-batch's saved state and pending W dropped."""
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in worker.module.buffers()]
    try:
        for param in params:
            param.grad = None
        yield
    finally:
        worker.saved.pop(-1, None)
        worker.weight_passes.pop(-1, None)
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        with torch.no_grad():
            for buffer, value in zip(worker.module.buffers(), buffers, strict=True):
                buffer.copy_(value)


def _held(
    worker: StageWorker,
    ledger: Ledger,
    inputs: Tensors,
    packed: bool,
    target: object,
    output: Boundary | None,
    split: bool,
    device: torch.device,
    watched: Callable[[int], Any],
) -> tuple[int, int, bool, bool]:
    """One forward and backward under the ledger: the bytes held after the forward (the activation), after a split
    backward's I (what W needs), and whether I leaves the stage's output and input held."""
    with torch.enable_grad(), watched(0):  # the worker keeps what it keeps; nothing else holds a reference
        worker.forward(-1, inputs, packed, train=True, target=target, expected=output)
    activation = ledger.bytes([*inputs, *worker.held()])
    incoming = None
    if output is not None:  # the gradient of the output, as a received buffer
        incoming = tuple(torch.zeros(s.shape, dtype=s.dtype, device=device) for s in output.grad_specs) or None
    outputs = [storage(t)[0] for t in worker.saved[-1][1] if t.numel()]  # by storage: no reference kept
    if not split:
        with watched(1):
            worker.backward(-1, incoming)
        return activation, activation, True, True
    with watched(2):
        worker.backward_input(-1, incoming)
    held = list(worker.held())
    after_input = ledger.bytes(held)
    keeps_output = all(ledger.holds(key, held) for key in outputs)
    keeps_input = all(ledger.holds(storage(t)[0], held) for t in inputs if t.numel())
    del held
    with watched(3):
        worker.backward_weight(-1)
    return activation, after_input, keeps_output, keeps_input


def _run_stage(
    worker: StageWorker,
    inputs: Tensors,
    packed: bool,
    target: object,
    output: Boundary | None,
    split: bool,
    device: torch.device,
    watched: Callable[[int], Any],
) -> None:
    """One forward and backward of a stage on a sample micro-batch, each compute watched."""
    with torch.enable_grad(), watched(0):
        worker.forward(-1, inputs, packed, train=True, target=target, expected=output)
    incoming = None
    if output is not None:
        incoming = tuple(torch.zeros(s.shape, dtype=s.dtype, device=device) for s in output.grad_specs) or None
    if split:
        with watched(2):
            worker.backward_input(-1, incoming)
        with watched(3):
            worker.backward_weight(-1)
    else:
        with watched(1):
            worker.backward(-1, incoming)


def optimizer_transient(optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter]) -> float:
    """The optimizer step's temporaries over ``params``: a second step of a fresh optimizer of the same kind and
    settings over copies of them (its state made by the first, as in training), watched by the allocator. It holds
    the copies meanwhile (the parameters, their gradients, the optimizer's state, once more)."""
    if optimizer is None or not params:
        return 0.0
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for copy in copies:
        copy.grad = torch.zeros_like(copy)
    probe = type(optimizer)(copies, **settings)
    probe.step()
    with AllocatorWatch(copies[0].device) as watch:
        probe.step()
    return float(watch.peak)
