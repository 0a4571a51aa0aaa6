"""Checkpoints: any partition saves, any loads, atomically, under the model's own names."""

import json
from pathlib import Path

import pytest
import torch

from pipeengine import consolidate, launch
from tests.pipeengine import workers
from tests.pipeengine.models import transformer


@pytest.mark.timeout(240)
def test_saved_from_4_stages_loads_into_2_and_training_continues_exactly(tmp_path: Path) -> None:
    launch(workers.train_and_save, 4, args=(str(tmp_path), "1f1b", 2), timeout=60, in_process=True)
    assert (tmp_path / "latest").read_text() == "checkpoint-1"
    meta = json.loads((tmp_path / "checkpoint-1" / "meta.json").read_text())
    assert sorted(meta["parts"]) == [f"part-{r}.pt" for r in range(4)]
    launch(workers.load_and_continue, 2, args=(str(tmp_path), "1f1b", 2), timeout=60)  # real ranks load it
    launch(workers.load_and_continue, 2, args=(str(tmp_path), "zb-v", 2), timeout=60, in_process=True)  # 4 stages


@pytest.mark.timeout(240)
def test_consolidate_gives_the_plain_sequentials_state_dict(tmp_path: Path) -> None:
    launch(workers.train_and_save, 4, args=(str(tmp_path), "interleaved", 1, 2), timeout=60, in_process=True)
    state = consolidate(tmp_path)
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)["model"]
    assert list(state) == list(transformer().state_dict())  # the model's own order and names
    for name, tensor in reference.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=4e-5)
    model = transformer(seed=9)
    model.load_state_dict(state)


@pytest.mark.timeout(240)
def test_a_crash_mid_save_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    launch(workers.train_and_save, 2, args=(str(tmp_path), "1f1b", 1), timeout=60, in_process=True)
    before = consolidate(tmp_path)
    with pytest.raises(OSError, match="disk full"):  # real processes: the planted fault patches torch.save
        launch(workers.save_that_crashes, 2, args=(str(tmp_path),), timeout=20)
    assert (tmp_path / "latest").read_text() == "checkpoint-1"
    after = consolidate(tmp_path)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.timeout(120)
def test_a_checkpoint_of_another_model_is_refused_with_the_names(tmp_path: Path) -> None:
    launch(workers.train_and_save, 2, args=(str(tmp_path), "1f1b", 1), timeout=60, in_process=True)
    with pytest.raises(
        ValueError, match=r"not a checkpoint of this model: missing 0.bias, 0.weight.*unexpected 0.position"
    ):
        launch(workers.load_foreign, 2, args=(str(tmp_path),), timeout=30, in_process=True)


def test_no_checkpoint_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no checkpoint .* engine.save\(\)"):
        consolidate(tmp_path)
