"""Checkpoints under the model's own names: any stage count saves, any stage count loads.

    directory/
      latest                    "checkpoint-3": replaced atomically once every file is written
      checkpoint-3/meta.json    the layers, the model's keys, which file holds which names, and the
                                other names of tied weights (each stored once, under its first name)
      checkpoint-3/part-0.pt    {"model": state_dict, "optimizer": state by parameter name}, per pipeline rank
      checkpoint-3/extra.pt     the caller's extras (an LR scheduler, the data's position, a step count)
      checkpoint-3/rng/         every rank's random generators (pipeengine.train.extras)

A save writes a new checkpoint-N (each file to a temporary name, then renamed), waits for
every rank, then points `latest` at it and removes the numbered ones beyond ``keep`` (1: the new one alone; a
folder of the user's, checkpoint-best/, is never touched): a crash mid-save
leaves the previous checkpoint intact and `latest` pointing at it (pipeengine.train.writing;
background=True writes in a thread while the training goes on). Only the first
data-parallel replica writes whole tensors; with fsdp=True every rank writes its own shards
instead (format 2, pipeengine.parallel.fsdp_checkpoint). Either loads into any partition, replica count
and sharding. The directory must be shared by all ranks.

A load runs no code from the directory (tensors and plain data: weights_only, JSON, and DCP's files through
pipeengine.parallel.fsdp_checkpoint's SafeReader) and is all or nothing: every rank reads and checks its whole part,
then the ranks agree, then each loads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeengine.comm import fake
from pipeengine.comm.base import Transport
from pipeengine.comm.topology import Topology
from pipeengine.core.dtensors import spread, whole
from pipeengine.parallel import fsdp_checkpoint
from pipeengine.train import extras
from pipeengine.train.files import by_rank, few, latest_checkpoint, latest_number, read_meta, refused, resolve
from pipeengine.train.parameters import Parameters
from pipeengine.train.writing import Background, Snapshot, check_keep, commit, write

__all__ = ["Checkpoints", "consolidate"]


class Checkpoints:
    """An engine's checkpoints: what it writes and reads, and the whole state it gathers for an export."""

    def __init__(self, model: nn.Sequential, params: Parameters, topology: Topology, sharded: bool) -> None:
        self.layers = [name for name, _ in model.named_children()]
        self.keys = list(model.state_dict())  # to tell a checkpoint of another model, and its key order
        self.params, self.topology, self.sharded = params, topology, sharded
        self.writer = topology.dp_rank == 0 and topology.tp_rank == 0  # the first replica, tensor index 0: one copy
        self.background = Background()
        self.channel: Transport | None = None  # the background writes' own group, made at the first

    @property
    def grid(self) -> list[int]:
        return [self.topology.grid.dp, self.topology.grid.pp, self.topology.grid.tp]

    def save(
        self,
        directory: str | os.PathLike[str],
        optimizer: torch.optim.Optimizer | None,
        extra: Mapping[str, Any],
        background: bool,
        keep: int | None = 1,
    ) -> Path | Future[Path]:
        """Every rank calls it: a pending background write ends first (its failure raised here, on every rank)."""
        check_keep(keep)
        self.background.wait()
        taken = extras.extra_states(extra, copied=background)  # every rank: what cannot be resumed is refused
        world = self.topology.world
        root = Path(directory)
        number = self._number(root)
        snapshot = self._snapshot(root / f"checkpoint-{number}", optimizer, taken)
        if world.alone:  # a dry run: every state gathered and named as the save would, nothing written
            return _dry_saved(root, snapshot.target, taken, background)
        if not background:
            return commit(world, snapshot.target, write(snapshot), keep)
        self.channel = self.channel or world.side_channel()
        return self.background.start(snapshot.staged(self.background.buffers), self.channel, keep)

    def _number(self, root: Path) -> int:
        """The new checkpoint's number, read by world rank 0 and sent to every rank; or every rank raises what
        reading the directory raised there."""
        world = self.topology.world
        try:
            mine: int | str = latest_number(root) + 1 if world.rank == 0 or world.alone else 0  # alone: a dry run
        except OSError as error:
            mine = f"{type(error).__name__}: {error}"
        found = world.all_gather_object(mine, "the number of the new checkpoint")[0]
        if isinstance(found, str):
            raise OSError(f"cannot save into {root}: rank 0 cannot read it ({found})")
        return int(found)

    def _snapshot(self, target: Path, optimizer: torch.optim.Optimizer | None, taken: dict[str, Any]) -> Snapshot:
        """What this rank writes (every rank: DTensors gather, unless each writes its shards)."""
        state, names = self.params.owned_state(gather=not self.sharded)  # whole tensors, or each rank's shards
        named = _named_optimizer_state(optimizer, names, gather=not self.sharded) if optimizer is not None else None
        world = self.topology.world
        part = meta = None
        if self.writer:
            rank = self.topology.pipeline.rank
            if not self.sharded:
                part = (f"part-{rank}.pt", {"model": {k: v.detach() for k, v in state.items()}, "optimizer": named})
            listed = self.topology.pipeline.all_gather_object(list(state), "the names each rank saves")
            if rank == 0:
                form = "shards/pp-{}" if self.sharded else "part-{}.pt"
                meta = {
                    "format": 2 if self.sharded else 1,
                    "layers": self.layers,
                    "keys": self.keys,
                    "tied": dict(self.params.ties.aliases),
                    "parts": {form.format(r): held for r, held in enumerate(listed)},
                    "grid": self.grid,
                    "extras": sorted(taken),
                }
        return Snapshot(
            target,
            world.rank,
            part,
            fsdp_checkpoint.flatten(state, named) if self.sharded else None,
            meta,
            taken if world.rank == 0 else None,
            extras.rng_state(world.device),
        )

    def load(
        self, directory: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any]
    ) -> extras.Loaded:
        """Every rank reads and checks its whole part first; only if every rank can does any rank change: all ranks
        loaded or none, each failure named with its rank, on every rank."""
        self.background.wait()
        world = self.topology.world
        names = {id(param): name for name, param in self.params.named()}
        own = fake.GHOSTS.saved.get(str(Path(directory).resolve())) if world.alone else None
        if own is not None and latest_checkpoint(Path(directory)) is None:  # a dry run's own save: nothing on disk to
            return extras.Loaded(own[1], own[0])  # read, and its shapes are this engine's
        try:
            target = resolve(Path(directory))
            saved = extras.check(target, extra)  # a refused extra before anything is loaded
            staged = read_checkpoint(
                target, self.params.stages.values(), optimizer, names, expected=set(self.keys), shapes_only=world.alone
            )  # (a dry run reads no tensor's data)
            same = staged.meta.get("grid") == self.grid and not world.alone  # a dry run leaves the process's generators
            rng = extras.read_rng(target, world.rank) if same else None
            failure = None
        except Exception as error:  # noqa: BLE001  (every rank hears of it, then every rank raises it)
            failure = (type(error).__name__, str(error))
        if world.alone:  # a dry run's rank speaks for itself alone (the others' would be its own, repeated)
            agree([failure if rank == world.rank else None for rank in range(world.size)])
        else:
            agree(world.all_gather_object(failure, f"whether every rank can load {directory}"))
        staged.apply()
        return extras.restore(target, saved, extra, rng, world.device)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        return self.params.full_state(self.keys, self.writer, self.topology.world.rank)


_RAISED = {kind.__name__: kind for kind in (FileNotFoundError, OSError, KeyError, TypeError, ValueError)}


def agree(failures: list[tuple[str, str] | None]) -> None:
    """Raise on every rank if any rank could not load (``failures`` gathered from every rank): the first failing
    rank's kind of error, each rank's message."""
    said = "; ".join(by_rank([None if failure is None else failure[1] or failure[0] for failure in failures]))
    if not said:
        return
    first = next(failure for failure in failures if failure is not None)
    raise _RAISED.get(first[0], RuntimeError)(
        f"{said} (nothing was loaded, on any rank: a load changes the model and "
        "optimizer only where every rank can read its whole part)"
    )


@dataclass
class Staged:
    """A checkpoint read and checked for one rank's modules and optimizer, not yet loaded into them."""

    target: Path
    meta: dict[str, Any]
    modules: list[nn.Module]
    model: dict[str, torch.Tensor]  # stored name -> tensor
    optimizer: torch.optim.Optimizer | None
    names: Mapping[int, str]
    states: dict[str, Any]
    groups: dict[str, Any]

    def apply(self) -> None:
        """Load it: a tied weight's every name reads the one stored copy; a DTensor takes its part."""
        tied: dict[str, str] = self.meta.get("tied", {})
        for module in self.modules:
            mine = module.state_dict(keep_vars=True)
            module.load_state_dict({key: spread(self.model[tied.get(key, key)], value) for key, value in mine.items()})
        if self.optimizer is not None:
            _load_named_optimizer_state(self.optimizer, self.names, self.states, self.groups)


def read_checkpoint(
    target: Path,
    modules: Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | None,
    names: Mapping[int, str],
    *,
    expected: set[str],
    shapes_only: bool = False,
) -> Staged:
    """Read what this rank's modules hold (and its optimizer's state) from ``target`` and check it: every file read,
    every shape the module's, every parameter's optimizer state there; the modules and optimizer are not touched.
    ``shapes_only``: the tensors on the meta device, their data never read (a dry run's load)."""
    meta = read_meta(target)
    tied: dict[str, str] = meta.get("tied", {})  # another name of a tied weight -> the name it is stored under
    present = {key for keys in meta["parts"].values() for key in keys} | set(tied)
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise ValueError(
            f"{target} is not a checkpoint of this model: missing {few(missing)}, unexpected {few(unexpected)}; "
            "load a checkpoint saved from the same nn.Sequential"
        )
    modules = list(modules)
    placed = {
        tied.get(key, key): value for module in modules for key, value in module.state_dict(keep_vars=True).items()
    }
    params = {
        name: p
        for group in (optimizer.param_groups if optimizer else [])
        for p in group["params"]
        if (name := names.get(id(p))) is not None
    }
    if meta.get("format", 1) == 2:  # shards: each read as this rank places it, shapes checked as they are planned
        model, states, groups = fsdp_checkpoint.read(target, placed, params)
    else:
        model, states, groups = _read(target, meta, set(placed), shapes_only)
        where = {key: part for part, keys in meta["parts"].items() for key in keys}
        for key, value in placed.items():
            _same_shape(model[key], value, f"{target / where[key]}: {key!r}")
        for name, param in params.items():
            for field, value in states.get(name, {}).items():
                if isinstance(value, torch.Tensor) and value.dim():
                    _same_shape(value, param, f"{target / where.get(name, '')}: the optimizer's {field!r} of {name!r}")
    absent = [name for name in params if name not in groups]
    if absent:
        raise ValueError(f"{target} holds no optimizer state for {few(absent)}: was it saved with optimizer=?")
    return Staged(target, meta, modules, model, optimizer, names, states, groups)


def _dry_saved(root: Path, target: Path, taken: Mapping[str, Any], background: bool) -> Path | Future[Path]:
    """A dry run's save: nothing written; recorded for a later load in the same run (comm.fake.Ghosts.saved), and
    returned as the real save returns it (a Future, done, for a background save)."""
    fake.GHOSTS.saved[str(root.resolve())] = (target, {k: v["value"] for k, v in taken.items() if "value" in v})
    if not background:
        return target
    done: Future[Path] = Future()
    done.set_result(target)
    return done


def _same_shape(stored: torch.Tensor, placed: torch.Tensor, what: str) -> None:
    if tuple(stored.shape) != tuple(placed.shape):
        raise ValueError(
            f"{what} is {list(stored.shape)} there, {list(placed.shape)} in this model: it is a "
            "checkpoint of another model; load one saved from the same nn.Sequential"
        )


def consolidate(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The whole model's state_dict from the latest checkpoint, under the nn.Sequential's names (no ranks needed)."""
    target = resolve(Path(directory))
    meta = read_meta(target)
    stored = [key for part in meta["parts"].values() for key in part]
    tied: dict[str, str] = meta.get("tied", {})
    if meta.get("format", 1) == 2:
        state = fsdp_checkpoint.read(target, dict.fromkeys(stored), {})[0]
    else:
        state, _, _ = _read(target, meta, set(stored))
    if "keys" in meta:  # the model's own order, tied weights under each of their names
        return {key: state[tied.get(key, key)] for key in meta["keys"]}
    layer = {name: i for i, name in enumerate(meta["layers"])}
    stored.sort(key=lambda key: layer.get(key.split(".")[0], len(layer)))  # stable: each layer keeps its order
    return {key: state[key] for key in stored}


def _read(
    target: Path, meta: dict[str, Any], wanted: set[str], shapes_only: bool = False
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Model tensors, optimizer states and optimizer groups for the wanted names, from the parts that hold them."""
    model: dict[str, Any] = {}
    states: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    for part, keys in meta["parts"].items():
        if wanted.isdisjoint(keys):
            continue
        payload = _part(target / part, shapes_only)
        absent = sorted(wanted.intersection(keys) - set(payload["model"]))
        if absent:
            raise ValueError(
                f"{target / part} holds no tensor for {few(absent)}, which meta.json places there: the "
                "checkpoint is damaged; load another or save again"
            )
        model.update({k: v for k, v in payload["model"].items() if k in wanted})
        if payload["optimizer"] is not None:
            states.update(payload["optimizer"]["state"])
            for group in payload["optimizer"]["param_groups"]:
                for name in group["params"]:
                    groups[name] = {k: v for k, v in group.items() if k != "params"}
    return model, states, groups


def _part(path: Path, shapes_only: bool = False) -> dict[str, Any]:
    """A part file, read with weights_only (tensors and plain data: nothing in it runs), or refused naming it;
    ``shapes_only``: its tensors on the meta device, no data read."""
    try:
        payload = torch.load(path, map_location="meta" if shapes_only else "cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint is incomplete; load another or save again"
        ) from None
    except Exception as error:  # noqa: BLE001  (truncated, corrupt, or a refused global: named, never run)
        raise ValueError(
            f"{path} cannot be read ({refused(error)}): it is truncated, damaged or not written by "
            "engine.save, and nothing in it was run; load another checkpoint or save again"
        ) from None
    shaped = (
        isinstance(payload, dict)
        and isinstance(payload.get("model"), dict)
        and all(isinstance(v, torch.Tensor) for v in payload["model"].values())
        and (
            payload.get("optimizer") is None
            or (isinstance(payload["optimizer"], dict) and {"state", "param_groups"} <= set(payload["optimizer"]))
        )
    )
    if not shaped:
        raise ValueError(
            f"{path} is not a checkpoint part ({{'model': tensors, 'optimizer': ...}}): load a checkpoint "
            "written by engine.save"
        )
    part: dict[str, Any] = payload
    return part


def _named_optimizer_state(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], gather: bool = True
) -> dict[str, Any]:
    """An optimizer's state_dict with parameter names in place of indices; parameters without a name here (a tied
    weight that another rank writes) are left out. ``gather``: DTensors whole (else as they are)."""
    state = optimizer.state_dict()
    by_index = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    wholes = {
        i: {key: whole(v) if isinstance(v, torch.Tensor) and gather else v for key, v in value.items()}
        for i, value in state["state"].items()
    }  # (every rank gathers: the collective is the mesh's)
    return {
        "state": {by_index[i]: value for i, value in wholes.items() if by_index[i] is not None},
        "param_groups": [
            {**g, "params": [by_index[i] for i in g["params"] if by_index[i] is not None]}
            for g in state["param_groups"]
        ],
    }


def _load_named_optimizer_state(
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, str],
    states: dict[str, Any],
    groups: dict[str, Any],
) -> None:
    current = optimizer.state_dict()
    by_index = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    for group in current["param_groups"]:
        if group["params"]:  # (a group may hold no parameter of this rank's: nothing names its hyperparameters)
            group.update(groups[by_index[group["params"][0]]])  # the hyperparameters saved with these parameters
    params = [p for group in optimizer.param_groups for p in group["params"]]
    current["state"] = {
        i: {
            key: spread(v, params[i]) if isinstance(v, torch.Tensor) and v.dim() else v
            for key, v in states[name].items()
        }  # a DTensor parameter's state: its part (step counts stay whole)
        for i, name in enumerate(by_index)
        if name in states
    }
    optimizer.load_state_dict(current)
