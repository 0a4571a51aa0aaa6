"""Writing a checkpoint: what a rank takes at the save call (a Snapshot), its files, and the commit that points
`latest` at the new checkpoint once every rank's files are written; in the caller's thread, or in a thread of its
own (background=True: the step waits only for a copy of the state in memory).

The commit is one collective, over the world or, in the background, over a gloo group of its own (so that its
messages never meet the step's): every rank says whether its files are written. Only if all are does rank 0 move
`latest` (atomically) and remove the older checkpoints beyond ``keep`` (only folders named checkpoint-N: a
`checkpoint-best/` of the user's stays); else the partial one is removed and every rank raises the
same OSError, naming each rank that failed and why. A crash at any point leaves `latest` where it was.
As torch.distributed.checkpoint's async_save does, the background write holds a copy (staged on the CPU; a
DTensor's shard copied where it is) and runs the same writer; its failure is raised by the next save or load, or
when the rank ends (pipeengine.core.pending).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import shutil
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeengine.comm.base import Transport
from pipeengine.core import pending
from pipeengine.core.dtensors import is_dtensor
from pipeengine.parallel import fsdp_checkpoint
from pipeengine.train import extras
from pipeengine.train.files import LATEST, by_rank, numbered, write_atomically

__all__: list[str] = []


@dataclass
class Snapshot:
    """One rank's part of a checkpoint, as it was at the save call."""

    target: Path
    world_rank: int
    part: tuple[str, dict[str, Any]] | None  # the whole-tensor format's writer: its file and what it holds
    shards: dict[str, Any] | None  # the sharded format (fsdp=True): what DCP writes for this rank
    meta: dict[str, Any] | None  # the first writer: meta.json
    extras: dict[str, Any] | None  # world rank 0: the caller's extras
    rng: dict[str, Any]  # this rank's generators

    def staged(self, buffers: dict[str, torch.Tensor]) -> Snapshot:
        """The same with every tensor copied (to the CPU; a DTensor's shard where it is): the training may go on.
        ``buffers``: the last staging's CPU copies, filled again where they fit (no allocation, no page faults)."""
        return dataclasses.replace(
            self, part=_copied(self.part, buffers, "part"), shards=_copied(self.shards, buffers, "shards")
        )


def _copied(value: Any, buffers: dict[str, torch.Tensor], key: str) -> Any:
    if isinstance(value, torch.Tensor):
        if is_dtensor(value):
            return value.detach().clone()
        held = buffers.get(key)
        if held is not None and held.shape == value.shape and held.dtype == value.dtype:
            return held.copy_(value.detach())
        buffers[key] = value.detach().to("cpu", copy=True)
        return buffers[key]
    if isinstance(value, dict):
        return {k: _copied(v, buffers, f"{key}/{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copied(v, buffers, f"{key}/{i}") for i, v in enumerate(value))
    return value


def write(snapshot: Snapshot, group: Any = None) -> str | None:
    """This rank's files (DCP's first: every rank takes part in it); None, or what failed."""
    target = snapshot.target
    try:
        target.mkdir(parents=True, exist_ok=True)
        if snapshot.shards is not None:
            fsdp_checkpoint.write(target, snapshot.shards, group)
        if snapshot.part is not None:  # the model's tensors on the CPU (staged ones are there already)
            name, payload = snapshot.part
            payload = {**payload, "model": {key: value.cpu() for key, value in payload["model"].items()}}
            write_atomically(target / name, lambda path: torch.save(payload, path))
        if snapshot.meta is not None:
            text = json.dumps(snapshot.meta, indent=1)
            write_atomically(target / "meta.json", lambda path: Path(path).write_text(text))
        extras.write(target, snapshot.extras, snapshot.rng, snapshot.world_rank)
    except Exception as error:  # noqa: BLE001  (every rank hears of it at the commit)
        return f"{type(error).__name__}: {error}"
    return None


def commit(channel: Transport, target: Path, error: str | None, keep: int | None = 1) -> Path:
    """Every rank of ``channel`` (the world's ranks) calls it with what its write returned: see the module.
    ``keep``: how many whole checkpoints to keep, the new one among them (None: all)."""
    root = target.parent
    errors = channel.all_gather_object(error, f"whether every rank wrote its part of {target.name}")
    failed = by_rank(errors)  # DCP's failure reaches every rank alike: said once, for all of them
    if channel.rank == 0:
        if failed:
            shutil.rmtree(target, ignore_errors=True)
        else:
            write_atomically(root / LATEST, lambda path: Path(path).write_text(target.name))
            prune(root, target, keep)
    channel.barrier(f"rank 0 to point '{LATEST}' at {target.name}")
    if failed:
        pointer = root / LATEST
        previous = f"still points at {pointer.read_text().strip()}" if pointer.exists() else "was never written"
        raise OSError(
            f"writing checkpoint {target} failed ({'; '.join(failed)}); '{LATEST}' {previous}, "
            "intact: fix the cause and save again"
        )
    return target


def prune(root: Path, target: Path, keep: int | None) -> None:
    """Remove the numbered checkpoints beyond the ``keep`` newest whole ones (``target`` is the newest): older ones,
    the remains of failed saves (no meta.json), and any numbered after ``target`` (a failed save's, once `latest`
    moved past it)."""
    found = numbered(root)
    newest = next(number for number, path in found.items() if path.name == target.name)
    whole = sorted((n for n, path in found.items() if n < newest and (path / "meta.json").exists()), reverse=True)
    kept = {newest, *(whole if keep is None else whole[: keep - 1])}
    for number, path in found.items():
        if number not in kept:
            shutil.rmtree(path, ignore_errors=True)


def check_keep(keep: object) -> None:
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(
            f"keep={keep!r}: keep is how many checkpoints to keep, the new one among them: an int of 1 or "
            "more, or None to keep every one"
        )


class Background:
    """At most one write in a thread of its own; ``wait`` returns its checkpoint or raises its failure, once."""

    def __init__(self) -> None:
        self.future: Future[Path] | None = None
        self.buffers: dict[str, torch.Tensor] = {}  # the staged copies, reused by the next write (once it waits)

    def start(self, snapshot: Snapshot, channel: Transport, keep: int | None) -> Future[Path]:
        future: Future[Path] = Future()

        def run() -> None:
            try:
                written = write(snapshot, getattr(channel, "group", None))
                future.set_result(commit(channel, snapshot.target, written, keep))
            except BaseException as error:  # noqa: BLE001  (the caller's thread raises it)
                future.set_exception(error)

        self.future = future
        _UNCLAIMED.add(future)
        pending.add(self.wait)
        threading.Thread(target=run, name=f"pipeengine-checkpoint-{snapshot.target.name}", daemon=False).start()
        return future

    def wait(self) -> Path | None:
        if self.future is None:
            return None
        future, self.future = self.future, None
        pending.discard(self.wait)
        _UNCLAIMED.discard(future)
        return future.result()


_UNCLAIMED: set[Future[Path]] = set()  # writes whose end no one waited for: reported at exit if they failed


@atexit.register
def _report() -> None:
    """A program that ends without waiting (no later save or load, no pipeengine launcher) still hears of a failure:
    Python waits for the writing thread (not a daemon) before this runs."""
    for future in list(_UNCLAIMED):
        if future.done() and future.exception() is not None:
            print(f"pipeengine: a background checkpoint failed: {future.exception()}", file=sys.stderr)
