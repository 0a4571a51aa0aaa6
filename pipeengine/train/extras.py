"""What a checkpoint holds beside the model and the optimizer: the caller's extras, and every rank's random state.

    checkpoint-N/extra.pt        {name: {"state": obj.state_dict()} or {"value": plain value}}, written once
    checkpoint-N/rng/rank-R.pt   world rank R's generators: torch's CPU one, its CUDA device's, Python's ``random``

An extra is anything with state_dict()/load_state_dict() (torch.distributed.checkpoint's Stateful: an LR
scheduler, a pipeengine.ReplicaLoader, a GradScaler) or a plain value (a step count). Every rank passes the same
extras and every rank restores them. The generators come back only where the layout is the one that saved them
(the same grid of ranks): elsewhere a rank runs other layers, and no draw of the old run is its to repeat.
"""

from __future__ import annotations

import copy
import io
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pipeengine.train.files import refused, write_atomically

__all__ = ["Loaded", "is_stateful"]

EXTRAS, RNG = "extra.pt", "rng"


class Loaded(dict[str, Any]):
    """What engine.load restored: the plain values saved as extras, by name (a dict), and where from (``path``)."""

    def __init__(self, values: Mapping[str, Any], path: Path) -> None:
        super().__init__(values)
        self.path = path


def is_stateful(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def extra_states(extra: Mapping[str, Any], copied: bool) -> dict[str, dict[str, Any]]:
    """What extra.pt holds (every rank takes it: a failure is every rank's, before any collective). It must load
    with torch.load(weights_only=True), as a resume does: tensors, numbers, strings, and lists, tuples and dicts of
    them; anything else is refused here, naming the extra. ``copied``: deep copies, for a background write."""
    taken = {
        name: {"state": value.state_dict()} if is_stateful(value) else {"value": value} for name, value in extra.items()
    }
    for name, entry in taken.items():
        buffer = io.BytesIO()
        try:
            torch.save(entry, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
        except Exception as error:  # noqa: BLE001  (what fails is named, with what to do)
            kind = (
                f"the state_dict() of a {type(extra[name]).__name__}"
                if "state" in entry
                else f"a {type(extra[name]).__name__}"
            )
            raise TypeError(
                f"extra {name!r} is {kind}, which a resume could not load (torch.load(weights_only="
                f"True): {type(error).__name__}: {str(error).splitlines()[0][:200]}); pass tensors, "
                "numbers, strings, or lists and dicts of them (int(x), str(path))"
            ) from None
    return copy.deepcopy(taken) if copied else taken


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's generators now (copies)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def write(target: Path, extras: dict[str, Any] | None, rng: dict[str, Any], world_rank: int) -> None:
    """This rank's files: its generators, and (the one rank given them) the extras."""
    (target / RNG).mkdir(parents=True, exist_ok=True)
    write_atomically(target / RNG / f"rank-{world_rank}.pt", lambda path: torch.save(rng, path))
    if extras is not None:
        write_atomically(target / EXTRAS, lambda path: torch.save(extras, path))


def check(target: Path, extra: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """What extra.pt holds, once it is known that every extra asked for is there, as it was saved (before anything
    is loaded: a refused load changes nothing)."""
    saved: dict[str, dict[str, Any]] = {}
    if (target / EXTRAS).exists():
        try:
            saved = torch.load(target / EXTRAS, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001  (damaged, or a refused global: named, never run)
            raise ValueError(
                f"{target / EXTRAS} cannot be read ({refused(error)}); nothing in it was run: load "
                "another checkpoint or save again"
            ) from None
        if not isinstance(saved, dict) or not all(
            isinstance(e, dict) and ("state" in e or "value" in e) for e in saved.values()
        ):
            raise ValueError(f"{target / EXTRAS} is not a checkpoint's extras: load one written by engine.save")
    absent = sorted(set(extra) - set(saved))
    if absent:
        held = ", ".join(sorted(saved)) or "none"
        raise KeyError(
            f"{target} holds no extra named {', '.join(absent)} (it holds: {held}); pass to engine.load "
            "the names given to engine.save"
        )
    for name, value in extra.items():
        if is_stateful(value) and "state" not in saved[name]:
            raise TypeError(
                f"extra {name!r} was saved as a plain value, {saved[name]['value']!r}, and cannot "
                f"load into a {type(value).__name__}: pass it as it was saved"
            )
        if not is_stateful(value) and "state" in saved[name]:
            raise TypeError(
                f"extra {name!r} was saved from an object with state_dict(); pass that object (it "
                f"loads in place), not a {type(value).__name__}"
            )
    return saved


def read_rng(target: Path, world_rank: int) -> dict[str, Any] | None:
    """World rank ``world_rank``'s saved generators (None where the checkpoint has none for it)."""
    path = target / RNG / f"rank-{world_rank}.pt"
    if not path.exists():
        return None
    try:
        rng = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  (damaged, or a refused global: named, never run)
        raise ValueError(
            f"{path} cannot be read ({refused(error)}); nothing in it was run: the checkpoint is "
            "damaged; load another or save again"
        ) from None
    if not isinstance(rng, dict) or not isinstance(rng.get("cpu"), torch.Tensor) or "python" not in rng:
        raise ValueError(f"{path} is not a rank's generator states: load a checkpoint written by engine.save")
    return rng


def restore(
    target: Path,
    saved: dict[str, dict[str, Any]],
    extra: Mapping[str, Any],
    rng: dict[str, Any] | None,
    device: torch.device,
) -> Loaded:
    """Load each stateful extra, return the plain values; restore this rank's generators (``read_rng``'s, where the
    layout is the one that saved them)."""
    for name, value in extra.items():
        if is_stateful(value):
            value.load_state_dict(saved[name]["state"])
    if rng is not None:
        torch.set_rng_state(rng["cpu"])
        random.setstate(_as_state(rng["python"]))
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
    return Loaded({name: entry["value"] for name, entry in saved.items() if "value" in entry}, target)


def _as_state(value: Any) -> Any:
    """random.setstate wants the tuples it gave (a load may return lists)."""
    return tuple(_as_state(v) for v in value) if isinstance(value, list | tuple) else value
