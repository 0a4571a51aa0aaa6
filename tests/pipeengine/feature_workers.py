"""Workers for the features beyond plain training: activation checkpointing and mixed precision."""

from __future__ import annotations

import copy

import torch
from torch import nn

from pipeengine import PipelineEngine
from tests.pipeengine import ranks
from tests.pipeengine.models import MODELS, batch
from tests.pipeengine.workers import check_grads, close, parity


def parity_checkpointed(model_name: str, schedule: str, checkpoint: str) -> None:
    p = ranks.size()
    parity(model_name, schedule, [p, 2 * p], [4 * p, 2 * p], checkpoint=checkpoint)


class SavedBytes:
    """Bytes autograd holds for backward, live, and their peak (a saved_tensors_hooks pair); meta tensors hold none."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> object:
        import weakref

        held = _Held(tensor)
        size = 0 if tensor.device.type == "meta" else tensor.numel() * tensor.element_size()  # shape inference's
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(held, self._release, size)
        return held

    def _release(self, size: int) -> None:
        self.live -= size

    @staticmethod
    def unpack(held: object) -> torch.Tensor:
        return held.tensor  # type: ignore[attr-defined, no-any-return]


class _Held:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def checkpoint_memory(schedule: str) -> None:
    """Peak bytes saved for backward on each rank: checkpointing must cut them well down."""
    build, loss_fn = MODELS["transformer"]
    x, y = batch("transformer", 16, seed=0)
    peaks = {}
    for mode in ("never", "except_last", "always"):
        engine = PipelineEngine(build(), loss_fn, num_microbatches=8, schedule=schedule, checkpoint=mode)
        meter = SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            engine.train_step(x if engine.first else None, y if engine.last else None)
        peaks[mode] = meter.peak
    last = engine.last
    assert peaks["always"] < 0.7 * peaks["never"], (ranks.rank(), peaks)  # 1F1B here: 304 -> 168 KB
    if last:  # "except_last" spares the last stage
        assert peaks["except_last"] == peaks["never"], peaks
    else:
        assert peaks["except_last"] == peaks["always"], (ranks.rank(), peaks)


def staged_reference(
    model: nn.Sequential,
    bounds: list[tuple[int, int]],
    x: torch.Tensor,
    y: torch.Tensor,
    m: int,
    dtype: torch.dtype,
    loss_fn: object,
    scale: float,
    weight: float | None = None,
) -> float:
    """What the pipeline computes under autocast, in one process: the same operations in the same order.

    Micro-batch by micro-batch, stage by stage under autocast; floating tensors cross each stage
    boundary cast to the autocast dtype (the gradient flows back through the cast); each loss
    counts ``weight`` (default 1/m) and is backpropagated times ``scale`` (fp16), the gradients
    then divided by it.
    Gradients accumulate over the micro-batches in the order every schedule runs them (0, 1, ...).
    Returns the mean loss.
    """
    losses = []
    for xb, yb in zip(x.chunk(m), y.chunk(m), strict=True):
        value: object = xb
        for stage, (start, end) in enumerate(bounds):
            with torch.autocast("cpu", dtype=dtype):
                for layer in model[start:end]:
                    value = layer(value)
            if stage < len(bounds) - 1:
                cast = [
                    t.to(dtype) if t.is_floating_point() else t
                    for t in (value if isinstance(value, tuple) else (value,))
                ]
                value = tuple(cast) if isinstance(value, tuple) else cast[0]
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(value, yb)  # type: ignore[operator]
        (loss.float() * ((1.0 / m if weight is None else weight) * scale)).backward()
        losses.append(loss.detach().float())
    if scale != 1.0:
        for param in model.parameters():
            if param.grad is not None:
                param.grad.mul_(1.0 / scale)
    return float(torch.stack(losses).mean())


def mixed_precision(schedule: str, precision: str) -> None:
    """Training under autocast equals one process that rounds the same way (float32 tolerance).

    The reference does the engine's operations in its order (staged_reference), so the two differ
    only by float32 summation order: the rtol 1e-5 / atol 4e-5 of every other parity test holds.
    A reference under plain autocast over the whole batch would not round the boundaries, nor
    split the batch: its gradients differ by bf16's 2**-8 per operation, several percent in all.
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    build, loss_fn = MODELS["transformer"]
    model = build()
    reference = copy.deepcopy(model)
    m = 4
    engine = PipelineEngine(model, loss_fn, num_microbatches=m, schedule=schedule, precision=precision)
    x, y = batch("transformer", 8, seed=0)
    scale = engine.scaler.scale
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    expected = staged_reference(reference, engine.bounds, x, y, m, dtype, loss_fn, scale)
    engine.scaler.unscale_()
    out = engine.eval_step(x if engine.first else None)
    assert out is None or out.dtype == dtype, (precision, out.dtype)  # the stages really ran in autocast
    close(loss, expected, f"{precision} {schedule}: loss")
    assert all(param.grad is not None and param.grad.dtype == torch.float32 for _, param in engine.named_parameters())
    check_grads(engine, reference, f"{precision} {schedule}")


def scaler_skips_together() -> None:
    """fp16: an overflow on any rank skips the step on every rank and halves the scale."""
    build, loss_fn = MODELS["transformer"]
    engine = PipelineEngine(build(), loss_fn, num_microbatches=2, schedule="1f1b", precision="fp16")
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    x, y = batch("transformer", 4, seed=0)
    before = {name: param.detach().clone() for name, param in engine.named_parameters()}
    engine.scaler.scale = 2.0**60  # the scaled loss overflows fp16 on the way back
    engine.train_step(x if engine.first else None, y if engine.last else None)
    stepped = engine.scaler.step(optimizer)
    engine.scaler.update()
    everyone = ranks.all_gather_object(stepped)
    assert everyone == [False] * ranks.size(), everyone
    assert all(torch.equal(param, before[name]) for name, param in engine.named_parameters())
    assert engine.scaler.scale == 2.0**59
    optimizer.zero_grad()
    engine.scaler.scale = 2.0**10
    engine.train_step(x if engine.first else None, y if engine.last else None)
    assert engine.scaler.step(optimizer)
    assert any(not torch.equal(param, before[name]) for name, param in engine.named_parameters())
