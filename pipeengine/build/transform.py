"""The stage transform: the seam between cutting a stage out of the model and building its worker.

    stage_module(model, a, b) ──► transform_stage(module, stage, config, mesh) ──► StageWorker
                                    1. tensor parallel: tp_plan, torch's parallelize_module on mesh["tp"]
                                    2. parallelize=fn: fn(stage_module, mesh) -> module, what a plan cannot say
                                    3. compile=True: torch.compile each layer (in place: the names stay)
                                    4. fsdp=True: FSDP2's fully_shard on mesh["dp"], each layer, then the stage

as torchtitan orders them (TP first; sharding, FSDP, after). The mesh is torch's DeviceMesh over the
grid (dims "dp", "pp", "tp"), built only where a transform needs one; the in-process (loopback)
ranks have no torch.distributed: they get None, and tensor parallelism and FSDP are refused there.
FSDP: each layer of the stage with parameters is a unit (gathered and freed together; a layer sharing
a parameter with another is left to the stage's unit), the stage module the root, whose gradient sync
runs once per step (runtime.gradsync.ShardedReduce). A
``tp_plan`` pattern (fnmatch over the model's own module names, e.g. ``"*.mlp.0"``) that matches
no module is refused naming it. Parallelizing replaces a module's parameters (DTensors now):
``retie`` makes a weight tied across stages of one rank one tensor again, and refuses a tie whose
holders were sharded differently, naming the layers.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

from torch import nn

from pipeengine.comm.base import Transport
from pipeengine.core.config import EngineConfig
from pipeengine.core.dtensors import is_dtensor
from pipeengine.core.grid import DIMS, Grid
from pipeengine.core.ties import Ties

__all__ = ["check_shardable", "compile_layers", "device_mesh", "plan_matches", "retie", "shard_stage",
           "transform_stage"]


def device_mesh(grid: Grid, world: Transport, fsdp: bool = False) -> object | None:
    """torch's DeviceMesh over the grid (every rank calls it: it makes a process group per dim); None in-process."""
    if world.name == "loopback":
        if grid.tp > 1 or fsdp:
            what = f"tensor_parallel={grid.tp}" if grid.tp > 1 else "fsdp=True"
            raise ValueError(
                f"{what} runs DTensor collectives, which need torch.distributed: in-process ranks "
                "(launch(..., in_process=True)) cannot host them; launch processes (launch(fn, n)) or use torchrun"
            )
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if world.size != grid.size or world.ranks != tuple(range(world.size)):
        raise ValueError(
            f"a device mesh spans the default process group: the engine's group holds ranks {list(world.ranks)}; "
            "build the engine on the default group (no group=) to use parallelize=, tensor_parallel or fsdp"
        )
    return DeviceMesh(world.device.type, grid.nested(), mesh_dim_names=DIMS)


def plan_matches(model: nn.Module, plan: Mapping[str, object], degree: int = 1) -> dict[str, object]:
    """The tp_plan resolved to the model's module names (the later pattern wins a name two match); a pattern that
    matches none is refused, naming it. A style with a ``check_degree(degree)`` (pipeengine.hf's attention, which
    splits by heads) refuses a degree it cannot run at, on every rank, before any stage is cut."""
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, object] = {}
    for pattern, style in plan.items():
        found = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not found:
            shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no module of the model; its modules are named {shown} "
                "(model.named_modules(); '*' matches within and across dots, e.g. '*.mlp.0')"
            )
        resolved.update(dict.fromkeys(found, style))
    for style in {id(style): style for style in resolved.values()}.values():
        check = getattr(style, "check_degree", None)
        if check is not None:
            check(degree)
    return resolved


def transform_stage(
    module: nn.Module, stage: int, config: EngineConfig, mesh: object | None, plan: Mapping[str, object]
) -> nn.Module:
    """The stage's module as its worker runs it: tensor parallel (``plan``: resolved names), parallelize=, FSDP."""
    mine = {name: style for name, style in plan.items() if _has(module, name)}
    if mine:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(module, mesh["tp"], mine)  # type: ignore[index, arg-type]
    if config.parallelize is not None:
        module = _user(module, stage, config, mesh)
    if config.compile:
        compile_layers(module, {} if config.compile is True else dict(config.compile))
    if config.fsdp:
        module = shard_stage(module, stage, mesh, config.reshard_after_forward)
    return module


def _user(module: nn.Module, stage: int, config: EngineConfig, mesh: object | None) -> nn.Module:
    made = config.parallelize(module, mesh)  # type: ignore[misc]
    if not isinstance(made, nn.Module):
        raise TypeError(
            f"parallelize(stage_module, mesh) must return the module to run (an nn.Module); for stage {stage} it "
            f"returned {type(made).__name__}"
        )
    return made


def compile_layers(module: nn.Module, options: dict[str, object]) -> None:
    """compile=True: torch.compile each layer of the stage in place (nn.Module.compile: the names stay the model's),
    as torchtitan compiles each block: after tensor parallelism, before FSDP. A layer compiled already is left."""
    for layer in module.children():
        if getattr(layer, "_compiled_call_impl", None) is None and type(layer).__name__ != "OptimizedModule":
            layer.compile(**options)


def check_shardable(model: nn.Sequential) -> None:
    """fsdp=True: every layer's parameters are floating and of one dtype (FSDP2 gathers a unit's parameters as one
    flat buffer); checked on the whole model, so every rank refuses alike, before any stage is built."""
    for name, layer in model.named_children():
        dtypes = {p.dtype for p in layer.parameters()}
        if len(dtypes) > 1 or any(not d.is_floating_point for d in dtypes):
            shown = sorted(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(
                f"fsdp=True: layer {name} ({type(layer).__name__}) holds parameters of dtypes {shown}; FSDP2 shards "
                "a layer's parameters as one buffer of one floating dtype. Give the layer one dtype (e.g. .float()), "
                "make integer state a buffer, or train with fsdp=False"
            )


def shard_stage(module: nn.Module, stage: int, mesh: object, reshard_after_forward: bool) -> nn.Module:
    """FSDP2 over the mesh's "dp" dim: each layer with parameters of its own a unit, then the stage module."""
    from torch.distributed.fsdp import fully_shard

    users: dict[int, int] = {}
    for layer in module.children():
        for param in set(layer.parameters()):
            users[id(param)] = users.get(id(param), 0) + 1
    units = [(f"layer {name}", layer) for name, layer in module.named_children()
             if [*layer.parameters()] and all(users[id(p)] == 1 for p in layer.parameters())]  # fmt: skip
    where = "the stage module"
    try:
        for where, layer in [*units, ("the stage module", module)]:  # noqa: B007  (read in the except clause)
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)  # type: ignore[index]
    except Exception as error:
        raise ValueError(
            f"fsdp=True: FSDP2 (fully_shard) could not shard {where} of stage {stage}: {type(error).__name__}: "
            f"{error}. Every parameter must be a floating tensor FSDP can shard on dim 0; train this model with "
            "fsdp=False (replicas all-reduce their gradients)"
        ) from error
    return module


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def retie(ties: Ties, stages: Mapping[int, nn.Module]) -> tuple[Ties, dict[str, list[str]]]:
    """After the transform: the model's name of every parameter of these stages (by id, as ``Ties.names``), each
    tied weight one tensor again on this rank, and the placements of each tied weight here ("" for a plain tensor;
    more than one where its holders were sharded differently: refused by the caller, on every rank)."""
    first: dict[str, nn.Parameter] = {}
    placements: dict[str, list[str]] = {}
    for module in stages.values():
        for name, param in list(module.named_parameters(remove_duplicate=False)):
            model_name = ties.aliases.get(name, name)
            held = first.setdefault(model_name, param)
            where = str(tuple(param.placements)) if is_dtensor(param) else ""  # type: ignore[attr-defined]
            if model_name in ties.owners and where not in placements.setdefault(model_name, []):
                placements[model_name].append(where)
            if held is not param and len(placements.get(model_name, ())) == 1:
                # parallelizing each stage made a copy of the one tensor: share the first again
                owner, _, attribute = name.rpartition(".")
                setattr(module.get_submodule(owner) if owner else module, attribute, held)
    names = {id(param): ties.aliases.get(name, name) for module in stages.values()
             for name, param in module.named_parameters(remove_duplicate=False)}  # fmt: skip
    return dataclasses.replace(ties, names=names), placements
