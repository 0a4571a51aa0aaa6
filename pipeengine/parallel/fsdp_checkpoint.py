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
runs no code from the files and checks every shape before it returns.

DCP's own FileSystemReader loads `.metadata` with a bare ``pickle.load`` (a crafted file runs what it names) and
hands non-tensor entries to ``torch.load(weights_only=False)``. ``SafeReader`` is the same reader with the two
doors shut, as torch.load(weights_only=True) shuts them for a tensor file:

- `.metadata` is unpickled with an allow-list: DCP's metadata records, torch.Size, dtypes, layouts and paths, the
  classes such a file names (Python's "Restricting Globals"); anything else is refused, naming the file and the
  global. Then its contents are checked: tensor entries only, plain file names inside the folder, no transforms.
- every tensor is read with ``torch.load(weights_only=True)``, on every torch this package supports.

The chunks' reading is DCP's (``read_data`` of torch 2.13, less the byte items and transforms it refuses), so a
DTensor still reads only its own shard.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeengine.core.dtensors import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
from pipeengine.core.files import refused

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
        causes = "; ".join(
            f"rank {rank}: {type(cause).__name__}: {cause}" for rank, (cause, _) in sorted(error.failures.items())
        )
        raise OSError(f"writing the shards of {target.name} failed ({causes})") from error


def read(
    target: Path, wanted: Mapping[str, torch.Tensor | None], params: Mapping[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The model tensors in ``wanted`` (name -> the tensor it loads into, placed as it is there; None: a whole
    plain tensor), the optimizer state and group hyperparameters of ``params`` (name -> parameter). Every shape is
    checked against the tensor it loads into before anything is read; nothing is loaded into the model here."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    folder = target / FOLDER
    reader = SafeReader(folder)
    stored: dict[str, Any] = dict(reader.read_metadata().state_dict_metadata)  # tensors only: checked

    def like(key: str, placed: torch.Tensor | None, exact: bool = True) -> torch.Tensor:
        entry = stored[key]
        if placed is not None and tuple(placed.shape) != tuple(entry.size) and exact:
            raise ValueError(
                f"{folder}: {key.split('.', 1)[1]!r} ({key.split('.')[0]}) is {list(entry.size)} there, "
                f"{list(placed.shape)} in this model: it is a checkpoint of another model; load one "
                "saved from the same nn.Sequential"
            )
        dtype = entry.properties.dtype
        if placed is not None and is_dtensor(placed) and tuple(placed.shape) == tuple(entry.size):
            return torch.zeros_like(placed, dtype=dtype)  # a DTensor placed as the parameter: DCP reads its shard
        return torch.empty(entry.size, dtype=dtype)

    absent = [name for name in wanted if f"model.{name}" not in stored]
    if absent:
        raise ValueError(
            f"{folder} holds no tensor for {', '.join(absent[:6])}: the shards are incomplete or of another model"
        )
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
        try:
            load(flat, storage_reader=reader, no_dist=True)
        except CheckpointException as error:  # DCP wraps what the reader raised (a BaseException): raise that
            raise next(cause for cause, _ in error.failures.values()) from None
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
        raise ValueError(
            f"{folder}: the optimizer hyperparameters of {name!r} (hparams.{name}) cannot be read "
            f"({refused(error)}); nothing in them was run: load a checkpoint written by "
            "engine.save"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{folder}: hparams.{name} holds a {type(value).__name__}, not a dict of hyperparameters")
    return value


# ---- reading DCP's files without running code from them

_RECORDS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
}
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}  # StorageMeta.checkpoint_id


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the classes a DCP `.metadata` file names; any other global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module, name) in _RECORDS
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
            or (module.split(".")[0] == "pathlib" and name in _PATHS)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of a checkpoint's metadata")
        return super().find_class(module, name)


def read_metadata(path: Path) -> Metadata:
    """The metadata of a DCP folder's `.metadata`, unpickled with the allow-list and checked (see the module)."""
    try:
        with open(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint's shards are incomplete; load another checkpoint or save again"
        ) from None
    except Exception as error:  # noqa: BLE001  (a refused global, a truncated or foreign file: named, never run)
        raise ValueError(
            f"{path} is not a checkpoint's metadata that pipeengine reads ({type(error).__name__}: "
            f"{error}); nothing in it was run: load a checkpoint written by engine.save"
        ) from None
    _check(metadata, path)
    checked: Metadata = metadata
    return checked


def _check(metadata: Any, path: Path) -> None:
    """Tensor entries only, each chunk stored in a plain file of the folder, untransformed."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(
            f"{path} holds a {type(metadata).__name__}, not DCP's Metadata: load a checkpoint written by engine.save"
        )
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(
                f"{path}: entry {key!r} is a pickled object ({type(entry).__name__}), which loading "
                "would have to run; pipeengine reads tensors only: load a checkpoint written by "
                "engine.save of this version"
            )
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise ValueError(f"{path} names no files for its tensors (storage_data is {type(storage).__name__})")
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        plain = isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name
        if not plain or not all(
            isinstance(getattr(info, f, None), int) and getattr(info, f) >= 0 for f in ("offset", "length")
        ):
            raise ValueError(
                f"{path}: the chunk of {getattr(index, 'fqn', index)!r} is stored at {info!r}; a chunk "
                "is a byte range of a file inside the folder"
            )
        if getattr(info, "transform_descriptors", None):
            raise ValueError(
                f"{path}: the chunk of {index.fqn!r} is stored transformed ({info.transform_descriptors})"
                ", which pipeengine does not read: save it again with engine.save"
            )


def SafeReader(folder: Path) -> Any:  # noqa: N802  (a class, made once: DCP is imported only when a load needs it)
    """DCP's FileSystemReader that reads `.metadata` with ``read_metadata`` and every tensor with weights_only."""
    return _reader_class()(folder)


@functools.cache
def _reader_class() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.futures import Future

    class SafeReader(FileSystemReader):
        """DCP's FileSystemReader that reads `.metadata` with ``read_metadata`` and every tensor with weights_only."""

        def __init__(self, folder: Path) -> None:
            super().__init__(str(folder))
            self.folder = folder
            self.metadata: Metadata | None = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            if self.metadata is None:
                self.metadata = read_metadata(self.folder / ".metadata")
                if getattr(self.metadata, "storage_meta", None) is None:
                    self.metadata.storage_meta = StorageMeta()
            if hasattr(self, "load_id") and self.metadata.storage_meta is not None:
                self.metadata.storage_meta.load_id = self.load_id  # as DCP's reader does: this load's id
            return self.metadata

        def read_data(self, plan: Any, planner: Any) -> Future[None]:
            per_file: dict[str, list[Any]] = {}
            for request in plan.items:
                per_file.setdefault(self.storage_data[request.storage_index].relative_path, []).append(request)
            for name, requests in per_file.items():
                if not (self.folder / name).is_file():
                    raise FileNotFoundError(
                        f"{self.folder / name} is missing: the checkpoint's shards are incomplete; "
                        "load another checkpoint or save again"
                    )
                with open(self.folder / name, "rb") as stream:
                    for request in requests:
                        tensor = self._tensor(stream, name, request)
                        parts = zip(request.storage_offsets, request.lengths, strict=True)
                        for dim, (start, length) in enumerate(parts):
                            tensor = tensor.narrow(dim, start, length)  # the part this rank asked for
                        target = planner.resolve_tensor(request).detach()
                        if target.size() != tensor.size():
                            raise ValueError(
                                f"{self.folder / name}: {request.storage_index.fqn!r} reads as "
                                f"{list(tensor.shape)} where {list(target.shape)} was planned"
                            )
                        target.copy_(tensor)
                        planner.commit_tensor(request, target)
            done: Future[None] = Future()
            done.set_result(None)
            return done

        def _tensor(self, stream: Any, name: str, request: Any) -> torch.Tensor:
            info = self.storage_data[request.storage_index]
            fqn = request.storage_index.fqn
            stream.seek(info.offset)
            data = stream.read(info.length)
            if len(data) != info.length:
                raise ValueError(
                    f"{self.folder / name} is truncated: {fqn!r} needs bytes {info.offset}-"
                    f"{info.offset + info.length}, the file has {os.fstat(stream.fileno()).st_size}; load "
                    "another checkpoint or save again"
                )
            try:
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as error:  # noqa: BLE001  (a refused global or a corrupt record: named, never run)
                raise ValueError(
                    f"{self.folder / name}: {fqn!r} cannot be read ({refused(error)}); nothing in it was "
                    "run: the file is damaged; load another checkpoint or save again"
                ) from None
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{self.folder / name}: {fqn!r} holds a {type(tensor).__name__}, not a tensor")
            return tensor

    return SafeReader
