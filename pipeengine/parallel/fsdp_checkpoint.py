"""FSDP's checkpoint form (fsdp=True): every rank writes its own shards with torch.distributed.checkpoint.

They live inside a checkpoint-N of pipeengine.train.checkpoint (its `latest` and atomic move), meta.json
saying format 2::

    checkpoint-N/meta.json   the layers, the model's keys, which pipeline rank holds which names, ties
    checkpoint-N/shards/     DCP: "model.<name>", "optim.<name>.<field>" (AdamW's exp_avg, ...), and
                             "hparams.<name>" (the hyperparameters of the parameter's optimizer group: the bytes
                             of torch.save, a uint8 tensor, read back with weights_only=True)

Saving is collective over the world (DCP plans it: each shard written once, by the rank that holds it;
replicated tensors once). Loading reads what the loading rank holds, each tensor as it is placed
there: a DTensor its shard, a plain tensor whole; no collective (DCP's no_dist), so a checkpoint saved
with fsdp=True at dp=2 loads with fsdp=False, at dp=1, on another partition, and into ``consolidate``. Reading
runs no code from the files (pipeengine.parallel.shards_reader) and checks every shape before it returns.
"""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pipeengine.core.dtensors import is_dtensor
from pipeengine.parallel.shards_reader import SafeReader

__all__: list[str] = []

FOLDER = "shards"
_ONE_AT_A_TIME = threading.Lock()  # in-process ranks load in threads: DCP's loader and warnings' filters are global


def flatten(state: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any] | None) -> dict[str, Any]:
    """What DCP writes for this rank's state (DTensors as they are) and its optimizer's, named."""
    flat: dict[str, Any] = {f"model.{name}": value.detach() for name, value in state.items()}
    if optimizer is not None:
        for name, fields in optimizer["state"].items():
            flat.update({f"optim.{name}.{field}": value for field, value in fields.items()})
        for group in optimizer["param_groups"]:
            hyper = _encoded({key: value for key, value in group.items() if key != "params"})  # one tensor: DCP
            flat.update({f"hparams.{name}": hyper for name in group["params"]})  # would flatten a dict
    return flat


def write(target: Path, flat: dict[str, Any], group: Any = None) -> None:
    """Write ``flatten``'s dict; every rank of the world calls it, DCP planning over ``group`` (None: the default
    group; a background write passes a group of its own)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    try:
        save(flat, storage_writer=FileSystemWriter(str(target / FOLDER)), process_group=group)
    except CheckpointException as error:  # every rank gets it: name what failed where (its text is "ranks: ...")
        causes = "; ".join(f"rank {rank}: {type(cause).__name__}: {cause}" for rank, (cause, _) in
                           sorted(error.failures.items()))  # fmt: skip
        raise OSError(f"writing the shards of {target.name} failed ({causes})") from error


def read(
    target: Path, wanted: Mapping[str, torch.Tensor | None], params: Mapping[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The model tensors in ``wanted`` (name -> the tensor it loads into, placed as it is there; None: a whole
    plain tensor), the optimizer state and group hyperparameters of ``params`` (name -> parameter). Every shape is
    checked against the tensor it loads into before anything is read; nothing is loaded into the model here."""
    from torch.distributed.checkpoint.state_dict_loader import load

    folder = target / FOLDER
    reader = SafeReader(folder)
    stored: dict[str, Any] = dict(reader.read_metadata().state_dict_metadata)  # tensors only: checked

    def like(key: str, placed: torch.Tensor | None, exact: bool = True) -> torch.Tensor:
        entry = stored[key]
        if placed is not None and tuple(placed.shape) != tuple(entry.size) and exact:
            raise ValueError(f"{folder}: {key.split('.', 1)[1]!r} ({key.split('.')[0]}) is {list(entry.size)} there, "
                             f"{list(placed.shape)} in this model: it is a checkpoint of another model; load one "
                             "saved from the same nn.Sequential")  # fmt: skip
        dtype = entry.properties.dtype
        if placed is not None and is_dtensor(placed) and tuple(placed.shape) == tuple(entry.size):
            return torch.zeros_like(placed, dtype=dtype)  # a DTensor placed as the parameter: DCP reads its shard
        return torch.empty(entry.size, dtype=dtype)

    absent = [name for name in wanted if f"model.{name}" not in stored]
    if absent:
        raise ValueError(f"{folder} holds no tensor for {', '.join(absent[:6])}: the shards are incomplete or of "
                         "another model")  # fmt: skip
    flat = {f"model.{name}": like(f"model.{name}", placed) for name, placed in wanted.items()}
    fields: dict[str, list[str]] = {}
    for key in stored:
        if key.startswith("optim."):
            name, _, field = key.removeprefix("optim.").rpartition(".")
            if name in params:
                fields.setdefault(name, []).append(field)
                flat[key] = like(key, params[name], exact=False)  # a state of another shape (a step count) is whole
    flat.update({f"hparams.{name}": like(f"hparams.{name}", None) for name in params if f"hparams.{name}" in stored})
    with _ONE_AT_A_TIME, warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # process": so it is
        load(flat, storage_reader=reader, no_dist=True)
    model = {name: flat[f"model.{name}"] for name in wanted}
    states = {name: {field: flat[f"optim.{name}.{field}"] for field in mine} for name, mine in fields.items()}
    groups = {name: _decoded(flat[f"hparams.{name}"], folder, name) for name in params if f"hparams.{name}" in flat}
    return model, states, groups


def _encoded(hyperparameters: dict[str, Any]) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(hyperparameters, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _decoded(data: torch.Tensor, folder: Path, name: str) -> dict[str, Any]:
    """A group's hyperparameters from their bytes: numbers, strings, tuples and tensors (weights_only), or refused."""
    try:
        value = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
    except Exception as error:  # noqa: BLE001  (a refused global or corrupt bytes: named, never run)
        raise ValueError(f"{folder}: the optimizer hyperparameters of {name!r} (hparams.{name}) do not load with "
                         f"weights_only ({type(error).__name__}: {str(error).splitlines()[0][:200]}); nothing in "
                         "them was run: load a checkpoint written by engine.save") from None  # fmt: skip
    if not isinstance(value, dict):
        raise ValueError(f"{folder}: hparams.{name} holds a {type(value).__name__}, not a dict of hyperparameters")
    return value
