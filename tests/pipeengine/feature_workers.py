"""Workers for the features beyond plain training: activation checkpointing and mixed precision."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from pipeengine import PipelineEngine
from tests.pipeengine.models import MODELS, batch
from tests.pipeengine.workers import parity


def parity_checkpointed(model_name: str, schedule: str, checkpoint: str) -> None:
    ranks = dist.get_world_size()
    parity(model_name, schedule, [ranks, 2 * ranks], [4 * ranks, 2 * ranks], checkpoint=checkpoint)


class SavedBytes:
    """Bytes autograd holds for backward, live, and their peak (a saved_tensors_hooks pair)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> object:
        import weakref

        held = _Held(tensor)
        size = tensor.numel() * tensor.element_size()
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
    assert peaks["always"] < 0.7 * peaks["never"], (dist.get_rank(), peaks)  # 1F1B here: 304 -> 168 KB
    if last:  # "except_last" spares the last stage
        assert peaks["except_last"] == peaks["never"], peaks
    else:
        assert peaks["except_last"] == peaks["always"], (dist.get_rank(), peaks)


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12))


def mixed_precision(schedule: str, precision: str) -> None:
    """Training under autocast tracks one process under the same autocast (to reduced-precision tolerance)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    build, loss_fn = MODELS["transformer"]
    model = build()
    reference = copy.deepcopy(model)
    engine = PipelineEngine(model, loss_fn, num_microbatches=4, schedule=schedule, precision=precision)
    x, y = batch("transformer", 8, seed=0)
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    with torch.autocast("cpu", dtype=dtype):
        expected = loss_fn(reference(x), y)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler.scale(expected).backward()
    scaler.unscale_(reference_optimizer)
    engine.scaler.unscale_()
    out = engine.eval_step(x if engine.first else None)
    assert out is None or out.dtype == dtype, (precision, out.dtype)  # the stages really ran in autocast
    assert abs(loss - expected.item()) < 2e-2 * abs(expected.item()), (loss, expected.item())
    weights = dict(reference.named_parameters())
    for name, param in engine.named_parameters():
        assert param.grad is not None and param.grad.dtype == torch.float32
        if float(weights[name].grad.norm()) > 1e-6:  # type: ignore[union-attr]
            error = relative(param.grad, weights[name].grad)  # type: ignore[arg-type]
            assert error < 3e-2, f"{precision} {schedule}: {name} gradient off by {error:.3%}"


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
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, stepped)
    assert everyone == [False] * dist.get_world_size(), everyone
    assert all(torch.equal(param, before[name]) for name, param in engine.named_parameters())
    assert engine.scaler.scale == 2.0**59
    optimizer.zero_grad()
    engine.scaler.scale = 2.0**10
    engine.train_step(x if engine.first else None, y if engine.last else None)
    assert engine.scaler.step(optimizer)
    assert any(not torch.equal(param, before[name]) for name, param in engine.named_parameters())
