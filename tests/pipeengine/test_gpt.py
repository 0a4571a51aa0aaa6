"""GPT-class models: a head tied to the embedding across ranks, a token-mean loss over padded micro-batches."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine, launch
from tests.pipeengine import ranks
from tests.pipeengine.gpt import IGNORE, VOCAB, WIDTH, count_tokens, one_process_loss, padded_batch, tied_gpt, token_sum
from tests.pipeengine.parity import (
    OneProcess,
    check_clipped,
    check_weights,
    close,
    load_reference,
    save_reference,
    step_both,
    train_like_one_process,
)
from tests.pipeengine.ranks import on_ranks

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]


def tied_parity(
    schedule: str, steps: int = 3, data_parallel: int = 1, options: dict[str, object] | None = None
) -> None:
    """Loss, gradients and weights after several AdamW steps equal one process's token-mean, tie and all."""
    options = options or {}
    model = tied_gpt()
    one = OneProcess(model, one_process_loss)
    m = 2 * (ranks.size() // data_parallel)
    engine = PipelineEngine(
        model,
        token_sum,
        num_microbatches=m,
        schedule=schedule,
        loss_count=count_tokens,
        data_parallel=data_parallel,
        **options,
    )  # type: ignore[arg-type]
    names = [name for name, _ in engine.named_parameters()]
    if engine.first or engine.last:  # every holding rank lists the tie under the model's first name
        assert "0.tokens.weight" in names and f"{len(model) - 1}.out.weight" not in names, names
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(one.parameters(), lr=1e-2)
    train_like_one_process(
        engine,
        one,
        (optimizer, reference_optimizer),
        steps,
        f"tied {schedule} dp={data_parallel} {options}",
        lambda step: [padded_batch(2 * m, seed=10 * step + r, microbatches=m) for r in range(data_parallel)],
    )
    check_weights(engine, one, f"tied {schedule} after {steps} steps")
    tied = dict(engine.named_parameters()).get("0.tokens.weight")
    if tied is not None and engine.last:  # the head and the embedding are one tensor on this rank
        assert engine.stages[engine.schedule.num_stages - 1][-1].out.weight is tied


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
@on_ranks(4, timeout=60, in_process=True)  # 2 ranks: the tie with every schedule is the composition matrix's
def test_a_tied_gpt_with_a_token_mean_loss_trains_like_one_process(schedule: str) -> None:
    tied_parity(schedule)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["zb-v"])  # other schedules with replicas and a tie: the composition matrix
@on_ranks(4, timeout=60, in_process=True)  # 2 replicas of a 2-rank pipeline, each replica's batch padded differently
def test_with_data_parallelism_the_tie_is_summed_and_the_tokens_counted_over_every_replica(schedule: str) -> None:
    tied_parity(schedule, 2, 2)


@pytest.mark.timeout(120)
@on_ranks(4, timeout=90)
def test_on_real_gloo_ranks_the_tie_and_the_token_count_cross_processes() -> None:
    tied_parity("1f1b", 2, 2)  # dp=2 x pp=2 processes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", [{"checkpoint": "except_last"}])  # "always": the composition matrix
@on_ranks(2, timeout=60, in_process=True)
def test_the_tie_composes_with_activation_checkpointing(options: dict[str, object]) -> None:
    tied_parity("zb-h1", 2, 1, options)


@pytest.mark.timeout(120)
@on_ranks(4, timeout=60, in_process=True)
def test_clipping_counts_the_tied_weight_once() -> None:
    """The tied weight counts once in the norm, as torch.nn.utils.clip_grad_norm_ counts it on the whole model."""
    model = tied_gpt()
    one = OneProcess(model, one_process_loss)
    m = 2 * ranks.size()
    engine = PipelineEngine(model, token_sum, num_microbatches=m, schedule="1f1b", loss_count=count_tokens)
    x, y = padded_batch(2 * m, seed=3, microbatches=m)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    one.step([(x, y)])
    check_clipped(engine, one, 0.05, "the tied model")


def tied_save(directory: str, schedule: str) -> None:
    """Train two steps, save; the reference is saved beside it for the ranks that load."""
    model = tied_gpt()
    one = OneProcess(model, one_process_loss)
    m = 2 * ranks.size()
    engine = PipelineEngine(model, token_sum, num_microbatches=m, schedule=schedule, loss_count=count_tokens)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(one.parameters(), lr=1e-2)
    for step in range(2):
        x, y = padded_batch(8, seed=step, microbatches=m)
        engine.train_step(x if engine.first else None, y if engine.last else None)
        one.step([(x, y)])
        step_both(optimizer, reference_optimizer)
    engine.save(directory, optimizer)
    save_reference(directory, one, reference_optimizer)


def tied_load(directory: str, schedule: str) -> None:
    """Another partition and schedule loads it: the tie holds, and training goes on exactly as one process."""
    engine = PipelineEngine(
        tied_gpt(seed=5), token_sum, num_microbatches=ranks.size(), schedule=schedule, loss_count=count_tokens
    )
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    engine.load(directory, optimizer)
    one = OneProcess(tied_gpt(), one_process_loss)
    reference_optimizer = torch.optim.AdamW(one.parameters(), lr=1e-2)
    load_reference(directory, one, reference_optimizer)
    check_weights(engine, one, "after load")
    x, y = padded_batch(8, seed=7, microbatches=ranks.size())
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    close(loss, one.step([(x, y)]), "loss after load")
    step_both(optimizer, reference_optimizer)
    check_weights(engine, one, "one step after load")


def stored_once(directory: str) -> tuple[int, dict[str, str]]:
    """How many parts hold the tied weight, and the other names the checkpoint records."""
    target = Path(directory) / Path(directory, "latest").read_text()
    meta = json.loads((target / "meta.json").read_text())
    holders = sum("0.tokens.weight" in keys for keys in meta["parts"].values())
    return holders, meta["tied"]


@pytest.mark.timeout(120)
def test_a_checkpoint_saved_on_2_ranks_loads_on_4_with_another_schedule_and_keeps_the_tie(tmp_path: Path) -> None:
    launch(tied_save, 2, args=(str(tmp_path), "1f1b"), timeout=60, in_process=True)
    holders, aliases = stored_once(str(tmp_path))
    assert holders == 1 and aliases == {"7.out.weight": "0.tokens.weight"}  # written once, its other name recorded
    launch(tied_load, 4, args=(str(tmp_path), "interleaved"), timeout=60, in_process=True)


def untieable(case: str) -> None:
    """A tie across ranks that cannot be honoured: refused at construction, naming the layers."""
    model = tied_gpt()
    if case == "buffer":  # the same buffer in the first and the last layer
        shared = torch.zeros(3)
        model[0].register_buffer("seen", shared)
        model[-1].register_buffer("seen", shared)
    elif case == "view":  # memory shared through a view of another shape: not one parameter
        model[-1].out = nn.Linear(WIDTH, VOCAB // 2, bias=False)
        model[-1].out.weight = nn.Parameter(model[0].tokens.weight.data[: VOCAB // 2])
    PipelineEngine(model, token_sum, num_microbatches=2, loss_count=count_tokens)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case, error",
    [
        ("buffer", r"buffer '7.seen' \(stage 1\) is the same tensor as '0.seen' \(stage 0\), which runs on another"),
        (
            "view",
            r"parameter '7.out.weight' \(stage 1\) shares memory with '0.tokens.weight' \(stage 0\) but is another",
        ),
    ],
)
def test_a_tie_that_cannot_be_honoured_is_refused_naming_the_layers(case: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        launch(untieable, 2, args=(case,), timeout=30, in_process=True)


def nothing_to_count() -> None:
    engine = PipelineEngine(tied_gpt(), token_sum, num_microbatches=2, loss_count=count_tokens)
    x, y = padded_batch(4, seed=0, microbatches=2)
    engine.train_step(x if engine.first else None, torch.full_like(y, IGNORE) if engine.last else None)


@pytest.mark.timeout(60)
def test_a_step_with_no_token_to_count_is_a_clear_error_on_every_rank() -> None:
    with pytest.raises(ValueError, match="loss_count counted 0 units in every micro-batch") as caught:
        launch(nothing_to_count, 2, timeout=30, in_process=True)
    assert "ValueError: loss_count counted 0" in "\n".join(caught.value.__notes__)  # the other rank too, not a NaN
