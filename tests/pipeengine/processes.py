"""The processes below a test's subprocess, from /proc (Linux): what a killed launcher or a restart must not leave."""

from __future__ import annotations

from pathlib import Path

__all__ = ["alive", "descendants", "parent"]


def _stat(pid: int | None) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, parent, ...), or None if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running, and not a zombie (a container's init may not reap the ranks it inherits)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def parent(pid: int | None) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields is not None else None


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, theirs, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (up := parent(int(entry.name))) is not None:
            children.setdefault(up, []).append(int(entry.name))
    found, frontier = set(), [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.add(child)
            frontier.append(child)
    return found
