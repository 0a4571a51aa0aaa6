"""What a rank must finish before it ends: a checkpoint still being written in the background.

Each waiter is registered by the thread that started the work (a rank: a process, or a thread of an in-process
launch) and run by ``finish()`` on that thread: pipeengine.launcher calls it after the rank's function returns and
before the process group goes, so that a pending write completes (and its failure is the rank's failure).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["add", "discard", "finish"]

_LOCK = threading.Lock()
_WAITERS: dict[int, list[Callable[[], object]]] = {}  # thread id -> its waiters, in the order they were added


def add(wait: Callable[[], object]) -> None:
    with _LOCK:
        _WAITERS.setdefault(threading.get_ident(), []).append(wait)


def discard(wait: Callable[[], object]) -> None:
    with _LOCK:
        for waiters in _WAITERS.values():
            if wait in waiters:
                waiters.remove(wait)


def finish() -> None:
    """Run this thread's waiters (each once); the first failure is raised after every waiter ran."""
    with _LOCK:
        waiters = _WAITERS.pop(threading.get_ident(), [])
    failure: BaseException | None = None
    for wait in waiters:
        try:
            wait()
        except BaseException as error:  # noqa: BLE001  (the others still finish; the first is raised)
            failure = failure or error
    if failure is not None:
        raise failure
