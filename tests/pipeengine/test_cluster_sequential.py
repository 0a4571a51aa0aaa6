"""Any nn.Sequential planned on a cluster (issue 59: "any model"): its FLOPs are FlopCounterMode's, its stages cut
by time and priced by hand on injected figures, its memory counted by hand per schedule, the search's rows priced
as a fixed layout is, tensor parallelism refused, the command line taking the planner's own (model, loss_fn, sample).
No processes; the model is traced on the meta device."""

from __future__ import annotations

import dataclasses
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipeengine.planner.cluster import Hardware, load, send_recv
from pipeengine.planner.cluster.cli import main
from pipeengine.planner.cluster.layout import PIPEENGINE, Layout, check, estimate, price
from pipeengine.planner.cluster.search import candidates, search
from pipeengine.planner.cluster.sequential import Sequential
from tests.pipeengine.hardware import LINK, injected
from tests.pipeengine.parity import backward_from_ones

RATE = 100e12  # the matmul rate: 200 TFLOP/s bf16 at an efficiency of 0.5


def machine(memory: float = 80e9) -> Hardware:
    """Injected figures; a memory bandwidth so high that every op here is priced by its FLOPs."""
    return injected(memory, memory_bandwidth=1e18)


def three() -> nn.Sequential:
    """Three bias-free Linears: a layer's forward is one matmul, its backward one for the input and one for the
    weight (the first layer's input takes no gradient: only the weight's)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256, bias=False), nn.Linear(256, 64, bias=False), nn.Linear(64, 64, bias=False))


def test_a_models_flops_are_flop_counter_modes_over_its_forward_and_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    tokens = torch.randint(0, 50, (3, 7))
    with FlopCounterMode(display=False) as counted:
        backward_from_ones([model(tokens)])
    described = Sequential(model, tokens[:1], seq=7)
    assert described.flops_per_step(3) == counted.get_total_flops() > 0
    assert described.parameters == sum(p.numel() for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())  # the user's model is left as it was


def test_stages_are_cut_by_time_and_priced_per_matmul_with_their_exchanges() -> None:
    hw, b = machine(), 1024
    described = Sequential(three(), torch.zeros(1, 64), seq=1)
    c = 2 * b * 64 * 64 / RATE  # seconds of a 64 x 64 matmul over b rows
    # layer 0: forward 4c, backward 4c (W alone); layer 1: 4c, 8c; layer 2: c, 2c. Two stages: [0 | 1, 2] (8c, 15c)
    layout = Layout(tp=1, pp=2, dp=1, micro_batch=b, num_microbatches=1, recompute=False)
    parts = described.parts(layout, hw, "bf16", PIPEENGINE)
    message = send_recv(b * 256 * 2, LINK)  # layer 0's output, bf16, both ways
    assert parts.forward == pytest.approx([4 * c + message, 5 * c + message])
    assert parts.backward == pytest.approx([4 * c + message, 10 * c + message])
    assert parts.weight == pytest.approx([4 * c, 5 * c])
    priced = price(described, layout, hw, "bf16")
    assert priced.parts["pipeline"] == pytest.approx(sum(parts.forward) + sum(parts.backward))  # 1F1B, m=1
    assert priced.partition == parts.partition == (1, 2)  # the layers of each stage, as PipelineEngine takes them
    assert priced.tokens_per_s == pytest.approx(b / priced.step_s)


def test_memory_holds_the_state_and_each_schedules_activations_in_flight() -> None:
    hw, b = machine(), 8
    described = Sequential(three(), torch.zeros(1, 64), seq=1)
    state = [16 * 64 * 256, 16 * (256 * 64 + 64 * 64)]  # mixed precision: 16 bytes a parameter
    saved = [2 * b * 64, 2 * b * (256 + 64)]  # each Linear saves its input (bf16) for its weight's gradient

    def peak(**fields: object) -> float:
        layout = Layout(tp=1, pp=2, dp=1, micro_batch=b, num_microbatches=4, recompute=False)
        return price(described, dataclasses.replace(layout, **fields), hw, "bf16").peak_bytes

    # 1F1B: the first rank holds pp=2 micro-batches, the last one; GPipe: every rank all four
    assert peak() == max(state[0] + 2 * saved[0], state[1] + saved[1])
    assert peak(pp=1, dp=2) == sum(state) + sum(saved)  # one rank: a micro-batch at a time
    # recomputed: the stage's input per micro-batch in flight, its activations while its backward recomputes them
    inputs = [2 * b * 64, 2 * b * 256]
    assert peak(recompute=True) == max(state[0] + 2 * inputs[0] + saved[0], state[1] + inputs[1] + saved[1])
    # FSDP over 4 replicas: the whole weights and gradients, a quarter of the master and moments
    assert peak(dp=4, fsdp=True) == max(state[0] / 16 * 7 + 2 * saved[0], state[1] / 16 * 7 + saved[1])


def test_the_search_prunes_by_a_bound_below_the_replayed_memory_and_ranks_as_a_fixed_layout_is_priced() -> None:
    hw = machine(memory=12e6)  # a device too small for the replicas' whole copies of this model
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])
    described = Sequential(model, torch.zeros(1, 512), seq=1)
    layouts = candidates(described, 4, hw, 64)
    assert {layout.tp for layout in layouts} == {1} and any(described.layers % layout.pp for layout in layouts)
    for layout in layouts:  # pp=4 of 6 layers: stages of 2, 2, 1, 1 (any pp up to the layers)
        assert estimate(described, layout, hw, "bf16").peak_bytes <= price(described, layout, hw, "bf16").peak_bytes
    plan = search(described, 4, hw, 64, dtype="bf16")
    assert plan.rows and plan.refused and all(row.peak_bytes <= hw.memory_bytes for row in plan.rows)
    for row in plan.rows:
        assert price(described, row.layout, hw, "bf16") == row


def test_tensor_parallelism_and_more_stages_than_layers_are_refused_saying_why() -> None:
    described = Sequential(three(), torch.zeros(1, 64), seq=1)
    with pytest.raises(ValueError, match="tp=2: a generic nn.Sequential is priced without tensor parallelism"):
        check(described, Layout(tp=2, pp=1, dp=1, micro_batch=1, num_microbatches=1), machine())
    with pytest.raises(ValueError, match="pp=2 x chunks=2 stages, but the model has 3 layers"):
        check(described, Layout(1, 2, 1, 1, 4, "interleaved", 2), machine())
    with pytest.raises(TypeError, match="Sequential plans an nn.Sequential, got a Linear"):
        Sequential(nn.Linear(2, 2), torch.zeros(1, 2), seq=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="an nn.Sequential of one layer or more, got an empty one"):
        Sequential(nn.Sequential(), torch.zeros(1, 2), seq=1)
    with pytest.raises(ValueError, match="seq=8, but the sample's sequences are 5 tokens"):
        Sequential(nn.Sequential(nn.Embedding(10, 4)), torch.zeros(1, 5, dtype=torch.long), seq=8)


def test_a_meta_model_of_billions_of_parameters_plans_without_allocating() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(32000, 8192), *[nn.Linear(8192, 8192) for _ in range(64)])
        sample = torch.zeros(1, 4096, dtype=torch.long)
    described = Sequential(model, sample, seq=4096)
    plan = search(described, 64, load("a100-80gb"), 128, dtype="bf16")
    assert described.parameters == 32000 * 8192 + 64 * (8192 * 8192 + 8192)  # 4.6B
    assert plan.best.peak_bytes <= 80e9 and all(p.device.type == "meta" for p in model.parameters())


def test_the_command_line_plans_the_planners_own_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "problem_mlp.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        def problem():
            model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
            return model, nn.functional.mse_loss, torch.zeros(8, 256)

        def with_plan():
            return (*problem(), {"*": None})
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    common = ["--devices", "8", "--global-batch", "64", "--seq", "1", "--plot", str(tmp_path / "plan.png")]
    assert main(["--model", "problem_mlp:problem", *common]) == 0
    printed = capsys.readouterr()
    assert "8 devices (8 a node), 4 layers" in printed.out and " tp1 " in printed.out and "note" not in printed.err
    assert re.search(r"partition \[\d+(, \d+)*\]", printed.out)  # the stages' layers, for PipelineEngine
    assert main(["--model", "problem_mlp:with_plan", *common]) == 0
    assert "the tp_plan is not priced on clusters" in capsys.readouterr().err
    assert main(["--model", "problem_mlp:problem", *common, "--fix", "tp=2,pp=2,dp=2,micro_batch=4"]) == 2
    assert "tp=2: a generic nn.Sequential" in capsys.readouterr().err


class Attention(nn.Module):
    """Causal self-attention over the width's heads of 16 (no projections): scaled_dot_product_attention alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, width = x.shape
        q = x.view(b, s, width // 16, 16).transpose(1, 2)
        return nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(b, s, width)


def test_attention_holds_no_score_matrix_as_a_gpu_s_fused_kernel_keeps_none() -> None:
    described = Sequential(nn.Sequential(nn.Linear(64, 64), Attention()), torch.zeros(1, 256, 64), seq=256)
    (_, attention) = described.profile(1)
    scores = 256 * 256 * 4 * 2  # s x s a head, 4 heads, bf16: what the meta device's math path would save
    assert 0 < attention.saved_bytes < scores


def test_a_model_that_fails_at_a_micro_batch_size_is_planned_at_the_others() -> None:
    """Batch norm over one row fails in training: micro-batches of one are refused saying so, the rest planned."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 8))
    plan = search(Sequential(model, torch.zeros(1, 8), seq=1), 1, machine(), 8, dtype="bf16")
    assert plan.rows and all(row.layout.micro_batch > 1 for row in plan.rows)
    assert any("micro_batch=1: the model fails at this size" in why for why in plan.refused.values())
    assert (
        max(layout.micro_batch for layout in candidates(Sequential(model, torch.zeros(1, 8), seq=1), 1, machine(), 64))
        == 64
    )  # not capped at 16


def test_a_tied_weight_is_held_once_by_the_rank_that_holds_both_its_layers() -> None:
    def model(tied: bool) -> nn.Sequential:
        embed, head = nn.Embedding(100, 32), nn.Linear(32, 100, bias=False)
        if tied:
            head.weight = embed.weight
        return nn.Sequential(embed, head)

    tokens = torch.zeros(1, 4, dtype=torch.long)
    one_rank = Layout(tp=1, pp=1, dp=1, micro_batch=2, num_microbatches=2, recompute=False)
    tied, apart = (price(Sequential(model(t), tokens, seq=4), one_rank, machine(), "bf16") for t in (True, False))
    assert apart.peak_bytes - tied.peak_bytes == 16 * 100 * 32  # the state of one weight of 100 x 32
    two_ranks = dataclasses.replace(one_rank, pp=2)  # each rank its own copy, as the engine's tied ranks hold it
    assert (
        price(Sequential(model(True), tokens, seq=4), two_ranks, machine(), "bf16").peak_bytes
        == price(Sequential(model(False), tokens, seq=4), two_ranks, machine(), "bf16").peak_bytes
    )


def test_when_nothing_fits_the_refusal_names_the_layout_needing_the_least() -> None:
    described = Sequential(three(), torch.zeros(1, 64), seq=1)
    hw = machine(memory=1e4)
    least = min(estimate(described, layout, hw, "bf16").peak_bytes for layout in candidates(described, 4, hw, 16))
    plan = search(described, 4, hw, 16, dtype="bf16")
    assert plan.closest is not None and plan.closest.peak_bytes == least
    with pytest.raises(ValueError, match=f"the one needing the least memory, {plan.closest.layout.describe()}, needs"):
        plan.best  # noqa: B018
