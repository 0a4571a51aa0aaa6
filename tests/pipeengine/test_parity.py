"""A pipelined model trains exactly like one process running the whole batch (gloo, real ranks)."""

import pytest

from pipeengine import launch
from tests.pipeengine import workers


def microbatch_counts(schedule: str, ranks: int) -> list[int]:
    # 1, p and more than p; interleaved needs a multiple of p
    return [ranks, 2 * ranks] if schedule == "interleaved" else [1, ranks, 2 * ranks]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"])
def test_loss_gradients_and_weights_equal_single_process(schedule: str, ranks: int) -> None:
    ms = microbatch_counts(schedule, ranks)
    unit = 2 * ranks  # every batch size splits evenly for every m above
    # both models, an MLP and a transformer stack with tuple boundaries, in one set of ranks
    launch(workers.parity_models, ranks, args=(["mlp", "transformer"], schedule, ms, [2 * unit, 3 * unit, unit]),
           timeout=90)  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-v"])
def test_gradients_accumulate_and_eval_train_eval_leaves_no_state(schedule: str) -> None:
    launch(workers.accumulate_and_eval, 2, args=("transformer", schedule, 4), timeout=60)


@pytest.mark.timeout(120)
def test_parameter_names_are_the_sequentials_on_every_rank() -> None:
    launch(workers.names_are_the_models, 4, args=("interleaved",), timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_one_rank_with_several_chunks_hands_tensors_over_locally(model: str) -> None:
    # interleaved on 1 rank: stages 0..2 all here, every boundary a local handoff
    launch(workers.parity_chunks, 1, args=(model, 3, [1, 3], [6, 3]), timeout=60)
