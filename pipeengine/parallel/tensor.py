"""Tensor parallelism: each stage's layers split over its tensor-parallel ranks by torch's parallelize_module on
the mesh's "tp" dim, as torchtitan applies a plan; the collectives are DTensor's, inside the layers' forward and
backward (their gradients need no reduction of ours: a replica's AR reduces each rank's shards). Its pieces:

    device_mesh(grid, world)   torch's DeviceMesh over the grid ("dp", "pp", "tp"), for TP, FSDP and parallelize=
    plan_matches(model, plan)  the tp_plan resolved to module names; a pattern that matches none is refused
    apply(module, mesh, plan)  a stage's modules parallelized
    retie / agree_on_ties      a weight tied across stages of one rank one tensor again after parallelizing, and a
                               tie whose holders were sharded differently refused on every rank
    shard_costs                the layers' parameters as a tensor-parallel rank holds them, for the partition's report
    fake_mesh / shard_layer    the planner's probe: one layer sharded as one rank holds it, on torch's fake backend
    TensorSum / tensor_sum     the gradient of a parameter each rank holds whole but computes only its part of (a
                               norm over its own heads: styles.ReplicatedGradSum marks its module), summed over the
                               stage's tensor-parallel ranks at the step's end (a GradientSync: parallel.gradsync);
                               at the first training step's end, every whole parameter's gradient checked equal over
                               them: one the plan left out is refused (parallel.leftout, as a per-head weight with a
                               row per head is by plan_matches)
Its checkpoint form is the DTensor itself (pipeengine.core.dtensors: whole, spread); a stage whose output is a
shard is refused where the stage runs (pipeengine.step.stage).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from pipeengine.comm.base import Transport
from pipeengine.comm.topology import Topology
from pipeengine.core.dtensors import is_dtensor, tensor_parallel_numel
from pipeengine.core.grid import DIMS, Grid
from pipeengine.core.ties import Ties
from pipeengine.errors import PipelineError
from pipeengine.observe.trace import Spans
from pipeengine.parallel.gradsync import GradientSync
from pipeengine.parallel.leftout import check_replicated, refuse_headwise, whole_parameters
from schedules import Action, Instruction, Kind

if TYPE_CHECKING:
    from pipeengine.construction.layercosts import LayerCosts

__all__ = [
    "SUMMED",
    "TensorSum",
    "agree_on_ties",
    "apply",
    "device_mesh",
    "fake_mesh",
    "group_mesh",
    "plan_matches",
    "retie",
    "shard_costs",
    "shard_layer",
    "shards_output",
    "tensor_sum",
]

# set True on a module by its tp_plan style (pipeengine.parallel.styles.ReplicatedGradSum): its own parameters are
# whole on every tensor-parallel rank, each rank's gradient of them only its part
SUMMED = "_pipeengine_tensor_sum"


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
    return DeviceMesh(world.control_device.type, grid.nested(), mesh_dim_names=DIMS)  # a dry run: a cpu mesh


def group_mesh(group: object, device_type: str, name: str) -> object:
    """A one-dim DeviceMesh over an existing process group, its dim named ``name`` (the planner's probes)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(name,))  # type: ignore[arg-type]


def plan_matches(model: nn.Module, plan: Mapping[str, object], degree: int = 1) -> dict[str, object]:
    """The tp_plan resolved to the model's module names (the later pattern wins a name two match); a pattern that
    matches none is refused, naming it. A style with a ``check_degree(degree)`` (pipeengine.hf's attention, which
    splits by heads) refuses a degree it cannot run at, on every rank, before any stage is cut; so is a weight with
    a row per head beside a column-wise projection that the plan leaves out (leftout.refuse_headwise)."""
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
    refuse_headwise(model, resolved)
    return resolved


def shards_output(model: nn.Sequential, plan: Mapping[str, object]) -> list[bool]:
    """Per layer of ``model``, whether its output under the plan (resolved names, plan_matches') is likely a rank's
    shard, so that a stage must not end there: read from the styles, not run (the engine's own partition has no
    sample to run under tensor parallelism; the planner measures it exactly, pipeengine.planner.measure). A layer's
    last style (in module order) that says what it leaves decides: a Shard among its output layouts (ColwiseParallel's
    default, SequenceParallel's sequence, a RowwiseParallel or PrepareModuleOutput told so) leaves a shard, else the
    output is whole; a layer with no such style keeps what came in (an activation between them). The stage's check at
    the first step still names a shard sent across a boundary that a custom style made."""
    sharded, found = False, []
    for name, layer in model.named_children():
        for inner, _ in layer.named_modules():
            leaves = _leaves_shard(plan.get(f"{name}.{inner}" if inner else name))
            if leaves is not None:
                sharded = leaves
        found.append(sharded)
    return found


def _leaves_shard(style: object) -> bool | None:
    """Whether a style's output is sharded (None: the style does not say, or no style)."""
    from torch.distributed.tensor import Shard

    for attribute in ("desired_output_layouts", "output_layouts", "sequence_sharding"):  # the last word first
        layouts = getattr(style, attribute, None)
        if layouts is not None:
            layouts = layouts if isinstance(layouts, (tuple, list)) else (layouts,)
            return any(isinstance(placement, Shard) for placement in layouts)
    return None


def apply(module: nn.Module, mesh: object, plan: Mapping[str, object]) -> None:
    """Parallelize the modules of ``plan`` (resolved names) that this stage holds, on the mesh's "tp" dim."""
    mine = {name: style for name, style in plan.items() if _has(module, name)}
    if mine:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(module, mesh["tp"], mine)  # type: ignore[index, arg-type]


def shard_layer(module: nn.Module, mesh: object, plan: Mapping[str, object]) -> nn.Module:
    """One layer parallelized by its part of a plan (names within it; "" the layer itself) on the mesh's "tp" dim:
    the planner's probe of what one tensor-parallel rank runs."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(module, mesh["tp"], plan[""] if "" in plan else dict(plan))  # type: ignore[index, arg-type]


@contextlib.contextmanager
def fake_mesh(size: int) -> Iterator[object]:
    """A one-dim DeviceMesh named "tp" of ``size`` ranks on torch's fake backend (collectives do nothing), this
    process its rank 0 while the block runs: the planner measures a rank's shards on it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # init_process_group wraps sys.excepthook to prefix "[rank0]: " to each line, for good: without this, one more
    # prefix per mesh on every traceback of the user's process ever after
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


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
    names = {
        id(param): ties.aliases.get(name, name)
        for module in stages.values()
        for name, param in module.named_parameters(remove_duplicate=False)
    }
    return dataclasses.replace(ties, names=names), placements


def agree_on_ties(ties: Ties, stages: dict[int, nn.Module], topology: Topology) -> Ties:
    """The ties after the transform (retie): one placement per tied weight on every rank that
    holds it, or every rank refuses naming it."""
    ties, placements = retie(ties, stages)
    if ties.owners:  # every rank knows the ties alike: all or none meet here
        seen: dict[str, set[str]] = {}
        for mine in topology.world.all_gather_object(placements, "the placements of the tied weights"):
            for name, wheres in mine.items():
                seen.setdefault(name, set()).update(wheres)
        split = {name: sorted(wheres) for name, wheres in seen.items() if len(wheres) > 1}
        if split:
            name, wheres = next(iter(split.items()))
            raise ValueError(
                f"the weight tied as {name!r} (with {[a for a, b in ties.aliases.items() if b == name]}) was "
                f"parallelized differently on the ranks that hold it: {wheres}; a tied weight must have one placement "
                "in every layer that holds it (e.g. RowwiseParallel on the embedding and ColwiseParallel on the head "
                "both shard it on dim 0), or none"
            )
    return ties


def shard_costs(
    costs: LayerCosts,
    names: Sequence[str],
    bounds: Sequence[tuple[int, int]],
    stages: Mapping[int, nn.Module],
    pipeline: Transport,
) -> LayerCosts:
    """``costs`` with each layer's parameters (count and bytes) as this rank's tensor-parallel index holds them: a
    shard where the plan split them (pipeengine.core.dtensors.tensor_parallel_numel). Each rank counts the layers of
    its stages (under the model's ``names``), the pipeline gathers them: every rank of the pipeline calls it. A layer
    no stage module holds under its name (a parallelize= that rebuilt the stage) keeps its unsharded figures."""
    mine: dict[int, tuple[int, int]] = {}
    for stage, module in stages.items():
        children = dict(module.named_children())
        for index in range(*bounds[stage]):
            layer = children.get(names[index])
            if layer is not None:
                held = [(tensor_parallel_numel(p), p.element_size()) for p in layer.parameters()]
                mine[index] = (sum(n for n, _ in held), sum(n * size for n, size in held))
    found: dict[int, tuple[int, int]] = {}
    for theirs in pipeline.all_gather_object(mine, "the layers' tensor-parallel shard sizes"):
        found.update(theirs)
    return costs.held_as(found, alike=pipeline.alone)  # a dry run builds this rank alone


@dataclass
class TensorSum(GradientSync):
    """The gradients of the parameters a tensor-parallel rank holds whole but computes only its part of (a per-head
    norm after a column-wise q_proj sees this rank's heads alone: the true gradient is the sum over the ranks),
    summed over the stage's tensor-parallel ranks. No instruction starts it: at a training step's end, after the
    replicas' AR (a mean of each rank's part, then their sum: the same sum) and the ties' TR, which write the same
    gradients back. Its flat buffer (the norms' weights: head_dim a norm) is not priced in the memory trace.

    Every rank with tensor parallelism has one (``modules`` maybe empty): after the first training step's reductions
    (its own the last of them) it checks that every parameter the ranks hold whole got the same gradient on each, or
    refuses the plan on every rank (leftout.check_replicated), before an optimizer steps on it; once passed, never
    again (a step whose gradients were not finite somewhere, fp16's overflow, passes nothing: the next checks)."""

    kind: ClassVar[Kind | None] = None
    tensor: Transport  # this stage's tensor-parallel ranks
    modules: list[nn.Module]  # the modules marked SUMMED; their own parameters looked up each step (FSDP swaps them)
    world: Transport  # every rank of the engine: each learns whether any rank's check failed
    stages: list[nn.Module]  # this rank's stages: their whole parameters checked at the first training step's end
    checked: bool = field(default=False, init=False)  # the check passed, on every rank alike: never run again
    _due: bool = field(default=False, init=False)  # a training step's end: check at its finish

    @property
    def after(self) -> tuple[Kind, ...]:
        return (Kind.ALL_REDUCE, Kind.TIE_REDUCE)

    def params(self) -> list[nn.Parameter]:
        found = {id(p): p for module in self.modules for p in module.parameters(recurse=False) if p.requires_grad}
        return list(found.values())

    def begin(self, average: bool) -> None:
        """A sum: what earlier steps left in .grad (summed already) is kept by tensor-parallel rank 0 alone."""
        if self.tensor.rank != 0:
            for param in self.params():
                if param.grad is not None:
                    param.grad.zero_()

    def start(self, op: Instruction, stream: tuple[Action, ...], average: bool, tracer: Spans) -> None:
        raise PipelineError(
            f"{op}: the tensor-parallel ranks' gradient sum is started by no instruction, at the "
            "step's end: a schedule has no instruction for it"
        )

    def end(self, tracer: Spans) -> None:
        grads = []
        for param in self.params():
            if param.grad is None:  # unused here this step: its part of the sum is zero
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        what = "the sum of the per-head parameters' gradients over the tensor-parallel ranks"
        self._reduce(None, grads, self.tensor, what, 1)
        self._due = not self.checked

    def finish(self, tracer: Spans) -> None:
        super().finish(tracer)
        if self._due:  # once per engine: a few numbers a parameter, gathered in one collective (leftout)
            self._due = False
            self.checked = check_replicated(whole_parameters(self.stages), self.tensor, self.world)


def tensor_sum(topology: Topology, stages: Mapping[int, nn.Module]) -> TensorSum | None:
    """This rank's TensorSum: its stages' modules a style marked SUMMED (maybe none: it checks the first step's whole
    parameters still); None without tensor parallelism."""
    if topology.tensor is None:
        return None
    marked = [m for module in stages.values() for m in module.modules() if getattr(m, SUMMED, False)]
    return TensorSum(topology.tensor, marked, topology.world, list(stages.values()))
