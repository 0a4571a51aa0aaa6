"""The one process: every parity test's reference, and the checks of an engine against it.

A parity test builds a model, a OneProcess of it (a deep copy, made before the engine takes the model's layers) and
the engine; both train on the same batches with the same loss weighting, and the loss, every gradient, the weights
after the optimizers' steps and eval_step's output must agree within float32's tolerance (RTOL, ATOL): in float32 the
two differ by summation order alone.

    one = OneProcess(model, loss_fn)
    one.step(parts)                         every replica's (x, y) at once: the loss over their union, one backward
    one.step(parts, microbatches=m, ...)    micro-batch by micro-batch, each loss weighted as the engine weights it
                                            (1/(m dp), or 1/the global count of units), stage by stage under
                                            autocast with the boundaries cast as the engine casts them (bounds,
                                            dtype), backpropagated times a loss scale (fp16), then unscaled
    one.forward(x)                          a forward without gradients
    one.input_gradient(x, grad)             autograd from an output's gradient: the input's (the weights' in .grad)
    close, check_grads, check_weights, check_clipped, check_eval, step_both    the engine against it
    save_reference, load_reference          the one process's state beside an engine's checkpoint
    train_like_one_process(...)             the usual loop: a train_step and the one process's step, compared
    model_parity, replicas_parity           tests/pipeengine/models.py's models through a schedule for a few steps
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeengine import PipelineEngine
from pipeengine.core.dtensors import whole
from tests.pipeengine import ranks
from tests.pipeengine.models import MODELS, batch

RTOL, ATOL = 1e-5, 4e-5
REFERENCE = "reference.pt"  # save_reference's file, beside a checkpoint

Batch = tuple[Any, torch.Tensor]  # (inputs: a tensor or a tuple of them, targets)
Compare = Callable[[Any, Any, str], None]


class OneProcess:
    """The model deep-copied, trained on one process as the engine trains it (see the module docstring).

    ``seq``: the Sequential the engine was given, made of the copy (its names are the engine's; default the copy
    itself). ``run(model, x, y)``: the loss of a whole batch where the model computes it (Hugging Face's
    ``model(ids, labels=labels).loss``), in place of ``loss_fn(seq(x), y)``."""

    def __init__(
        self,
        model: Any,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        seq: Callable[[Any], nn.Module] | None = None,
        run: Callable[[Any, Any, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.model = copy.deepcopy(model)
        self.seq: nn.Module = seq(self.model) if seq else self.model
        self.loss_fn, self.run = loss_fn, run

    def parameters(self) -> list[nn.Parameter]:
        return list(self.seq.parameters())

    def step(
        self,
        parts: Sequence[Batch],
        *,
        microbatches: int | None = None,
        count: Callable[[torch.Tensor], Any] | None = None,
        bounds: Sequence[tuple[int, int]] | None = None,
        dtype: torch.dtype | None = None,
        scale: float = 1.0,
    ) -> float:
        """Forward and backward over every replica's batch, gradients added to what .grad holds; the step's loss as
        the engine reports it. Without ``microbatches``: the loss of the union of the batches, one backward."""
        if microbatches is None:
            x, y = _cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            loss = self.run(self.model, x, y) if self.run else self.loss_fn(self.seq(x), y)  # type: ignore[misc]
            loss.backward()
            return float(loss.item())
        total = float(sum(float(count(y)) for _, y in parts)) if count else None
        loss_sum, kept = 0.0, None
        earlier = {param: param.grad for param in self.seq.parameters()}  # this step's gradients are scaled apart
        for param in earlier:
            param.grad = None
        for replica, (x, y) in enumerate(parts):
            for xb, yb in zip(_chunk(x, microbatches), y.chunk(microbatches), strict=True):
                out = self._forward(xb, bounds, dtype)
                with _autocast(dtype):
                    loss = self.loss_fn(out, yb)  # type: ignore[misc]
                weight = 1.0 / total if total else 1.0 / (microbatches * len(parts))
                (loss.float() * (weight * scale)).backward()
                loss_sum += float(loss.detach()) * weight
            if replica == 0:  # the engine's replicas keep replica 0's buffers (batch norm's statistics)
                kept = [b.detach().clone() for b in self.seq.buffers()]
        with torch.no_grad():
            for buffer, value in zip(self.seq.buffers(), kept or [], strict=True):
                buffer.copy_(value)
            for param, grad in earlier.items():
                if param.grad is not None and scale != 1.0:
                    param.grad /= scale
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad + grad
        return loss_sum

    def forward(self, x: Any, bounds: Sequence[tuple[int, int]] | None = None, dtype: torch.dtype | None = None) -> Any:
        """The output, without gradients (in the model's mode: eval() it first for eval_step's)."""
        with torch.no_grad():
            return self._forward(x, bounds, dtype)

    def input_gradient(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """Autograd through the copy from ``grad`` at its output: the gradient of ``x`` (the parameters' in .grad)."""
        x = x.detach().clone().requires_grad_(True)
        self.seq(x).backward(grad)
        return x.grad

    def _forward(self, x: Any, bounds: Sequence[tuple[int, int]] | None, dtype: torch.dtype | None) -> Any:
        """Stage by stage: under autocast, the floating tensors crossing each boundary cast to its dtype."""
        if bounds is None and dtype is None:
            return self.seq(x)
        bounds = bounds or [(0, len(self.seq))]  # type: ignore[arg-type]
        value = x
        for stage, (start, end) in enumerate(bounds):
            with _autocast(dtype):
                for layer in self.seq[start:end]:  # type: ignore[index]
                    value = layer(value)
            if stage < len(bounds) - 1 and dtype is not None:
                cast = [
                    t.to(dtype) if t.is_floating_point() else t
                    for t in (value if isinstance(value, tuple) else (value,))
                ]
                value = tuple(cast) if isinstance(value, tuple) else cast[0]
        return value


def _autocast(dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _cat(values: Sequence[Any]) -> Any:
    if isinstance(values[0], tuple):
        return tuple(torch.cat(column) for column in zip(*values, strict=True))
    return torch.cat(list(values))


def _chunk(x: Any, n: int) -> list[Any]:
    if isinstance(x, tuple):
        return list(zip(*(t.chunk(n) for t in x), strict=True))
    return list(x.chunk(n))


def _module(reference: nn.Module | OneProcess) -> nn.Module:
    return reference.seq if isinstance(reference, OneProcess) else reference


def close(
    actual: torch.Tensor | float, expected: torch.Tensor | float, what: str, rtol: float = RTOL, atol: float = ATOL
) -> None:
    """Within the suite's float32 tolerance; a DTensor is compared whole (every rank of its mesh calls this)."""
    actual, expected = whole(torch.as_tensor(actual)).cpu(), whole(torch.as_tensor(expected)).cpu()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def check_grads(
    engine: PipelineEngine,
    reference: nn.Module | OneProcess | Mapping[str, torch.Tensor | None],
    what: str,
    *,
    scale: float = 1.0,
    without_grad: str | None = None,
    compare: Compare = close,
) -> int:
    """Every local gradient equals the reference's under the same name, and every parameter of the reference is held
    by some rank (one missing everywhere would go unchecked); returns how many were checked here. Every rank calls
    it. ``reference``: the one process, or its gradients by name. ``scale``: the engine's are still times it (fp16,
    before the scaler unscales them). ``without_grad``: where the reference has no gradient (frozen, or before a
    detach), the engine's must be "none", or "none or zero"; by default every parameter has one."""
    if isinstance(reference, Mapping):
        expected = dict(reference)
    else:
        expected = {name: param.grad for name, param in _module(reference).named_parameters()}
    held = {name for names in ranks.all_gather_object([n for n, _ in engine.named_parameters()]) for name in names}
    missing, unknown = sorted(set(expected) - held), sorted(held - set(expected))
    assert not missing and not unknown, f"{what}: held by no rank: {missing}, not the model's: {unknown}"
    count = 0
    for name, param in engine.named_parameters():
        if expected[name] is None and without_grad is not None:
            zero = without_grad == "none or zero" and param.grad is not None and not param.grad.any()
            assert param.grad is None or zero, f"{what}: {name} has a gradient, the one process none"
            continue
        assert param.grad is not None, f"{what}: {name} has no gradient on rank {ranks.rank()}"
        assert expected[name] is not None, f"{what}: {name} has a gradient, the one process none"
        grad = whole(param.grad) / scale if scale != 1.0 else param.grad
        compare(grad, expected[name], f"{what}: grad of {name}")
        count += 1
    return count


def check_weights(
    engine: PipelineEngine,
    reference: nn.Module | OneProcess | Mapping[str, torch.Tensor],
    what: str,
    *,
    compare: Compare = close,
) -> None:
    weights = dict(reference) if isinstance(reference, Mapping) else dict(_module(reference).named_parameters())
    for name, param in engine.named_parameters():
        compare(param.detach(), weights[name].detach(), f"{what}: {name}")


def check_clipped(
    engine: PipelineEngine, reference: nn.Module | OneProcess, max_norm: float, what: str, norm_type: float = 2.0
) -> None:
    """clip_grad_norm_ across the engine's stages returns torch's total norm on the reference and clips alike."""
    total = engine.clip_grad_norm_(max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(_module(reference).parameters(), max_norm, norm_type=norm_type)
    close(total, expected, f"{what}: norm")
    check_grads(engine, reference, f"{what}: clipped to {max_norm} ({norm_type}-norm)")


def check_eval(engine: PipelineEngine, reference: OneProcess, x: torch.Tensor, what: str) -> object:
    """eval_step's output on the last stage's rank equals the reference's forward; returns it (None elsewhere)."""
    out = engine.eval_step(x if engine.first else None)
    expected = reference.forward(x)
    if engine.last:
        close(out, expected, what)  # type: ignore[arg-type]
    return out


def step_both(optimizer: torch.optim.Optimizer | None, reference: torch.optim.Optimizer) -> None:
    """Step and zero the engine's optimizer (a rank may have no parameters) and the reference's."""
    for opt in (optimizer, reference):
        if opt is not None:
            opt.step()
            opt.zero_grad()


def save_reference(directory: str | Path, one: OneProcess, optimizer: torch.optim.Optimizer) -> None:
    """Beside an engine's checkpoint, the one process's state and its optimizer's (written by rank 0)."""
    if ranks.rank() == 0:
        torch.save({"model": one.seq.state_dict(), "optimizer": optimizer.state_dict()}, Path(directory) / REFERENCE)


def load_reference(directory: str | Path, one: OneProcess, optimizer: torch.optim.Optimizer) -> None:
    """What save_reference wrote, into a fresh one process and its optimizer (over ``one.parameters()``)."""
    saved = torch.load(Path(directory) / REFERENCE, weights_only=False)
    one.seq.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])


def train_like_one_process(
    engine: PipelineEngine,
    one: OneProcess,
    optimizers: tuple[torch.optim.Optimizer | None, torch.optim.Optimizer],
    steps: int,
    what: str,
    batches: Callable[[int], list[Batch]],
    **how: Any,
) -> int:
    """Each step, ``batches(step)`` holds every replica's (x, y): this rank trains on its replica's, the one process
    on all of them (``how``: OneProcess.step's options); the loss and every gradient must agree, then both
    optimizers step. Returns how many gradients were checked here."""
    checked = 0
    for step in range(steps):
        parts = batches(step)
        x, y = parts[engine.dp_rank]
        loss = engine.train_step(x if engine.first else None, y if engine.last else None)
        expected = one.step(parts, **how)
        close(loss, expected, f"{what} step {step}: loss")
        checked += check_grads(engine, one, f"{what} step {step}")
        step_both(*optimizers)
    return checked


def model_parity(
    model_name: str,
    schedule: str,
    microbatches: list[int],
    sizes: list[int],
    steps: int = 3,
    chunks: int | None = None,
    device: str | None = None,
    checkpoint: str = "never",
) -> None:
    """Loss, gradients and parameters after several AdamW steps equal a single-process model.

    Batch sizes change from step to step; data is on every rank, but only the ends get it.
    """
    build, loss_fn = MODELS[model_name]
    for m in microbatches:
        model = build()
        one = OneProcess(model, loss_fn)
        engine = PipelineEngine(
            model, loss_fn, num_microbatches=m, schedule=schedule, chunks=chunks, device=device, checkpoint=checkpoint
        )
        # eps=1e-6: the attention key bias has a mathematically zero gradient, i.e. ~1e-9 of rounding
        # noise that differs with summation order; AdamW's default eps=1e-8 would blow it up to ~lr
        # a rank may hold only parameter-free stages (e.g. 8 stages of an MLP with 5 Linear layers)
        local = list(engine.parameters())
        optimizer = torch.optim.AdamW(local, lr=1e-3, eps=1e-6) if local else None
        reference_optimizer = torch.optim.AdamW(one.parameters(), lr=1e-3, eps=1e-6)
        checked = train_like_one_process(
            engine,
            one,
            (optimizer, reference_optimizer),
            steps,
            f"{model_name} {schedule} m={m}",
            lambda step: [batch(model_name, sizes[step % len(sizes)], seed=step)],
        )
        check_weights(engine, one, f"{model_name} {schedule} m={m} after {steps} steps")
        assert checked > 0 or not any(True for _ in engine.parameters())


def replicas_parity(model_name: str, schedule: str, data_parallel: int, m: int, size: int, steps: int = 3) -> None:
    """dp replicas of a pipeline equal one process trained on the union of the replicas' batches."""
    build, loss_fn = MODELS[model_name]
    model = build()
    one = OneProcess(model, loss_fn)
    engine = PipelineEngine(model, loss_fn, num_microbatches=m, schedule=schedule, data_parallel=data_parallel)
    assert (engine.dp_rank, engine.rank) == divmod(ranks.rank(), ranks.size() // data_parallel)
    local = list(engine.parameters())
    optimizer = torch.optim.AdamW(local, lr=1e-3, eps=1e-6) if local else None
    reference_optimizer = torch.optim.AdamW(one.parameters(), lr=1e-3, eps=1e-6)
    what = f"{model_name} {schedule} dp={data_parallel}"
    train_like_one_process(
        engine,
        one,
        (optimizer, reference_optimizer),
        steps,
        what,
        lambda step: [batch(model_name, size, seed=100 * step + replica) for replica in range(data_parallel)],
    )
    check_weights(engine, one, f"{what} after {steps} steps")


def backward_from_ones(outputs: list[torch.Tensor]) -> None:
    """A one-process backward from a gradient of ones on each output: what a reference that is not an engine's (a
    FLOP count of a layer's backward, the shapes of its gradients) runs."""
    torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
