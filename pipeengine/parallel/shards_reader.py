"""Reading the sharded checkpoint format (torch.distributed.checkpoint's files) without running code from them.

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

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.futures import Future

__all__: list[str] = []

_RECORDS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")  # fmt: skip
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout")}
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
        raise FileNotFoundError(f"{path} is missing: the checkpoint's shards are incomplete; load another "
                                "checkpoint or save again") from None  # fmt: skip
    except Exception as error:  # noqa: BLE001  (a refused global, a truncated or foreign file: named, never run)
        raise ValueError(f"{path} is not a checkpoint's metadata that pipeengine reads ({type(error).__name__}: "
                         f"{error}); nothing in it was run: load a checkpoint written by engine.save") from None
    _check(metadata, path)
    checked: Metadata = metadata
    return checked


def _check(metadata: Any, path: Path) -> None:
    """Tensor entries only, each chunk stored in a plain file of the folder, untransformed."""
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata: load a checkpoint written "
                         "by engine.save")  # fmt: skip
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"{path}: entry {key!r} is a pickled object ({type(entry).__name__}), which loading "
                             "would have to run; pipeengine reads tensors only: load a checkpoint written by "
                             "engine.save of this version")  # fmt: skip
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise ValueError(f"{path} names no files for its tensors (storage_data is {type(storage).__name__})")
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        plain = isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name
        if not plain or not all(isinstance(getattr(info, f, None), int) and getattr(info, f) >= 0
                                for f in ("offset", "length")):  # fmt: skip
            raise ValueError(f"{path}: the chunk of {getattr(index, 'fqn', index)!r} is stored at {info!r}; a chunk "
                             "is a byte range of a file inside the folder")  # fmt: skip
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{path}: the chunk of {index.fqn!r} is stored transformed ({info.transform_descriptors})"
                             ", which pipeengine does not read: save it again with engine.save")  # fmt: skip


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
            with open(self.folder / name, "rb") as stream:
                for request in requests:
                    tensor = self._tensor(stream, name, request)
                    for dim, (start, length) in enumerate(zip(request.storage_offsets, request.lengths, strict=True)):
                        tensor = tensor.narrow(dim, start, length)  # the part this rank asked for
                    target = planner.resolve_tensor(request).detach()
                    if target.size() != tensor.size():
                        raise ValueError(f"{self.folder / name}: {request.storage_index.fqn!r} reads as "
                                         f"{list(tensor.shape)} where {list(target.shape)} was planned")  # fmt: skip
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
            raise ValueError(f"{self.folder / name} is truncated: {fqn!r} needs bytes {info.offset}-"
                             f"{info.offset + info.length}, the file ends at {info.offset + len(data)}")  # fmt: skip
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001  (a refused global or a corrupt record: named, never run)
            raise ValueError(f"{self.folder / name}: {fqn!r} is not a tensor that loads with weights_only "
                             f"({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None  # fmt: skip
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{self.folder / name}: {fqn!r} holds a {type(tensor).__name__}, not a tensor")
        return tensor
