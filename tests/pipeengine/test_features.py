"""Training features: activation checkpointing and mixed precision."""

import copy
import io

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine
from pipeengine.step.precision import GradScaler
from tests.pipeengine import ranks
from tests.pipeengine.models import MODELS, batch
from tests.pipeengine.parity import OneProcess, check_grads, close, model_parity
from tests.pipeengine.ranks import on_ranks


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule, checkpoint", [("interleaved", "except_last")])  # "always": the composition matrix
@on_ranks(2, timeout=60, in_process=True)
def test_checkpointed_training_equals_single_process(schedule: str, checkpoint: str) -> None:
    p = ranks.size()
    model_parity("transformer", schedule, [p, 2 * p], [4 * p, 2 * p], checkpoint=checkpoint)


class StartsCuda(nn.Module):
    """Marks CUDA initialised in its forward, as a library that first touches the GPU there does (torch.compile did
    on a lent GPU, for a CPU rank's stage): torch's checkpoint refused such a forward on a CPU stage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_meta:  # the engine's shape inference runs the stage on the meta device first
            torch.cuda._initialized = True  # type: ignore[attr-defined]
        return x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])  # zb-v: two stages on the rank, a split backward's I and W
@on_ranks(1, timeout=30, in_process=True)
def test_a_cpu_stage_recomputes_its_dropout_exactly_when_cuda_starts_during_its_forward(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint="always" against "never" from one seed, with dropout: the recompute draws the forward's masks (the
    CPU's random state kept and set again), though CUDA was first marked initialised inside the forward, on a machine
    whose accelerator is CUDA (what torch.accelerator gives there: the device whose state torch's checkpoint keeps for
    CPU inputs)."""
    from torch.utils.checkpoint import DefaultDeviceType

    monkeypatch.setattr(DefaultDeviceType, "_default_device_type", "cuda")
    monkeypatch.setattr(torch.cuda, "_initialized", False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), StartsCuda(), nn.Linear(16, 16), nn.Dropout(0.3))
    x, y = torch.randn(4, 8), torch.randn(4, 16)
    found = []
    for checkpoint in ("always", "never"):
        engine = PipelineEngine(
            copy.deepcopy(model), nn.functional.mse_loss, num_microbatches=2, schedule=schedule, checkpoint=checkpoint
        )
        torch.manual_seed(1)
        loss = engine.train_step(x, y)
        found.append((loss, {name: p.grad for name, p in engine.named_parameters()}))
    (loss, grads), (plain_loss, plain_grads) = found
    assert loss == plain_loss
    assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    assert torch.cuda._initialized  # type: ignore[attr-defined]  # the forward did mark it


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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@on_ranks(2, timeout=60, in_process=True)
def test_checkpointing_cuts_the_activations_held_for_backward(schedule: str) -> None:
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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule, precision", [("zb-v", "bf16"), ("interleaved", "fp16")])  # more: the matrix
@on_ranks(2, timeout=60, in_process=True)
def test_mixed_precision_equals_one_process_that_rounds_the_same_way(schedule: str, precision: str) -> None:
    """Training under autocast equals one process that rounds the same way (float32 tolerance).

    The one process does the engine's operations in its order (micro-batch by micro-batch, stage by stage under
    autocast, the boundaries cast: OneProcess.step with bounds and dtype), so the two differ only by float32
    summation order: the rtol 1e-5 / atol 4e-5 of every other parity test holds. A reference under plain autocast
    over the whole batch would not round the boundaries, nor split the batch: its gradients differ by bf16's 2**-8
    per operation, several percent in all.
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    build, loss_fn = MODELS["transformer"]
    model = build()
    one = OneProcess(model, loss_fn)
    m = 4
    engine = PipelineEngine(model, loss_fn, num_microbatches=m, schedule=schedule, precision=precision)
    x, y = batch("transformer", 8, seed=0)
    scale = engine.scaler.scale
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    expected = one.step([(x, y)], microbatches=m, bounds=engine.bounds, dtype=dtype, scale=scale)
    engine.scaler.unscale_()
    out = engine.eval_step(x if engine.first else None)
    assert out is None or out.dtype == dtype, (precision, out.dtype)  # the stages really ran in autocast
    close(loss, expected, f"{precision} {schedule}: loss")
    assert all(param.grad is not None and param.grad.dtype == torch.float32 for _, param in engine.named_parameters())
    check_grads(engine, one, f"{precision} {schedule}")


def fp16_engine() -> tuple[PipelineEngine, torch.optim.SGD, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A 2-stage fp16 engine, its SGD, a batch, and its weights before any step."""
    build, loss_fn = MODELS["transformer"]
    engine = PipelineEngine(build(), loss_fn, num_microbatches=2, schedule="1f1b", precision="fp16")
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    x, y = batch("transformer", 4, seed=0)
    before = {name: param.detach().clone() for name, param in engine.named_parameters()}
    return engine, optimizer, x, y, before


@pytest.mark.timeout(120)
@on_ranks(2, timeout=60, in_process=True)
def test_fp16_overflow_skips_the_step_on_every_rank() -> None:
    """fp16: an overflow on any rank skips the step on every rank and halves the scale."""
    engine, optimizer, x, y, before = fp16_engine()
    engine.scaler.scale = 2.0**60  # the scaled loss overflows fp16 on the way back
    engine.train_step(x if engine.first else None, y if engine.last else None)
    stepped = engine.scaler.step(optimizer)
    engine.scaler.update()
    everyone = ranks.all_gather_object(stepped)
    assert everyone == [False] * ranks.size(), everyone
    assert all(torch.equal(param, before[name]) for name, param in engine.named_parameters())
    assert engine.scaler.scale == 2.0**59


@pytest.mark.timeout(120)
@on_ranks(2, timeout=60, in_process=True)
def test_fp16_an_inf_in_one_stages_gradient_alone_skips_the_step_on_every_rank() -> None:
    """fp16: an inf in the last stage's gradient alone skips the step on every rank and halves the scale; the skip
    is that step's alone (the next, finite, steps)."""
    engine, optimizer, x, y, before = fp16_engine()
    engine.scaler.scale = 2.0**10
    engine.train_step(x if engine.first else None, y if engine.last else None)
    if engine.last:  # an inf in one stage's gradient alone (the others' are finite): every rank still skips
        next(iter(engine.stages[max(engine.stages)].parameters())).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
    everyone = ranks.all_gather_object(engine.scaler.step(optimizer))
    engine.scaler.update()
    assert everyone == [False] * ranks.size(), f"one stage's inf: stepped {everyone}"
    assert all(torch.equal(param, before[name]) for name, param in engine.named_parameters())
    assert engine.scaler.scale == 2.0**9
    optimizer.zero_grad()
    engine.train_step(x if engine.first else None, y if engine.last else None)
    assert engine.scaler.step(optimizer)
    assert any(not torch.equal(param, before[name]) for name, param in engine.named_parameters())


def scaler(growth_interval: int) -> tuple[GradScaler, nn.Parameter]:
    """An fp16 scaler of one parameter on one rank (agreeing with itself)."""
    param = nn.Parameter(torch.ones(3))
    return GradScaler(
        lambda: iter([param]),
        True,
        torch.device("cpu"),
        lambda found: None,
        init_scale=8.0,
        growth_interval=growth_interval,
    ), param


def good_step(scale: GradScaler, param: nn.Parameter, finite: bool = True) -> bool:
    param.grad = torch.full((3,), scale.scale if finite else float("inf"))
    stepped = scale.step(torch.optim.SGD([param], lr=0.0))
    scale.update()
    return stepped


def test_fp16_scale_grows_after_exactly_growth_interval_good_steps_and_an_overflow_restarts_the_count() -> None:
    scale, param = scaler(growth_interval=3)
    seen = [(good_step(scale, param, finite), scale.scale) for finite in [True] * 6 + [True, False] + [True] * 3]
    assert seen == [
        (True, 8.0),
        (True, 8.0),
        (True, 16.0),
        (True, 16.0),
        (True, 16.0),
        (True, 32.0),  # every 3rd
        (True, 32.0),
        (False, 16.0),  # an overflow halves it and the count starts again
        (True, 16.0),
        (True, 16.0),
        (True, 32.0),
    ]


def test_fp16_scale_resumes_its_growth_count() -> None:
    """Two good steps, saved (as a checkpoint's extra is, weights_only), loaded into a new scaler: the third grows."""
    scale, param = scaler(growth_interval=3)
    good_step(scale, param)
    good_step(scale, param)
    buffer = io.BytesIO()
    torch.save(scale.state_dict(), buffer)
    buffer.seek(0)
    resumed, param = scaler(growth_interval=1000)  # its own settings are replaced by the saved ones
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert (resumed.scale, resumed.growth_interval) == (8.0, 3)
    good_step(resumed, param)
    assert resumed.scale == 16.0
