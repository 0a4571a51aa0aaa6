"""A pipelined model trains exactly like one process running the whole batch.

In-process (loopback threads) for every schedule and size; on real gloo ranks for the
schedules that exercise gloo's program (receives first), its second group, and several chunks.
"""

import pytest

from pipeengine import launch
from tests.pipeengine import workers

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min", "dualpipe-v"]


def microbatch_counts(schedule: str, ranks: int) -> list[int]:
    # 1, p and more than p; interleaved needs a multiple of p, DualPipeV at least 2p
    if schedule == "dualpipe-v":
        return [2 * ranks]
    return [ranks, 2 * ranks] if schedule == "interleaved" else [1, ranks, 2 * ranks]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [4])  # 2 ranks: every schedule with every feature in the composition matrix
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_loss_gradients_and_weights_equal_single_process(schedule: str, ranks: int) -> None:
    ms = microbatch_counts(schedule, ranks)
    unit = 2 * ranks  # every batch size splits evenly for every m above
    # a transformer stack with tuple boundaries (an MLP with a batch norm: every schedule in the composition matrix)
    sizes = [3 * unit, unit]  # with the largest m, the batch size changes between the two optimizer steps
    launch(workers.parity_models, ranks, args=(["transformer"], schedule, ms, sizes), timeout=60, in_process=True)


@pytest.mark.timeout(180)
def test_on_real_gloo_ranks_the_transport_trains_like_one_process() -> None:
    # 4 processes: receives-first streams, the second group for downward messages, one and two chunks per rank
    launch(workers.parity_schedules, 4, args=("transformer", ["1f1b", "interleaved", "zb-v"], [4, 8], [8, 16]),
           timeout=90)  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["zb-v"])  # accumulation and eval with every schedule: the composition matrix
def test_gradients_accumulate_and_eval_train_eval_leaves_no_state(schedule: str) -> None:
    launch(workers.accumulate_and_eval, 2, args=("transformer", schedule, 4), timeout=60, in_process=True)


@pytest.mark.timeout(120)
def test_parameter_names_are_the_sequentials_on_every_rank() -> None:
    launch(workers.names_are_the_models, 4, args=("interleaved",), timeout=60, in_process=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_one_rank_with_several_chunks_hands_tensors_over_locally(model: str) -> None:
    # interleaved on 1 rank: stages 0..2 all here, every boundary a local handoff
    launch(workers.parity_chunks, 1, args=(model, 3, [1, 3], [6, 3]), timeout=60, in_process=True)
