"""Sharded data parallel (FSDP2) inside the pipeline: each replica holds 1/dp of every stage's weights, gradients and
optimizer state; gradients reduce-scattered once per stage per step. Real gloo processes (FSDP2 needs
torch.distributed); dp=2 x pp=2 x tp=2 is in test_tensor_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine, consolidate, launch
from pipeengine.core.config import EngineConfig
from tests.pipeengine import fsdp_workers
from tests.pipeengine.models import mlp, mse
from tests.pipeengine.workers import ATOL, RTOL


@pytest.mark.timeout(240)
def test_dp2_pp2_trains_like_one_process_with_sharded_state() -> None:
    launch(fsdp_workers.every_schedule, 4, timeout=200)


@pytest.mark.timeout(180)
def test_memory_the_planner_and_the_refusals_every_rank_makes() -> None:
    launch(fsdp_workers.around_the_engine, 4, timeout=150)


def test_options_fsdp_cannot_use_are_refused() -> None:
    with pytest.raises(ValueError, match=r"fsdp=True .* data_parallel=1: there is nothing to shard over"):
        EngineConfig(num_microbatches=2, fsdp=True)
    with pytest.raises(ValueError, match="without fsdp=True nothing is gathered"):
        EngineConfig(num_microbatches=2, data_parallel=2, reshard_after_forward=True)


def test_the_planner_prices_the_sharded_state_and_builds_it() -> None:
    """tune(fsdp=True): each candidate's state sharded over the replicas, with the gathered parameters and whole
    gradients during the step: less than the same candidate replicated, more than half of it; its choice builds
    with fsdp=True."""
    from pipeengine.tune import tune

    model, x = mlp(width=64), torch.randn(32, 64)
    y = torch.randn(32, 4)
    plain, sharded = (tune(model, mse, x, 4, target=y, data_parallel=2, fsdp=fsdp, schedules=["1f1b", "zb-h1"],
                           microbatches=[4], methods=("uniform",)) for fsdp in (False, True))  # fmt: skip
    assert len(plain.rows) == len(sharded.rows) == 2
    for mine in sharded.rows:
        theirs = next(c for c in plain.rows if c.schedule == mine.schedule)
        assert all(t / 2 < m < t for m, t in zip(mine.peak_memory, theirs.peak_memory, strict=True)), (mine, theirs)
        assert mine.engine_kwargs()["fsdp"] is True and "fsdp" not in theirs.engine_kwargs()
    with pytest.raises(ValueError, match="fsdp=True shards the state over the data-parallel replicas"):
        tune(model, mse, x, 4, target=y, fsdp=True)


def refused_in_process() -> None:
    with pytest.raises(ValueError, match=r"fsdp=True runs DTensor collectives.*in-process ranks"):
        PipelineEngine(mlp(), nn.functional.mse_loss, num_microbatches=2, data_parallel=2, fsdp=True)


@pytest.mark.timeout(60)
def test_in_process_ranks_are_refused_with_what_to_do() -> None:
    launch(refused_in_process, 4, timeout=30, in_process=True)


@pytest.mark.timeout(240)
def test_checkpoints_each_rank_writes_its_shards_and_any_sharding_loads_them(tmp_path: Path) -> None:
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    launch(fsdp_workers.checkpoints, 4, args=(str(sharded), str(plain)), timeout=200)
    target = sharded / (sharded / "latest").read_text()
    assert json.loads((target / "meta.json").read_text())["format"] == 2
    assert len(list((target / "shards").glob("*.distcp"))) == 4  # every rank wrote its own shards
    assert not list(target.glob("part-*.pt"))
    reference = torch.load(sharded / "reference.pt", weights_only=False)["model"]
    state = consolidate(sharded)  # the plain nn.Sequential's state_dict, no ranks needed
    assert list(state) == list(reference)
    for name, value in reference.items():  # the engine trained like one process: the suite's fp32 tolerance
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    launch(fsdp_workers.continues, 2, args=(str(sharded),), timeout=60, in_process=True)  # dp=1, no processes
    with pytest.raises(OSError, match=r"rank 1: OSError: disk full \(planted\).*previous checkpoint is intact"):
        launch(fsdp_workers.save_that_fails, 4, args=(str(sharded),), timeout=60)
    assert (sharded / "latest").read_text() == target.name
    after = consolidate(sharded)
    assert all(torch.equal(state[name], after[name]) for name in state)
