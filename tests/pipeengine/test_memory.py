"""Memory measured and predicted: a traced step's per-rank peaks against the simulator fed the sizes it measured."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine
from schedules import Costs, simulate
from tests.pipeengine import ranks
from tests.pipeengine.memory import activation_heavy, step_then_trace, traced_peak
from tests.pipeengine.models import SEEDED
from tests.pipeengine.ranks import on_ranks

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min", "dualpipe-v"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("world", [2, 4])
@on_ranks("world", timeout=60, in_process=True)
def test_the_predicted_peak_of_every_rank_is_within_10_percent_of_the_measured(
    world: int, schedule: str, checkpoint: str, tmp_path: Path
) -> None:
    """One traced step; rank 0 checks every rank's predicted peak against the measured one."""
    path = tmp_path / f"{schedule}.pickle"
    traced_peak(schedule, checkpoint, str(path))
    if ranks.rank() == 0:
        measured, predicted, state, *_ = pickle.loads(path.read_bytes())
        assert len(measured) == len(predicted) == world
        for rank, (m, p) in enumerate(zip(measured, predicted, strict=True)):
            assert abs(p - m) <= 0.10 * m, f"rank {rank}: predicted {p:.0f} bytes, measured {m:.0f}"
        # the activations, not the weights, make these peaks: the test would see a model that forgot them
        assert max(measured) > 3 * max(state)


@pytest.mark.timeout(180)
@on_ranks(2, timeout=90)
def test_on_real_gloo_ranks_where_every_recv_is_posted_first(tmp_path: Path) -> None:
    """The ledger's peaks against the simulator fed the ledger's sizes; and, gloo ranks being processes, the
    allocator's peaks (every allocation) against the simulator fed the computes' transients as well."""
    schedules = ["1f1b", "zb-v"]  # one chunk per rank, and two
    # one process group: the activation-heavy model's steps, then the state-heavy model's (below)
    for schedule in schedules:
        traced_peak(schedule, "never", f"{tmp_path}/{schedule}.pickle")
    state_heavy(schedules, f"{tmp_path}/state.pickle")
    if ranks.rank() != 0:
        return
    results = [pickle.loads((tmp_path / f"{schedule}.pickle").read_bytes()) for schedule in schedules]
    for schedule, (measured, predicted, _, allocated, full) in zip(schedules, results, strict=True):
        for rank, (m, p) in enumerate(zip(measured, predicted, strict=True)):
            assert abs(p - m) <= 0.10 * m, f"{schedule}, rank {rank}: predicted {p:.0f} bytes, measured {m:.0f}"
        for rank, (a, p) in enumerate(zip(allocated, full, strict=True)):
            assert abs(p - a) <= 0.10 * a, f"{schedule}, rank {rank}: predicted {p:.0f} bytes, allocator {a:.0f}"
    where_the_state_dominates(schedules, tmp_path / "state.pickle")


def state_heavy(schedules: list[str], path: str) -> None:
    """Weights, gradients and AdamW's moments outweigh the activations: the optimizer step is a peak of its own."""
    from pipeengine.observe.allocator import optimizer_step_peak

    rows = []
    for schedule in schedules:
        with SEEDED:
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)])
        engine = PipelineEngine(
            model, nn.functional.mse_loss, num_microbatches=4, schedule=schedule, partition="uniform"
        )
        x, y = torch.randn(64, 256), torch.randn(64, 256)
        optimizer = torch.optim.AdamW(engine.parameters())
        step_then_trace(engine, x, y, optimizer)
        stepped = ranks.all_gather_object(optimizer_step_peak(optimizer, engine.parameters()))
        timeline = engine.timeline()
        if timeline is not None:
            assert timeline.allocated_peak is not None
            predicted = simulate(engine.last_program, Costs.from_timeline(timeline))  # type: ignore[arg-type]
            rows.append(
                (
                    [max(a, b) for a, b in zip(timeline.allocated_peak, stepped, strict=True)],
                    predicted.required_memory,
                    timeline.sizes.state,
                )
            )  # type: ignore[union-attr]
    if ranks.rank() == 0:
        Path(path).write_bytes(pickle.dumps(rows))


def where_the_state_dominates(schedules: list[str], path: Path) -> None:
    """There the optimizer step after the step counts: its peak, and the step's, against the allocator's."""
    results = pickle.loads(path.read_bytes())
    for schedule, (allocator, predicted, state) in zip(schedules, results, strict=True):
        assert sum(state) > 0.5 * sum(allocator), (schedule, state, allocator)  # it is the state that dominates
        for rank, (a, p) in enumerate(zip(allocator, predicted, strict=True)):
            assert abs(p - a) <= 0.10 * a, f"{schedule}, rank {rank}: predicted {p:.0f} bytes, allocator {a:.0f}"


@pytest.mark.timeout(60)
@on_ranks(2, timeout=30, in_process=True)
def test_the_state_is_the_weights_their_gradients_and_the_optimizers_copies() -> None:
    engine = PipelineEngine(activation_heavy(), nn.functional.mse_loss, num_microbatches=2, schedule="gpipe")
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with engine.tracing():  # no optimizer given: AdamW's two copies of every parameter
        engine.train_step(x if engine.first else None, y if engine.last else None)
    timeline = engine.timeline()
    if ranks.rank() != 0:
        return
    assert timeline is not None
    sizes, at_start = timeline.sizes, [b for _, b, a in timeline.memory[0] if a is None]  # type: ignore[index]
    weights = 4 * (16 * 16 + 16) * 4  # 4 Linear(16, 16) per stage, float32
    # the gradients come with the stage's first backward: zero_grad(set_to_none=True) leaves none at the start
    assert sizes.state == [4 * weights, 4 * weights] and sizes.grads_late == [weights, weights]
    assert at_start == [3 * weights]
    assert sizes.boundary == [4 * 16 * 4, 0.0]  # one micro-batch of 4 rows of 16 floats leaves stage 0


def test_the_loss_a_step_keeps_per_micro_batch_holds_one_number() -> None:
    """CPU mse_loss returns a 0-d view of its elementwise buffer (a micro-batch's output in size): the losses a step
    keeps to report must not keep those buffers alive (the allocator saw 0.5 MiB per micro-batch more than the model
    on the last stage, and the ledger, which sees no such view, could not count it)."""
    from pipeengine.step.stage import StageWorker

    worker = StageWorker(0, nn.Linear(64, 64), is_last=True, loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(128, 64, requires_grad=True), torch.randn(128, 64)
    assert nn.functional.mse_loss(x, y).untyped_storage().nbytes() == x.numel() * 4  # the view, as torch gives it
    _, loss = worker.forward(0, (x,), False, train=True, target=y)
    assert loss is not None and loss.untyped_storage().nbytes() == 4
    assert loss.item() == pytest.approx(nn.functional.mse_loss(worker.module(x), y).item(), rel=1e-6)
