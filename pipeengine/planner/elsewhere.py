"""profile_layers in a fresh process: tensor-parallel shards are measured on a process group of torch's fake
backend, and a process already in a process group (a rank: schedule="auto") cannot make another default group.
``one_process()`` (tune's) lets the measurements of one search share one such process."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from pipeengine.planner.costmodel import LayerProfile

__all__ = ["elsewhere", "one_process"]


def elsewhere(
    profile: Callable[..., LayerProfile], model: nn.Sequential, sample: object, rows: int, arguments: dict[str, object]
) -> LayerProfile:
    """``profile(model, sample, rows, **arguments)`` (pipeengine.planner.measure.profile_layers) in a fresh process
    (spawned): everything it is given must pickle."""
    import multiprocessing
    import pickle

    try:
        payload = pickle.dumps((profile, model, sample, rows, arguments))
    except Exception as error:
        raise ValueError(
            "measuring tensor-parallel shards inside a process group runs in a fresh process, and the model, "
            f"loss, sample and plan must pickle to get there: {type(error).__name__}: {error}; define them at a "
            "module's top level (not lambdas), or tune before init_process_group"
        ) from error
    if _SHARED.get("open"):  # inside one_process(): the block's one process, started at its first measurement
        if "pool" not in _SHARED:
            _SHARED["pool"] = multiprocessing.get_context("spawn").Pool(1)
        return _SHARED["pool"].apply(_profile_pickled, (payload,))  # type: ignore[no-any-return]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_profile_pickled, (payload,))


_SHARED: dict[str, Any] = {}  # one_process()'s: whether a block is open, and its process once started


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """Inside the block, the measurements profile_layers makes in a fresh process (tensor-parallel shards where this
    process is in a process group: schedule="auto" on a rank) share one, started at the first and stopped at the
    block's end: each process costs a spawn and torch's import, seconds, and tune measures at every micro-batch size
    and degree."""
    if _SHARED.get("open"):
        yield
        return
    _SHARED["open"] = True
    try:
        yield
    finally:
        pool = _SHARED.pop("pool", None)
        _SHARED.clear()
        if pool is not None:
            pool.close()
            pool.join()


def _profile_pickled(payload: bytes) -> LayerProfile:
    import pickle

    profile, model, sample, rows, arguments = pickle.loads(payload)
    return profile(model, sample, rows, **arguments)  # type: ignore[no-any-return]
