"""A checkpoint directory's files: `latest`, the numbered checkpoints, and writing a file atomically."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["LATEST", "latest_checkpoint"]

LATEST = "latest"
_UMASK = os.umask(0o022)  # read (it can only be set): put back at once
os.umask(_UMASK)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint `latest` points at in ``directory``, or None where none was saved (the resume idiom's test:
    load if there is one, else start)."""
    pointer = Path(directory) / LATEST
    return Path(directory) / pointer.read_text().strip() if pointer.exists() else None


def latest_number(root: Path) -> int:
    try:
        return int((root / LATEST).read_text().strip().removeprefix("checkpoint-"))
    except (FileNotFoundError, ValueError):
        return max((int(p.name.split("-")[1]) for p in root.glob("checkpoint-*") if p.name.split("-")[1].isdigit()),
                   default=0)  # fmt: skip


def resolve(root: Path) -> Path:
    found = latest_checkpoint(root)
    if found is None:
        raise FileNotFoundError(f"{root} holds no checkpoint (no '{LATEST}' file): save one with engine.save()")
    return found


def write_atomically(path: Path, write: Callable[[str], Any]) -> None:
    """Write to a temporary file beside ``path``, flush it to the disk, then rename it over: readers see the old file
    or the new, after a crash of the machine too (as DCP's writer syncs its files)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(handle)
    try:
        write(temporary)
        with open(temporary, "rb+") as written:
            os.fsync(written.fileno())
        os.chmod(temporary, 0o666 & ~_UMASK)  # as open() would have made it (mkstemp's are the owner's alone)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself
    finally:
        os.close(folder)


def few(names: list[str], shown: int = 6) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
