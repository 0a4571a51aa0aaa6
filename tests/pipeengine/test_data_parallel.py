"""Data parallel x pipeline: dp replicas of a pipeline train like one process on all their batches."""

import pytest

from pipeengine import launch
from tests.pipeengine import workers


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "model, schedule, data_parallel",
    [("mlp", "1f1b", 2), ("transformer", "zb-v", 2), ("transformer", "interleaved", 2), ("mlp", "gpipe", 4)],
)
def test_dp_x_pp_equals_single_process_on_the_union_of_the_batches(
    model: str, schedule: str, data_parallel: int
) -> None:
    # 4 ranks: dp=2 x pp=2 (chunks for interleaved and zb-v), or dp=4 x pp=1
    launch(workers.data_parallel_parity, 4, args=(model, schedule, data_parallel, 4, 8), timeout=90, in_process=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule, data_parallel", [("1f1b", 1), ("zb-v", 1), ("interleaved", 2)])
def test_clip_grad_norm_across_stages_equals_torchs_on_the_whole_model(schedule: str, data_parallel: int) -> None:
    launch(workers.clipping, 4, args=(schedule, data_parallel), timeout=60, in_process=True)
