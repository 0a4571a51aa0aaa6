"""Loading a checkpoint runs nothing from it, and is all or nothing: a crafted, damaged or foreign checkpoint is
refused on every rank, naming the file, the rank and the tensor, with every rank's model and optimizer untouched;
a save removes only the numbered checkpoints it wrote, beyond keep=."""

from __future__ import annotations

import builtins
import copy
import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from pipeengine import PipelineEngine, consolidate, launch
from pipeengine.comm.calls import CallMismatch
from tests.pipeengine import ranks
from tests.pipeengine.models import batch, mlp, mse
from tests.pipeengine.ranks import on_ranks


class Planted:
    """Unpickled, it writes its marker file: proof that loading ran code from the checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def sharded_checkpoint(directory: Path, model: torch.nn.Sequential, extra: dict[str, object] | None = None) -> Path:
    """A checkpoint in the sharded format (format 2) of ``model``, as DCP writes one, plus ``extra`` entries."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    target = directory / "checkpoint-1"
    keys = list(model.state_dict())
    flat: dict[str, object] = {f"model.{key}": value for key, value in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save({**flat, **(extra or {})}, storage_writer=FileSystemWriter(str(target / "shards")), no_dist=True)
    meta = {
        "format": 2,
        "layers": [name for name, _ in model.named_children()],
        "keys": keys,
        "tied": {},
        "parts": {"shards/pp-0": keys},
        "grid": [1, 1, 1],
        "extras": [],
    }
    (target / "meta.json").write_text(json.dumps(meta))
    (directory / "latest").write_text("checkpoint-1")
    return target


def load_with_optimizer(directory: str) -> None:
    engine = PipelineEngine(mlp(seed=1), mse, num_microbatches=2)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3)
    engine.load(directory, optimizer)


def test_a_crafted_metadata_file_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    target = sharded_checkpoint(tmp_path, mlp())
    (target / "shards" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(ValueError, match=r"shards/\.metadata is not a checkpoint's metadata.*builtins\.exec"):
        consolidate(tmp_path)
    with pytest.raises(ValueError, match=r"ranks 0, 1: .*\.metadata .*nothing in it was run"):
        launch(load_with_optimizer, 2, args=(str(tmp_path),), timeout=30, in_process=True)
    assert not marker.exists()


def test_a_crafted_optimizer_entry_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    model = mlp()
    sharded_checkpoint(tmp_path, model, {f"hparams.{key}": Planted(marker) for key in model.state_dict()})
    with pytest.raises(ValueError, match=r"entry 'hparams\.0\.(weight|bias)' is a pickled object"):
        launch(load_with_optimizer, 2, args=(str(tmp_path),), timeout=30, in_process=True)
    assert not marker.exists()


def test_a_crafted_hyperparameter_tensor_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    model = mlp()
    planted = torch.frombuffer(bytearray(pickle.dumps(Planted(marker))), dtype=torch.uint8)
    sharded_checkpoint(tmp_path, model, {f"hparams.{key}": planted for key in model.state_dict()})
    with pytest.raises(ValueError, match=r"optimizer hyperparameters of '0\.(weight|bias)'.*weights_only"):
        launch(load_with_optimizer, 2, args=(str(tmp_path),), timeout=30, in_process=True)
    assert not marker.exists()


def test_a_meta_json_that_is_not_json_is_named(tmp_path: Path) -> None:
    target = sharded_checkpoint(tmp_path, mlp())
    (target / "meta.json").write_text('{"format": 2, "parts": ')
    with pytest.raises(ValueError, match=r"checkpoint-1/meta\.json is not JSON"):
        consolidate(tmp_path)
    (tmp_path / "latest").write_text("../elsewhere")
    with pytest.raises(ValueError, match=r"latest says '\.\./elsewhere', not a checkpoint's name"):
        consolidate(tmp_path)


# ---- all ranks loaded or none


def train_a_step(seed: int, width: int = 16) -> tuple[PipelineEngine, torch.optim.Optimizer]:
    engine = PipelineEngine(mlp(seed=seed, width=width), mse, num_microbatches=2)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    x, y = batch("mlp", 4, seed=seed)
    if width != 16:
        x = torch.randn(4, width)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    optimizer.step()
    return engine, optimizer


def save_two_stages(directory: str, sharded: bool) -> None:
    engine, optimizer = train_a_step(seed=0)
    engine.save(directory, optimizer)


def load_and_keep_everything(directory: str, width: int) -> None:
    """Every rank's parameters and optimizer state are as they were after a failed load (then the error is raised)."""
    engine, optimizer = train_a_step(seed=5, width=width)
    before = (copy.deepcopy(engine.state_dict()), copy.deepcopy(optimizer.state_dict()))
    try:
        engine.load(directory, optimizer)
    finally:
        after = (engine.state_dict(), optimizer.state_dict())
        for key, value in before[0].items():
            assert torch.equal(value, after[0][key]), f"rank {ranks.rank()}: {key} changed by a failed load"
        for index, state in before[1]["state"].items():
            for field, value in state.items():
                assert torch.equal(value, after[1]["state"][index][field]), f"rank {ranks.rank()}: {field} changed"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("damage", "width", "message"),
    [
        ("truncate part-1.pt", 16, r"rank 1: .*checkpoint-1/part-1\.pt cannot be read .*nothing was loaded, on any"),
        ("delete part-0.pt", 16, r"rank 0: .*checkpoint-1/part-0\.pt is missing.*nothing was loaded, on any rank"),
        ("another width", 8, r"ranks? 0.*part-0\.pt: '0\.weight' is \[16, 16\] there, \[8, 8\] in this model"),
    ],
)
def test_a_load_that_fails_on_one_rank_changes_no_rank(tmp_path: Path, damage: str, width: int, message: str) -> None:
    launch(save_two_stages, 2, args=(str(tmp_path), False), timeout=30, in_process=True)
    part = tmp_path / "checkpoint-1" / damage.split()[-1]
    if damage.startswith("truncate"):
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    elif damage.startswith("delete"):
        part.unlink()
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        launch(load_and_keep_everything, 2, args=(str(tmp_path), width), timeout=30, in_process=True)


def load_into_other_widths(directory: str) -> None:
    engine = PipelineEngine(mlp(width=8), mse, num_microbatches=2)
    engine.load(directory)


def test_a_sharded_checkpoint_of_other_widths_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    sharded_checkpoint(tmp_path, mlp(width=16))
    refused = r"rank 0: .*shards: '0\.weight' \(model\) is \[16, 16\] there, \[8, 8\] in this.*rank 1: .*'6\.weight'"
    with pytest.raises(ValueError, match=refused):
        launch(load_into_other_widths, 2, args=(str(tmp_path),), timeout=30, in_process=True)


# ---- what a save removes


@pytest.mark.parametrize(("keep", "left"), [(1, [3]), (2, [2, 3]), (None, [1, 2, 3])])
@on_ranks(1, timeout=30, in_process=True)
def test_a_save_keeps_the_newest_and_never_a_users_folder(tmp_path: Path, keep: int | None, left: list[int]) -> None:
    (tmp_path / "checkpoint-best").mkdir()
    (tmp_path / "checkpoint-best" / "model.pt").write_text("the user's")
    (tmp_path / "checkpoint-7b").write_text("the user's file")
    engine = PipelineEngine(mlp(), mse, num_microbatches=2)
    for _ in range(3):
        engine.save(str(tmp_path), keep=keep)
    numbered = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*") if p.name[11:].isdigit())
    assert numbered == left
    assert (tmp_path / "checkpoint-best" / "model.pt").read_text() == "the user's"
    assert (tmp_path / "checkpoint-7b").read_text() == "the user's file"
    assert (tmp_path / "latest").read_text() == "checkpoint-3"


def save_keeping_none(directory: str) -> None:
    PipelineEngine(mlp(), mse, num_microbatches=2).save(directory, keep=0)


def test_keep_below_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"keep=0: keep is how many checkpoints to keep"):
        launch(save_keeping_none, 1, args=(str(tmp_path),), timeout=30, in_process=True)
    assert not list(tmp_path.iterdir())


def test_a_crafted_part_file_is_named_with_what_it_names_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    launch(save_two_stages, 2, args=(str(tmp_path), False), timeout=30, in_process=True)
    torch.save({"model": Planted(marker), "optimizer": None}, tmp_path / "checkpoint-1" / "part-0.pt")
    with pytest.raises(ValueError, match=r"part-0\.pt cannot be read \(it names exec, which loading with weights_only"):
        consolidate(tmp_path)
    assert not marker.exists()


def test_a_truncated_shard_file_is_named_on_every_rank(tmp_path: Path) -> None:
    target = sharded_checkpoint(tmp_path, mlp())
    (chunks,) = (target / "shards").glob("*.distcp")
    chunks.write_bytes(chunks.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"\.distcp is truncated: 'model\.\d+\.(weight|bias)' needs .* has 100;"):
        consolidate(tmp_path)
    with pytest.raises(ValueError, match=r"rank 0: .*\.distcp is truncated.*rank 1: .*nothing was loaded, on any rank"):
        launch(load_with_optimizer, 2, args=(str(tmp_path),), timeout=30, in_process=True)


@on_ranks(2, timeout=20, in_process=True)
def test_ranks_saving_one_in_the_background_and_one_not_are_refused_at_once(tmp_path: Path) -> None:
    engine = PipelineEngine(mlp(), mse, num_microbatches=2)
    with pytest.raises(CallMismatch, match=r"rank 0 called save\(background=True\) \(call 1\), rank 1 called save "):
        engine.save(str(tmp_path), background=engine.first)
    engine.save(str(tmp_path))  # the ranks are still in step
    assert (tmp_path / "latest").read_text() == "checkpoint-1"
