"""Hugging Face causal LMs through the pipeline: loss and every gradient equal HF's own ``model(ids, labels=labels)``,
for GPT-2, Llama and Qwen2, and the weights go back out as an HF checkpoint. Tiny models built from configs: nothing
is downloaded."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine, hf, launch
from tests.pipeengine import ranks
from tests.pipeengine.models import SEEDED
from tests.pipeengine.workers import check_grads, check_weights, close, step_both

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH = 64, 8
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min", "dualpipe-v"]


def build(family: str, layers: int = 2, tied: bool = True) -> nn.Module:
    """A tiny causal LM of the family, the same weights on every rank (no dropout: equal to one process)."""
    small = {"vocab_size": VOCAB, "tie_word_embeddings": tied}
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=LENGTH, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                         **small)  # fmt: skip
        kind = transformers.GPT2LMHeadModel
    else:
        config_class, kind = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                              "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]  # fmt: skip
        config = config_class(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=LENGTH, **small)  # fmt: skip
    with SEEDED:
        torch.manual_seed(0)
        return kind(config)


def batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows: labels -100 on the padding (and the ids there arbitrary, as a collator leaves them)."""
    generator = torch.Generator().manual_seed(4000 + seed)
    ids = torch.randint(0, VOCAB, (size, LENGTH), generator=generator)
    labels = ids.clone()
    lengths = torch.randint(2, LENGTH + 1, (size,), generator=generator)
    labels[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = hf.IGNORE
    return ids, labels


def parity(family: str, schedules: list[str], layers: int = 2, data_parallel: int = 1,
           options: dict[str, object] | None = None, tied: bool = True) -> None:  # fmt: skip
    """Two AdamW steps: the engine's loss and every gradient equal HF's token mean over the whole global batch."""
    for schedule in schedules:
        model = build(family, layers, tied)
        reference = copy.deepcopy(model)
        reference_seq = hf.sequential(reference)  # the same names as the engine's, on the reference's parameters
        m = 2 * ranks.size() // data_parallel
        engine = PipelineEngine(hf.sequential(model), hf.causal_lm_loss, num_microbatches=m, schedule=schedule,
                                loss_count=hf.count_labels, data_parallel=data_parallel, **(options or {}))  # type: ignore[arg-type]  # fmt: skip
        # eps=1e-6 (as the other parity tests): a gradient near zero differs by rounding between any two summation
        # orders, and AdamW's default 1e-8 would turn that noise into steps of about lr
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3, eps=1e-6)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
        what = f"{family} {schedule} dp={data_parallel} {options or ''}"
        for step in range(2):
            parts = [batch(2 * m, seed=10 * step + r) for r in range(data_parallel)]
            ids, labels = parts[engine.dp_rank]
            loss = engine.train_step(ids if engine.first else None, labels if engine.last else None)
            expected = reference(torch.cat([p[0] for p in parts]), labels=torch.cat([p[1] for p in parts])).loss
            expected.backward()
            close(loss, expected.item(), f"{what} step {step}: loss")
            check_grads(engine, reference_seq, f"{what} step {step}")
            step_both(optimizer, reference_optimizer)
        check_weights(engine, reference_seq, what)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_every_schedule_equals_hf_on_2_ranks(family: str) -> None:
    launch(parity, 2, args=(family, SCHEDULES), timeout=120, in_process=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family, schedules", [("llama", ["1f1b", "zb-v"]), ("qwen2", ["interleaved", "v-min"])])
def test_on_4_ranks(family: str, schedules: list[str]) -> None:
    launch(parity, 4, args=(family, schedules, 6), timeout=120, in_process=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family, options", [("gpt2", {"checkpoint": "always"}), ("llama", {"checkpoint": "always"})])
def test_with_activation_checkpointing_and_data_parallelism(family: str, options: dict[str, object]) -> None:
    launch(parity, 4, args=(family, ["1f1b"], 2, 2, options), timeout=120, in_process=True)  # dp=2 x pp=2


def every_family_on_processes() -> None:
    for family in ("gpt2", "llama", "qwen2"):
        parity(family, ["1f1b", "zb-v"], tied=family != "qwen2")


@pytest.mark.timeout(180)
def test_the_three_families_on_real_gloo_ranks() -> None:
    launch(every_family_on_processes, 2, timeout=120)


def train_and_export(directory: str, family: str, via_checkpoint: bool) -> None:
    """Train two steps; write an HF checkpoint (directly, or after engine.save and engine.load into a fresh engine)."""
    model = build(family)
    engine = PipelineEngine(hf.sequential(model), hf.causal_lm_loss, num_microbatches=2, loss_count=hf.count_labels)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    for step in range(2):
        ids, labels = batch(4, seed=step)
        engine.train_step(ids if engine.first else None, labels if engine.last else None)
        optimizer.step()
        optimizer.zero_grad()
    ids, _ = batch(4, seed=9)
    logits = engine.eval_step(ids if engine.first else None)
    if via_checkpoint:  # a pipeengine checkpoint, loaded into a fresh engine over a fresh model
        engine.save(f"{directory}/pipeengine")
        model = build(family, tied=True)
        other = torch.Generator().manual_seed(7)  # other weights, alike on every rank (the ranks share one process)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(generator=other)
        engine = PipelineEngine(hf.sequential(model), hf.causal_lm_loss, num_microbatches=2,
                                loss_count=hf.count_labels, partition=[2, 2])  # fmt: skip
        engine.load(f"{directory}/pipeengine")
    written = hf.save_pretrained(engine, model, f"{directory}/hf")
    if engine.last:
        torch.save(logits, f"{directory}/logits.pt")
    assert (written is not None) == (ranks.rank() == 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family, via_checkpoint", [("gpt2", False), ("llama", True)])
def test_save_pretrained_loads_with_from_pretrained_and_computes_the_same(
    family: str, via_checkpoint: bool, tmp_path: Path
) -> None:
    launch(train_and_export, 2, args=(str(tmp_path), family, via_checkpoint), timeout=60, in_process=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids, _ = batch(4, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, torch.load(tmp_path / "logits.pt"), rtol=1e-5, atol=4e-5)
    if family == "gpt2":  # the head stays tied to the embedding
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_an_architecture_it_does_not_know_is_refused_naming_what_is_missing() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.pooler = nn.Linear(2, 2), nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"knows causal LMs laid out as Llama's .* Encoder has children \['encoder', "
                                         r"'pooler'\]"):  # fmt: skip
        hf.sequential(Encoder())


def test_the_planner_plans_an_hf_model_like_any_sequential() -> None:
    from pipeengine.tune import tune

    ids, labels = batch(8, seed=0)
    result = tune(hf.sequential(build("llama", layers=4)), hf.causal_lm_loss, ids, 2, target=labels,
                  schedules=["1f1b", "zb-v"], microbatches=[2, 4], repeats=1)  # fmt: skip
    assert result.rows and {c.schedule for c in result.rows} == {"1f1b", "zb-v"}
    assert all(sum(c.partition) == 6 for c in result.rows)  # the embedding, 4 decoders, the head


def with_tensor_parallel() -> None:
    model = build("llama", layers=2, tied=False)
    reference = copy.deepcopy(model)
    reference_seq = hf.sequential(reference)
    engine = PipelineEngine(hf.sequential(model), hf.causal_lm_loss, num_microbatches=2, loss_count=hf.count_labels,
                            tensor_parallel=2, tp_plan=hf.tp_plan(model))  # fmt: skip
    assert engine.mesh.shape == (1, ranks.size() // 2, 2)  # type: ignore[union-attr]
    ids, labels = batch(4, seed=0)
    loss = engine.train_step(ids if engine.first else None, labels if engine.last else None)
    expected = reference(ids, labels=labels).loss
    expected.backward()
    close(loss, expected.item(), "llama tp=2: loss")
    check_grads(engine, reference_seq, "llama tp=2")


@pytest.mark.timeout(180)
def test_the_models_own_tensor_parallel_plan_translates_to_the_sequential() -> None:
    assert hf.tp_plan(build("llama"))["*.layer.self_attn.q_proj"].__class__.__name__ == "ColwiseParallel"
    launch(with_tensor_parallel, 2, timeout=120)  # one stage over 2 tensor-parallel ranks: the plan is what is tested
