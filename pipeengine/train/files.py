"""A checkpoint directory's files: `latest`, the numbered checkpoints, meta.json, and writing a file atomically."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pipeengine.core.files import refused, write_atomically

__all__ = ["LATEST", "latest_checkpoint", "refused", "write_atomically"]

LATEST = "latest"
NUMBERED = re.compile(r"checkpoint-(\d+)")  # what engine.save names its checkpoints: only these are ever removed


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint `latest` points at in ``directory``, or None where none was saved (the resume idiom's test:
    load if there is one, else start)."""
    pointer = Path(directory) / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text(errors="replace").strip()
    if not NUMBERED.fullmatch(name):  # a pointer elsewhere ("../x") is not one engine.save wrote
        raise ValueError(
            f"{pointer} says {name[:80]!r}, not a checkpoint's name (checkpoint-N): it was not "
            "written by engine.save; write the name of a checkpoint in this directory into it, or "
            "remove it"
        )
    return Path(directory) / name


def numbered(root: Path) -> dict[int, Path]:
    """The checkpoints engine.save wrote in ``root`` (folders named checkpoint-N), by number."""
    return {
        int(found.group(1)): p
        for p in root.glob("checkpoint-*")
        if (found := NUMBERED.fullmatch(p.name)) and p.is_dir()
    }


def latest_number(root: Path) -> int:
    try:
        return int((root / LATEST).read_text().strip().removeprefix("checkpoint-"))
    except (FileNotFoundError, ValueError):
        return max(numbered(root), default=0)


def read_meta(target: Path) -> dict[str, Any]:
    """A checkpoint's meta.json, checked to be what engine.save writes (the parts' names plain files inside it)."""
    path = target / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is missing: {target.name} is not a whole checkpoint; load another or save again"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path} is not JSON ({error}): the file is damaged or was not written by engine.save; "
            "load another checkpoint or save again"
        ) from None
    parts = meta.get("parts") if isinstance(meta, dict) else None
    problem = (
        "it is not an object"
        if not isinstance(meta, dict)
        else "'parts' is not an object of lists of names"
        if not isinstance(parts, dict)
        or not all(isinstance(keys, list) and all(isinstance(k, str) for k in keys) for keys in parts.values())
        else f"'format' is {meta.get('format')!r}, not 1 or 2"
        if meta.get("format", 1) not in (1, 2)
        else "'tied' is not an object of names"
        if not isinstance(meta.get("tied", {}), dict)
        else "'layers' is not a list"
        if not isinstance(meta.get("layers", []), list)
        else "a part is not a plain file name"
        if meta.get("format", 1) == 1 and not all(Path(part).name == part and part not in (".", "..") for part in parts)
        else None
    )
    if problem is not None:
        raise ValueError(f"{path} is not a checkpoint's meta.json: {problem}; load a checkpoint written by engine.save")
    checked: dict[str, Any] = meta
    return checked


def resolve(root: Path) -> Path:
    found = latest_checkpoint(root)
    if found is None:
        raise FileNotFoundError(f"{root} holds no checkpoint (no '{LATEST}' file): save one with engine.save()")
    return found


def by_rank(texts: list[str | None]) -> list[str]:
    """Each rank's failure (None: none), said once for all the ranks that saw the same text: "ranks 0, 1: ..."."""
    ranks: dict[str, list[str]] = {}
    for rank, text in enumerate(texts):
        if text:
            ranks.setdefault(text, []).append(str(rank))
    return [f"rank{'s' if len(held) > 1 else ''} {', '.join(held)}: {text}" for text, held in ranks.items()]


def few(names: list[str], shown: int = 6) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
