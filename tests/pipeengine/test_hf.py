"""Hugging Face causal LMs through the pipeline: loss and every gradient equal HF's own ``model(ids, labels=labels)``,
for GPT-2, Llama and Qwen2, and the weights go back out as an HF checkpoint. Tiny models built from configs: nothing
is downloaded."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine, hf, launch
from tests.pipeengine import ranks
from tests.pipeengine.hf_models import LENGTH, VOCAB, batch, build
from tests.pipeengine.parity import OneProcess, check_grads, check_weights, close, step_both
from tests.pipeengine.ranks import on_ranks

transformers = pytest.importorskip("transformers")

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min", "dualpipe-v"]


PAD = 0  # the pad token of the left-padded batches


def left_padded(size: int, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Left-padded rows as a chat template's collator makes them: ((ids, attention_mask), labels), the padding's
    ids the pad token, its mask 0, its labels -100; one row unpadded."""
    generator = torch.Generator().manual_seed(5000 + seed)
    ids = torch.randint(1, VOCAB, (size, LENGTH), generator=generator)
    lengths = torch.randint(2, LENGTH + 1, (size,), generator=generator)
    lengths[0] = LENGTH
    padding = torch.arange(LENGTH)[None, :] < (LENGTH - lengths)[:, None]
    ids[padding] = PAD
    labels = ids.masked_fill(padding, hf.IGNORE)
    return (ids, (~padding).long()), labels


def hf_loss(
    model: nn.Module, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor
) -> torch.Tensor:
    """HF's own loss of a whole batch: ``model(ids, labels=labels)``; left-padded (ids, mask): with its attention
    mask."""
    if isinstance(x, tuple):
        ids, mask = x
        return model(ids, attention_mask=mask, labels=labels).loss  # type: ignore[no-any-return]
    return model(x, labels=labels).loss  # type: ignore[no-any-return]


def parity(
    family: str,
    schedules: list[str],
    layers: int = 2,
    data_parallel: int = 1,
    options: dict[str, object] | None = None,
    tied: bool = True,
    padding: str = "right",
    config: dict[str, object] | None = None,
    accumulate: int = 1,
) -> None:
    """Two AdamW steps: the engine's loss and every gradient equal HF's token mean over the whole global batch
    (``model(ids, labels=labels)``; left padding: ``model(ids, attention_mask=mask, labels=labels)``, the engine given
    (ids, mask); "packed": rows of documents, a row a micro-batch, the engine given (ids, position_ids) and equal to
    each document run on its own). ``accumulate``: train_steps before each optimizer step, no zero_grad between
    (gradients add)."""
    packing = padding == "packed"
    make = {"left": left_padded, "packed": packed}.get(padding, batch)
    for schedule in schedules:
        model = build(family, layers, tied, **(config or {}))
        # seq: the engine's names, on the copy's parameters
        one = OneProcess(
            model, seq=lambda m: hf.sequential(m, packed=packing), run=separate_documents if packing else hf_loss
        )
        m = 2 * ranks.size() // data_parallel
        engine = PipelineEngine(
            hf.sequential(model, packed=packing),
            hf.causal_lm_loss,
            num_microbatches=m,
            schedule=schedule,
            loss_count=hf.count_labels,
            data_parallel=data_parallel,
            **(options or {}),
        )  # type: ignore[arg-type]
        # eps=1e-6 (as the other parity tests): a gradient near zero differs by rounding between any two summation
        # orders, and AdamW's default 1e-8 would turn that noise into steps of about lr
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3, eps=1e-6)
        reference_optimizer = torch.optim.AdamW(one.model.parameters(), lr=1e-3, eps=1e-6)
        what = f"{family} {schedule} dp={data_parallel} {options or ''} {config or ''} {padding} padding"
        rows = m if packing else 2 * m
        for step in range(2):
            for part in range(accumulate):
                seed = 10 * step + 3 * part
                parts = [make(rows, seed=seed + r) for r in range(data_parallel)]  # type: ignore[operator]
                inputs, labels = parts[engine.dp_rank]
                loss = engine.train_step(inputs if engine.first else None, labels if engine.last else None)
                close(loss, one.step(parts), f"{what} step {step}.{part}: loss")
                check_grads(engine, one, f"{what} step {step}, {part + 1} accumulated")
            step_both(optimizer, reference_optimizer)
        check_weights(engine, one, what)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family, schedules", [("gpt2", SCHEDULES), ("qwen2", ["gpipe", "dualpipe-v"])])
@on_ranks(2, timeout=120, in_process=True)
def test_every_schedule_equals_hf_on_2_ranks(family: str, schedules: list[str]) -> None:
    """Right-padded rows: GPT-2 on every schedule (a Llama too: the composition matrix; left-padded and packed rows
    below), Qwen2 on two more (and on 4 ranks, below)."""
    parity(family, schedules)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family, schedules", [("llama", ["1f1b", "zb-v"]), ("qwen2", ["interleaved", "v-min"])])
@on_ranks(4, timeout=120, in_process=True)
def test_on_4_ranks(family: str, schedules: list[str]) -> None:
    parity(family, schedules, 6)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family, options", [("gpt2", {"checkpoint": "always"})])  # a Llama: the composition matrix
@on_ranks(4, timeout=120, in_process=True)
def test_with_activation_checkpointing_and_data_parallelism(family: str, options: dict[str, object]) -> None:
    parity(family, ["1f1b"], 2, 2, options)  # dp=2 x pp=2


@pytest.mark.timeout(180)
@on_ranks(2, timeout=120)
def test_the_three_families_on_real_gloo_ranks() -> None:
    for family in ("gpt2", "llama", "qwen2"):
        parity(family, ["1f1b", "zb-v"], tied=family != "qwen2")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family, via_checkpoint", [("gpt2", False), ("llama", True)])
@on_ranks(2, timeout=60, in_process=True)
def test_save_pretrained_loads_with_from_pretrained_and_computes_the_same(
    family: str, via_checkpoint: bool, tmp_path: Path
) -> None:
    """Train two steps; write an HF checkpoint (directly, or after engine.save and engine.load into a fresh engine):
    transformers loads it, and it computes the engine's logits."""
    directory = str(tmp_path)
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
        engine = PipelineEngine(
            hf.sequential(model), hf.causal_lm_loss, num_microbatches=2, loss_count=hf.count_labels, partition=[2, 2]
        )
        engine.load(f"{directory}/pipeengine")
    written = hf.save_pretrained(engine, model, f"{directory}/hf")
    if engine.last:
        torch.save(logits, f"{directory}/logits.pt")
    assert (written is not None) == (ranks.rank() == 0)
    ranks.barrier()  # the checkpoint and the logits written
    if ranks.rank() != 0:
        return
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

    with pytest.raises(
        ValueError,
        match=r"knows causal LMs laid out as Llama's .* Encoder has children \['encoder', "
        r"'pooler'\]",
    ):
        hf.sequential(Encoder())


def test_the_planner_plans_an_hf_model_like_any_sequential() -> None:
    from pipeengine.tune import tune

    ids, labels = batch(8, seed=0)
    result = tune(
        hf.sequential(build("llama", layers=4)),
        hf.causal_lm_loss,
        ids,
        2,
        target=labels,
        schedules=["1f1b", "zb-v"],
        microbatches=[2, 4],
        repeats=1,
    )
    assert result.rows and {c.schedule for c in result.rows} == {"1f1b", "zb-v"}
    assert all(sum(c.partition) == 6 for c in result.rows)  # the embedding, 4 decoders, the head


@pytest.mark.timeout(180)
@on_ranks(2, timeout=150)
def test_the_models_own_tensor_parallel_plan_translates_to_the_sequential() -> None:
    """One stage over 2 tensor-parallel ranks (the plan is what is tested), then left padding with tensor_parallel=2
    and packed rows with fsdp=True (data_parallel=2)."""
    assert hf.tp_plan(build("llama"))["*.layer.self_attn.q_proj"].__class__.__name__ == "ColwiseParallel"
    model = build("llama", layers=2, tied=False)
    one = OneProcess(model, seq=hf.sequential, run=hf_loss)
    engine = PipelineEngine(
        hf.sequential(model),
        hf.causal_lm_loss,
        num_microbatches=2,
        loss_count=hf.count_labels,
        tensor_parallel=2,
        tp_plan=hf.tp_plan(model),
    )
    assert engine.mesh.shape == (1, ranks.size() // 2, 2)  # type: ignore[union-attr]
    ids, labels = batch(4, seed=0)
    loss = engine.train_step(ids if engine.first else None, labels if engine.last else None)
    close(loss, one.step([(ids, labels)]), "llama tp=2: loss")
    check_grads(engine, one, "llama tp=2")
    # the mask (left padding) across tensor-parallel ranks, the position ids (packed rows) across sharded replicas
    tensor = {"tensor_parallel": 2, "tp_plan": hf.tp_plan(model)}
    parity("llama", ["1f1b"], options=tensor, tied=False, padding="left", config={"pad_token_id": PAD})
    parity(
        "llama",
        ["1f1b"],
        data_parallel=2,
        options={"fsdp": True},
        padding="packed",
        config={"attn_implementation": "sdpa"},
    )


# per-head q_norm/k_norm (Qwen3, Gemma 3: each rank's gradient its heads' part, summed over the tensor-parallel ranks;
# Qwen3's over two accumulated train_steps too), OLMo 2's over the whole projection (q/k/v gathered: attention whole
# on each rank, as Phi-3's), Cohere's per-head weights (heads, head_dim) as Command R+ sets them (each rank its heads'
# rows)
QK_NORMS: list[tuple[str, dict[str, object], int]] = [
    ("qwen3", {"attn_implementation": "sdpa"}, 2),
    ("gemma3", {"attn_implementation": "eager"}, 1),
    ("olmo2", {"attn_implementation": "sdpa"}, 1),
    ("phi3", {"attn_implementation": "sdpa"}, 1),
    ("cohere", {"attn_implementation": "eager", "use_qk_norm": True}, 1),
]


@pytest.mark.timeout(180)
@on_ranks(2, timeout=150)
def test_qk_norms_under_tensor_parallel_equal_hf_with_the_models_own_plan() -> None:
    """tensor_parallel=2 (one stage) with hf.tp_plan alone: loss, every gradient (q_norm's and k_norm's included) and
    the weights after two AdamW steps equal one process."""
    for family, config, accumulate in QK_NORMS:
        plan = hf.tp_plan(build(family, 2, True, **config))  # the model's own plan, nothing by hand
        parity(family, ["1f1b"], options={"tensor_parallel": 2, "tp_plan": plan}, config=config, accumulate=accumulate)


def test_a_parameter_of_attention_split_by_heads_that_the_plan_leaves_out_is_refused_naming_it() -> None:
    """Qwen3's plan without its q_norm/k_norm entries: each rank would apply them whole to its heads, its gradient
    of them its heads' alone."""
    model = build("qwen3")
    config: Any = model.config
    config.base_model_tp_plan = {k: v for k, v in config.base_model_tp_plan.items() if "norm" not in k}
    with pytest.raises(
        ValueError,
        match=r"Qwen3ForCausalLM's tp plan splits self_attn by heads \(a column-wise "
        r"projection\) and says nothing of self_attn.q_norm "
        r"\(parameters \[\(8,\)\]\)",
    ):
        hf.tp_plan(model)


def test_plan_entries_outside_the_decoder_layers_stay_whole_and_an_unknown_layer_style_is_refused() -> None:
    """transformers 5.17's Llama plan (seen on a lent GPU's image) adds 'embed_tokens': 'embedding_rowwise': the
    translation is the layers' alone, as without it; a per-layer style pipeengine does not know is refused, naming
    it."""
    model = build("llama")
    config: Any = model.config
    plan = dict(config.base_model_tp_plan)
    layers = {key: type(style) for key, style in hf.tp_plan(model).items()}
    config.base_model_tp_plan = {"embed_tokens": "embedding_rowwise", **plan, "norm": "replicated_with_grad_allreduce"}
    assert {key: type(style) for key, style in hf.tp_plan(model).items()} == layers
    config.base_model_tp_plan = {**plan, "layers.*.mlp.up_proj": "packed_colwise"}
    with pytest.raises(
        ValueError, match=r"LlamaForCausalLM's tp plan entry 'layers\.\*\.mlp\.up_proj': 'packed_colwise' is not one"
    ):
        hf.tp_plan(model)


EXACT = [
    "llama",
    "qwen2-window",
    "qwen3",
    "mistral",
    "phi3",
    "starcoder2",
    "gemma",
    "mixtral",
    "qwen2_moe",
    "olmo2",
    "gemma2",
    "cohere",
    "granite",
    "gemma3",
]


@pytest.mark.timeout(240)
@on_ranks(2, timeout=200, in_process=True)
def test_every_family_it_takes_equals_hf_past_the_sliding_window() -> None:
    """Each family it takes, past its sliding window (LENGTH 8, window 3), on a schedule each, attention by sdpa and
    by eager in turn."""
    for index, family in enumerate(EXACT):
        attention = "eager" if family == "gemma2" else ("sdpa", "eager")[index % 2]  # Gemma 2: eager alone
        parity(
            family,
            [SCHEDULES[index % len(SCHEDULES)]],
            config={"attn_implementation": attention},
            tied=family not in ("qwen2_moe", "olmo2"),
        )


@pytest.mark.parametrize(
    "family, config, error",
    [
        ("mixtral", {"output_router_logits": True}, r"config.output_router_logits=True adds the router's auxiliary"),
        ("gemma3", {"use_bidirectional_attention": True}, r"config.use_bidirectional_attention=True attends both"),
    ],
)
def test_a_family_it_would_compute_wrongly_is_refused_naming_the_field(
    family: str, config: dict[str, object], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        hf.sequential(build(family, attn_implementation="eager", **config))


@pytest.mark.timeout(240)
@on_ranks(2, timeout=200, in_process=True)
def test_left_padded_batches_with_their_mask_equal_hf_on_every_schedule() -> None:
    parity("llama", SCHEDULES, padding="left", config={"pad_token_id": PAD})
    parity("gpt2", ["1f1b", "zb-v"], padding="left")
    parity("mistral", ["interleaved"], padding="left", config={"attn_implementation": "eager"})  # and the window


DOCUMENTS = [[3, 5], [2, 2, 4], [LENGTH], [4, 4], [1, 7], [5, 3], [2, 6], [6, 2]]  # each row's documents' lengths


def packed(size: int, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Rows packed with documents as transformers' DataCollatorWithFlattening makes them: ((ids, position_ids),
    labels), the positions restarting at each document, the label of its first token -100 (no document predicts
    another's)."""
    generator = torch.Generator().manual_seed(6000 + seed)
    ids = torch.randint(2, VOCAB, (size, LENGTH), generator=generator)
    rows = [DOCUMENTS[(seed + r) % len(DOCUMENTS)] for r in range(size)]
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    return (ids, positions), ids.masked_fill(positions == 0, hf.IGNORE)


def separate_documents(model: nn.Module, x: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """The reference: each document of each row through the model on its own (``model(document)``), the summed
    next-token loss of all of them over the count of labels that count."""
    ids, positions = x
    total = torch.zeros(())
    for row in range(ids.shape[0]):
        starts = [*(positions[row] == 0).nonzero().flatten().tolist(), ids.shape[1]]
        for a, b in zip(starts[:-1], starts[1:], strict=False):
            total = total + hf.causal_lm_loss(model(ids[row : row + 1, a:b]).logits, labels[row : row + 1, a:b])
    return total / hf.count_labels(labels)


@pytest.mark.timeout(240)
@on_ranks(2, timeout=200, in_process=True)
def test_packed_rows_equal_their_documents_run_separately_on_every_schedule() -> None:
    parity("llama", SCHEDULES, padding="packed", config={"attn_implementation": "sdpa"})
    parity("gpt2", ["zb-v"], padding="packed", config={"attn_implementation": "eager"})  # its learned positions


def test_a_packed_sequential_without_position_ids_is_refused() -> None:
    seq = hf.sequential(build("llama"), packed=True)
    with pytest.raises(ValueError, match=r"packed=True\) takes \(input_ids, position_ids\)"):
        seq(packed(2, seed=0)[0][0])


def left_padded_without_mask() -> None:
    model = build("llama", pad_token_id=PAD)
    engine = PipelineEngine(hf.sequential(model), hf.causal_lm_loss, num_microbatches=2, loss_count=hf.count_labels)
    (ids, _), labels = left_padded(4, seed=0)
    engine.train_step(ids if engine.first else None, labels if engine.last else None)


@pytest.mark.timeout(60)
def test_a_left_padded_batch_without_its_mask_is_refused_saying_how_to_pass_it() -> None:
    with pytest.raises(
        Exception,
        match=r"starts with the pad token \(pad_token_id=0\) and has tokens after it: a "
        r"left-padded batch needs its attention mask. Pass the inputs as \(input_ids, "
        r"attention_mask\)",
    ):
        launch(left_padded_without_mask, 2, timeout=30, in_process=True)


@pytest.mark.timeout(120)
@on_ranks(2, timeout=90, in_process=True)
def test_gradients_accumulated_over_steps_equal_hf_with_the_head_tied_across_ranks() -> None:
    parity("gpt2", ["1f1b"], accumulate=2)  # the tied embedding and head across 2 ranks: G1 + G2, not 2 G1 + G2


def heads_refused(kv_heads: int, heads: int) -> None:
    model = build("llama", num_key_value_heads=kv_heads, num_attention_heads=heads, hidden_size=8 * heads)
    PipelineEngine(
        hf.sequential(model), hf.causal_lm_loss, num_microbatches=2, tensor_parallel=2, tp_plan=hf.tp_plan(model)
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kv_heads, heads", [(1, 4), (3, 3)])
def test_a_tensor_parallel_degree_that_splits_a_head_is_refused_naming_the_heads(kv_heads: int, heads: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"tensor_parallel=2 splits LlamaForCausalLM's attention by heads, and its "
        rf"{heads} attention heads and {kv_heads} key-value heads do not both divide",
    ):
        launch(heads_refused, 2, args=(kv_heads, heads), timeout=30, in_process=True)


@pytest.mark.timeout(180)
@on_ranks(4, timeout=150)
def test_save_pretrained_after_tensor_parallel_or_fsdp_training_loads_and_computes_the_same(tmp_path: Path) -> None:
    """Trained on 4 gloo ranks with tensor parallelism or FSDP, then exported: save_pretrained writes whole
    tensors of the model given to hf.sequential (its layers parallelized or sharded now); transformers loads them,
    and they compute the engine's logits."""
    directory = str(tmp_path)
    # a tied GPT-2 sharded, a Llama over tensor-parallel ranks (a Llama sharded: the composition matrix)
    cases = [("gpt2", {"data_parallel": 2, "fsdp": True}), ("llama", {"tensor_parallel": 2})]
    for index, (family, options) in enumerate(cases):
        model = build(family, tied=family == "gpt2")
        plan = {"tp_plan": hf.tp_plan(model)} if "tensor_parallel" in options else {}
        engine = PipelineEngine(
            hf.sequential(model), hf.causal_lm_loss, num_microbatches=2, loss_count=hf.count_labels, **options, **plan
        )  # type: ignore[arg-type]
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
        ids, labels = batch(4, seed=index)
        engine.train_step(ids if engine.first else None, labels if engine.last else None)
        optimizer.step()
        logits = engine.eval_step(ids if engine.first else None)
        written = hf.save_pretrained(engine, model, f"{directory}/{index}")
        assert (written is not None) == (ranks.rank() == 0)
        if engine.last and engine.dp_rank == 0 and engine.tp_rank == 0:
            torch.save(logits, f"{directory}/{index}.pt")
    ranks.barrier()  # the checkpoints and the logits written
    if ranks.rank() != 0:
        return
    for index in range(2):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / str(index))
        ids, _ = batch(4, seed=index)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, torch.load(tmp_path / f"{index}.pt"), rtol=1e-5, atol=4e-5)


def test_the_adapter_makes_transformers_warn_nothing() -> None:
    """No FutureWarning (the mask functions' past_key_values, renamed in transformers 5) nor any other, per call."""
    ids, _ = batch(2, seed=0)
    (padded, mask), _ = left_padded(2, seed=0)
    for family in ("llama", "gpt2", "qwen2-window"):
        seq = hf.sequential(build(family))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seq(ids)
            seq((padded, mask))
        assert not caught, [f"{w.category.__name__}: {w.message}" for w in caught]
