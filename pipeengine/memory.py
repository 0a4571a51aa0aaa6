"""Memory measured as the simulator's model counts it (schedules.memory): bytes held, by tensor storage.

A Ledger sees what autograd saves for backward (saved-tensor hooks, on CPU and CUDA) and is
shown what the engine itself holds: the inputs and outputs a stage keeps for its backward,
received buffers, gradients waiting to be sent or taken, what a split backward keeps for W.
Each storage counts once and parameters never (they are the step-long state). The per-stage
sizes come from running each stage's own worker once on a sample micro-batch under a ledger,
so the sizes the simulator is fed and the peaks a traced step measures are the same quantities.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pipeengine.specs import Boundary, Tensors
from pipeengine.stage import StageWorker

__all__: list[str] = []


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Ledger:
    """The bytes alive of the tensors autograd saved (while a step runs under watching()) and of those shown."""

    def __init__(self, ignore: Iterable[torch.Tensor] = ()) -> None:
        self.ignore = {_storage(t)[0] for t in ignore if t.numel()}
        self.saved: dict[int, list[int]] = {}  # storage -> [bytes, holders alive]
        self.lock = threading.Lock()

    def _pack(self, tensor: torch.Tensor) -> object:
        if not tensor.numel() or tensor.device.type == "meta":
            return tensor
        key, size = _storage(tensor)
        if key in self.ignore:
            return tensor
        with self.lock:
            entry = self.saved.setdefault(key, [size, 0])
            entry[1] += 1
        held = _Held(tensor.detach())  # the same storage without its grad_fn: a saved output would hold its
        weakref.finalize(held, self._release, key)  # own node, a cycle through autograd that is never freed
        return held

    def _release(self, key: int) -> None:
        with self.lock:
            entry = self.saved[key]
            entry[1] -= 1
            if not entry[1]:
                del self.saved[key]

    @staticmethod
    def _unpack(held: object) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held  # type: ignore[return-value]

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Count what autograd saves in the block (hooks are per thread: the calling thread's computes)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def bytes(self, shown: Iterable[torch.Tensor]) -> int:
        """Bytes of every storage alive: saved by autograd, or among ``shown``; each storage once."""
        with self.lock:
            sizes = {key: entry[0] for key, entry in self.saved.items()}
        for tensor in shown:
            if tensor.numel():
                key, size = _storage(tensor)
                if key not in self.ignore:
                    sizes[key] = size
        return sum(sizes.values())

    def holds(self, storage: int, shown: Iterable[torch.Tensor]) -> bool:
        """Whether a storage (its data_ptr) is alive as this ledger counts: saved by autograd, or among ``shown``."""
        with self.lock:
            if storage in self.saved:
                return True
        return any(t.numel() and _storage(t)[0] == storage for t in shown)

    def ignoring(self, tensors: Iterable[torch.Tensor]) -> None:
        self.ignore |= {_storage(t)[0] for t in tensors if t.numel()}


def held_by(worker: StageWorker) -> Iterator[torch.Tensor]:
    """The tensors a stage worker keeps between its computes: inputs and outputs for backward, W's kept gradients."""
    for inputs, outputs in worker.saved.values():
        yield from inputs
        yield from outputs
    for weight_pass in worker.weight_passes.values():
        for _, kept, _ in weight_pass.roots:
            yield from (g for g in kept if g is not None)
        if weight_pass.fallback is not None:
            outputs, grads, _ = weight_pass.fallback
            yield from outputs
            yield from (g for g in grads if g is not None)


@dataclass(frozen=True)
class StageSizes:
    """What one stage holds per micro-batch (bytes), measured: the simulator's Memory, for one stage."""

    state: float
    activation: float
    after_input: float
    boundary: float
    gradient: float
    output_after_input: bool = True  # a split backward's I leaves the output held until W
    input_after_input: bool = True


def measure_stage(
    worker: StageWorker,
    inputs: Tensors,
    packed: bool,
    target: object,
    output: Boundary | None,
    *,
    split: bool,
    parameter_bytes: float,
    optimizer_copies: float,
) -> StageSizes:
    """Run a stage's forward and backward once on a sample micro-batch, counting what it holds after each.

    The stage's gradients, buffers and random state are as they were afterwards. ``inputs`` are
    the stage input as the executor makes it (leaves needing grad as the boundary says); the
    first stage's input is the user's batch, never counted. ``parameter_bytes``: the stage's
    parameters not already held by another stage of the rank, for the step-long state.
    """
    params = list(dict.fromkeys(worker.module.parameters()))
    targets = target if isinstance(target, tuple) else (target,)
    user = [*(inputs if worker.index == 0 else ()), *(t for t in targets if isinstance(t, torch.Tensor))]
    ledger = Ledger(ignore=[*params, *user])  # the user's batch (inputs, targets) is theirs, not the engine's
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in worker.module.buffers()]
    devices = [t.device for t in inputs if t.device.type == "cuda"][:1]
    try:
        for param in params:
            param.grad = None
        with torch.random.fork_rng(devices=devices), ledger.watching():
            with torch.enable_grad():  # the worker keeps what it keeps; nothing else may hold a reference here
                worker.forward(-1, inputs, packed, train=True, target=target, expected=output)
            activation = ledger.bytes([*inputs, *held_by(worker)])
            incoming = None
            if output is not None:  # the gradient of the output, as a received buffer
                device = next((t.device for t in inputs), torch.device("cpu"))
                incoming = tuple(torch.zeros(s.shape, dtype=s.dtype, device=device) for s in output.grad_specs) or None
            outputs = [_storage(t)[0] for t in worker.saved[-1][1] if t.numel()]  # by storage: no reference kept
            keeps_output = keeps_input = True
            if split:
                worker.backward_input(-1, incoming)
                held = list(held_by(worker))
                after_input = ledger.bytes(held)
                keeps_output = all(ledger.holds(key, held) for key in outputs)
                keeps_input = all(ledger.holds(_storage(t)[0], held) for t in inputs if t.numel())
                del held
                worker.backward_weight(-1)
            else:
                worker.backward(-1, incoming)
                after_input = activation
    finally:
        worker.saved.pop(-1, None)
        worker.weight_passes.pop(-1, None)
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        with torch.no_grad():
            for buffer, value in zip(worker.module.buffers(), buffers, strict=True):
                buffer.copy_(value)
    return StageSizes(
        state=parameter_bytes * (2 + optimizer_copies),
        activation=float(activation),
        after_input=float(after_input),
        boundary=float(sum(_bytes(s) for s in output.specs)) if output is not None else 0.0,
        gradient=float(sum(_bytes(s) for s in output.grad_specs)) if output is not None else 0.0,
        output_after_input=keeps_output,
        input_after_input=keeps_input,
    )


def _bytes(spec: object) -> int:
    shape, dtype = spec.shape, spec.dtype  # type: ignore[attr-defined]
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


def optimizer_copies(optimizer: torch.optim.Optimizer | None, params: Iterable[nn.Parameter]) -> float:
    """How many copies of its parameters an optimizer keeps (AdamW: 2), from its state; 2 without one yet."""
    params = list(params)
    size = sum(p.numel() * p.element_size() for p in params)
    if optimizer is None or not size:
        return 2.0
    held = 0
    for param in params:
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                held += value.numel() * value.element_size()
    return held / size if held else 2.0
