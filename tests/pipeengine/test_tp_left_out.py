"""A tensor-parallel plan written by hand that leaves out a module working per head (pipeengine.parallel.leftout):
a weight with a row per head refused when the engine is built; a whole parameter whose gradient each rank computes
only its part of refused at the first train_step, on every rank, before an optimizer could step on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine, hf
from tests.pipeengine.hf_models import batch, build
from tests.pipeengine.models import SEEDED
from tests.pipeengine.parity import OneProcess, check_grads
from tests.pipeengine.ranks import on_ranks

transformers = pytest.importorskip("transformers")


def attention_plan() -> dict[str, object]:
    """What a user writes by hand from torch's styles: q/k/v by columns, o by rows, the norms left out."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    columns = {f"*.layer.self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    return {**columns, "*.layer.self_attn.o_proj": RowwiseParallel()}


class PerGroupScale(nn.Module):
    """A weight applied to each group of ``size`` features (a head), as Qwen3's q_norm after a column-wise q_proj."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = x.unflatten(-1, (-1, self.weight.numel())) * self.weight
        return scaled.flatten(-2)


def scaled_mlp() -> nn.Sequential:
    with SEEDED:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), PerGroupScale(4), nn.Linear(16, 8))


@pytest.mark.timeout(90)
@on_ranks(2, timeout=60)
def test_a_whole_parameter_whose_gradient_differs_over_the_tensor_parallel_ranks_is_refused_at_the_first_step() -> None:
    """Qwen3 with its q_norm/k_norm left out, then plain torch layers with a per-group weight left out: each refused
    at the first step, on both ranks, naming the parameters; marked ReplicatedGradSum, the latter trains as one
    process."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pipeengine.parallel.styles import ReplicatedGradSum

    model = build("qwen3", layers=1)
    engine = PipelineEngine(
        hf.sequential(model), hf.causal_lm_loss, num_microbatches=2, tensor_parallel=2, tp_plan=attention_plan()
    )
    ids, labels = batch(4, seed=0)
    with pytest.raises(
        ValueError,
        match=r"1\.layer\.self_attn\.q_norm\.weight \(by up to .*"
        r"1\.layer\.self_attn\.k_norm\.weight .*ReplicatedGradSum\(\)",
    ):
        engine.train_step(ids, labels)
    plan: dict[str, object] = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    engine = PipelineEngine(scaled_mlp(), nn.functional.mse_loss, num_microbatches=2, tensor_parallel=2, tp_plan=plan)
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"differ across the tensor-parallel ranks of their stage: 1\.weight "):
        engine.train_step(x, y)
    one = OneProcess(scaled_mlp(), nn.functional.mse_loss)
    engine = PipelineEngine(
        scaled_mlp(),
        nn.functional.mse_loss,
        num_microbatches=2,
        tensor_parallel=2,
        tp_plan={**plan, "1": ReplicatedGradSum()},
    )
    engine.train_step(x, y)
    one.step([(x, y)])
    check_grads(engine, one, "a per-group weight marked ReplicatedGradSum")


def test_a_weight_with_a_row_per_head_beside_a_column_wise_projection_is_refused_when_built() -> None:
    """Cohere's q_norm/k_norm (heads, head_dim) with use_qk_norm, left out: named, with the modules they sit in,
    before any stage is cut (the forward would fail on shapes); hf.tp_plan's HeadRows passes."""
    from pipeengine.parallel.tensor import plan_matches

    model = build("cohere", layers=1, use_qk_norm=True)
    with pytest.raises(
        ValueError,
        match=r"q_norm\.weight \(4, 8\) beside q_proj \(out_features 32\) in "
        r"1\.layer\.self_attn; k_norm\.weight \(2, 8\) beside "
        r"k_proj \(out_features 16\) in .*HeadRows\(\)",
    ):
        plan_matches(hf.sequential(model), attention_plan(), 2)
    plan_matches(hf.sequential(model), hf.tp_plan(model), 2)
