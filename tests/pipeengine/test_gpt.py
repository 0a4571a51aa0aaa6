"""GPT-class models: a head tied to the embedding across ranks, a token-mean loss over padded micro-batches."""

from pathlib import Path

import pytest

from pipeengine import launch
from tests.pipeengine import gpt_workers

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("ranks", [4])  # 2 ranks: the tie with every schedule is the composition matrix's
def test_a_tied_gpt_with_a_token_mean_loss_trains_like_one_process(schedule: str, ranks: int) -> None:
    launch(gpt_workers.tied_parity, ranks, args=(schedule,), timeout=60, in_process=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["zb-v"])  # other schedules with replicas and a tie: the composition matrix
def test_with_data_parallelism_the_tie_is_summed_and_the_tokens_counted_over_every_replica(schedule: str) -> None:
    # 4 ranks: 2 replicas of a 2-rank pipeline, each replica's batch padded differently
    launch(gpt_workers.tied_parity, 4, args=(schedule, 2, 2), timeout=60, in_process=True)


@pytest.mark.timeout(120)
def test_on_real_gloo_ranks_the_tie_and_the_token_count_cross_processes() -> None:
    launch(gpt_workers.tied_parity, 4, args=("1f1b", 2, 2), timeout=90)  # dp=2 x pp=2 processes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", [{"checkpoint": "except_last"}])  # "always": the composition matrix
def test_the_tie_composes_with_activation_checkpointing(options: dict[str, str]) -> None:
    launch(gpt_workers.tied_parity, 2, args=("zb-h1", 2, 1, options), timeout=60, in_process=True)


@pytest.mark.timeout(120)
def test_clipping_counts_the_tied_weight_once() -> None:
    launch(gpt_workers.tied_clipping, 4, args=("1f1b",), timeout=60, in_process=True)


@pytest.mark.timeout(120)
def test_a_checkpoint_saved_on_2_ranks_loads_on_4_with_another_schedule_and_keeps_the_tie(tmp_path: Path) -> None:
    launch(gpt_workers.tied_save, 2, args=(str(tmp_path), "1f1b"), timeout=60, in_process=True)
    holders, aliases = gpt_workers.stored_once(str(tmp_path))
    assert holders == 1 and aliases == {"7.out.weight": "0.tokens.weight"}  # written once, its other name recorded
    launch(gpt_workers.tied_load, 4, args=(str(tmp_path), "interleaved"), timeout=60, in_process=True)


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
        launch(gpt_workers.untieable, 2, args=(case,), timeout=30, in_process=True)


@pytest.mark.timeout(60)
def test_a_step_with_no_token_to_count_is_a_clear_error_on_every_rank() -> None:
    with pytest.raises(ValueError, match="loss_count counted 0 units in every micro-batch") as caught:
        launch(gpt_workers.nothing_to_count, 2, timeout=30, in_process=True)
    assert "ValueError: loss_count counted 0" in "\n".join(caught.value.__notes__)  # the other rank too, not a NaN
