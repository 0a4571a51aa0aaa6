"""Training features: activation checkpointing and mixed precision."""

import pytest

from pipeengine import launch
from tests.pipeengine import feature_workers


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule, checkpoint", [("interleaved", "except_last")])  # "always": the composition matrix
def test_checkpointed_training_equals_single_process(schedule: str, checkpoint: str) -> None:
    launch(
        feature_workers.parity_checkpointed, 2, args=("transformer", schedule, checkpoint), timeout=60, in_process=True
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_checkpointing_cuts_the_activations_held_for_backward(schedule: str) -> None:
    launch(feature_workers.checkpoint_memory, 2, args=(schedule,), timeout=60, in_process=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule, precision", [("zb-v", "bf16"), ("interleaved", "fp16")])  # more: the matrix
def test_mixed_precision_equals_one_process_that_rounds_the_same_way(schedule: str, precision: str) -> None:
    launch(feature_workers.mixed_precision, 2, args=(schedule, precision), timeout=60, in_process=True)


@pytest.mark.timeout(120)
def test_fp16_overflow_skips_the_step_on_every_rank() -> None:
    launch(feature_workers.scaler_skips_together, 2, timeout=60, in_process=True)
