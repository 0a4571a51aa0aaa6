"""Checkpoints: any partition saves, any loads, atomically, under the model's own names."""

import json
from pathlib import Path

import pytest
import torch

from pipeengine import PipelineEngine, consolidate, launch
from tests.pipeengine import ranks
from tests.pipeengine.models import MODELS, batch, transformer
from tests.pipeengine.parity import OneProcess, check_weights, close, load_reference, save_reference, step_both


def train_and_save(directory: str, schedule: str, steps: int, data_parallel: int = 1) -> None:
    """Train the engine and a single-process reference in step; save both (the reference for the test)."""
    build, loss_fn = MODELS["transformer"]
    model = build()
    one = OneProcess(model, loss_fn)
    engine = PipelineEngine(model, loss_fn, num_microbatches=4, schedule=schedule, data_parallel=data_parallel)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3, eps=1e-6)
    reference_optimizer = torch.optim.AdamW(one.parameters(), lr=1e-3, eps=1e-6)
    for step in range(steps):
        x, y = batch("transformer", 8, seed=step)
        engine.train_step(x if engine.first else None, y if engine.last else None)
        one.step([(x, y)])
        step_both(optimizer, reference_optimizer)
    engine.save(directory, optimizer)
    save_reference(directory, one, reference_optimizer)


def load_and_continue(directory: str, schedule: str, steps_done: int) -> None:
    """A different partition loads the checkpoint and continues exactly like the single-process reference."""
    build, loss_fn = MODELS["transformer"]
    engine = PipelineEngine(build(seed=123), loss_fn, num_microbatches=4, schedule=schedule)  # other weights
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3, eps=1e-6)
    engine.load(directory, optimizer)
    one = OneProcess(build(), loss_fn)
    reference_optimizer = torch.optim.AdamW(one.parameters(), lr=1e-3, eps=1e-6)
    load_reference(directory, one, reference_optimizer)
    check_weights(engine, one, "after load")
    x, y = batch("transformer", 8, seed=steps_done)
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    close(loss, one.step([(x, y)]), "loss after load")
    optimizer.step()
    reference_optimizer.step()  # equal only if the AdamW moments were loaded too
    check_weights(engine, one, "one step after load")


def save_that_crashes(directory: str) -> None:
    """Rank 1 fails while writing its part of a second checkpoint."""
    build, loss_fn = MODELS["transformer"]
    engine = PipelineEngine(build(seed=7), loss_fn, num_microbatches=2, schedule="1f1b")
    if ranks.rank() == 1:
        original = torch.save

        def broken(obj: object, path: object) -> None:
            original(obj, path)  # the temporary file is written...
            raise OSError("disk full (planted)")  # ...and the rename never happens

        torch.save = broken  # type: ignore[assignment]
    engine.save(directory)


def load_foreign(directory: str) -> None:
    build, loss_fn = MODELS["mlp"]
    PipelineEngine(build(), loss_fn, num_microbatches=2).load(directory)


@pytest.mark.timeout(240)
def test_saved_from_4_stages_loads_into_2_and_training_continues_exactly(tmp_path: Path) -> None:
    launch(train_and_save, 4, args=(str(tmp_path), "1f1b", 2), timeout=60, in_process=True)
    assert (tmp_path / "latest").read_text() == "checkpoint-1"
    meta = json.loads((tmp_path / "checkpoint-1" / "meta.json").read_text())
    assert sorted(meta["parts"]) == [f"part-{r}.pt" for r in range(4)]
    launch(load_and_continue, 2, args=(str(tmp_path), "1f1b", 2), timeout=60)  # real ranks load it
    launch(load_and_continue, 2, args=(str(tmp_path), "zb-v", 2), timeout=60, in_process=True)  # 4 stages


@pytest.mark.timeout(240)
def test_consolidate_gives_the_plain_sequentials_state_dict(tmp_path: Path) -> None:
    launch(train_and_save, 4, args=(str(tmp_path), "interleaved", 1, 2), timeout=60, in_process=True)
    state = consolidate(tmp_path)
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)["model"]
    assert list(state) == list(transformer().state_dict())  # the model's own order and names
    for name, tensor in reference.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=4e-5)
    model = transformer(seed=9)
    model.load_state_dict(state)


@pytest.mark.timeout(240)
def test_a_crash_mid_save_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    launch(train_and_save, 2, args=(str(tmp_path), "1f1b", 1), timeout=60, in_process=True)
    before = consolidate(tmp_path)
    with pytest.raises(OSError, match="disk full"):  # real processes: the planted fault patches torch.save
        launch(save_that_crashes, 2, args=(str(tmp_path),), timeout=20)
    assert (tmp_path / "latest").read_text() == "checkpoint-1"
    after = consolidate(tmp_path)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.timeout(120)
def test_a_checkpoint_of_another_model_is_refused_with_the_names(tmp_path: Path) -> None:
    launch(train_and_save, 2, args=(str(tmp_path), "1f1b", 1), timeout=60, in_process=True)
    with pytest.raises(
        ValueError, match=r"not a checkpoint of this model: missing 0.bias, 0.weight.*unexpected 0.position"
    ):
        launch(load_foreign, 2, args=(str(tmp_path),), timeout=30, in_process=True)


def test_no_checkpoint_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no checkpoint .* engine.save\(\)"):
        consolidate(tmp_path)
