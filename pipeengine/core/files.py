"""Files written whole or not at all, and why a file was not loaded: used by every layer that keeps files."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__: list[str] = []

_UMASK = os.umask(0o022)  # read (it can only be set): put back at once
os.umask(_UMASK)


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


def refused(error: BaseException) -> str:
    """Why torch.load(weights_only=True) (or another reader) did not load a file, in a few words: the global a
    crafted file names, or the reader's own first line (never torch's advice to load it without weights_only)."""
    text = str(error)
    named = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if named:
        return f"it names {named.group(1)}, which loading with weights_only=True refuses to run"
    if "WeightsUnpickler error:" in text:
        detail = " ".join(text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation")[0].split())
        return f"it is not plain data that weights_only=True reads ({detail[:160]})"
    return f"{type(error).__name__}: {text.strip().splitlines()[0][:200] if text.strip() else 'no detail'}"


def once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads(..., object_pairs_hook=once_each): an object whose keys are each written once (json would keep the
    last of a key written twice, silently)."""
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"the key {', '.join(map(repr, twice))} is written twice in one object")
    return dict(pairs)
