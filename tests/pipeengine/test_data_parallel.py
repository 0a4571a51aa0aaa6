"""Data parallel x pipeline: dp replicas of a pipeline train like one process on all their batches."""

import pytest

from pipeengine import PipelineEngine
from tests.pipeengine.models import MODELS, batch
from tests.pipeengine.parity import OneProcess, check_clipped, replicas_parity
from tests.pipeengine.ranks import on_ranks


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "model, schedule, data_parallel",
    [("mlp", "1f1b", 2), ("transformer", "zb-v", 2), ("transformer", "interleaved", 2), ("mlp", "gpipe", 4)],
)
@on_ranks(4, timeout=90, in_process=True)  # dp=2 x pp=2 (chunks for interleaved and zb-v), or dp=4 x pp=1
def test_dp_x_pp_equals_single_process_on_the_union_of_the_batches(
    model: str, schedule: str, data_parallel: int
) -> None:
    replicas_parity(model, schedule, data_parallel, 4, 8)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule, data_parallel", [("1f1b", 1), ("zb-v", 1), ("interleaved", 2)])
@on_ranks(4, timeout=60, in_process=True)
def test_clip_grad_norm_across_stages_equals_torchs_on_the_whole_model(schedule: str, data_parallel: int) -> None:
    """clip_grad_norm_ across stages equals torch.nn.utils.clip_grad_norm_ on the whole model."""
    build, loss_fn = MODELS["transformer"]
    model = build()
    one = OneProcess(model, loss_fn)
    engine = PipelineEngine(model, loss_fn, num_microbatches=4, schedule=schedule, data_parallel=data_parallel)
    x, y = batch("transformer", 8, seed=3)
    for norm_type, max_norm in ((2.0, 0.5), (float("inf"), 0.01), (1.0, 1e6)):
        engine.zero_grad()
        one.seq.zero_grad()
        engine.train_step(x if engine.first else None, y if engine.last else None)
        one.step([(x, y)])  # every replica had the same batch: the same mean
        check_clipped(engine, one, max_norm, schedule, norm_type)
