"""FSDP2 (fully_shard) over the data-parallel replicas: each replica holds 1/dp of every stage's weights, gradients
and optimizer state; the whole parameters are gathered for the computes and the gradients reduce-scattered once
per step. Everything FSDP is in this module, but its checkpoint form (pipeengine.parallel.fsdp_checkpoint):

    check_shardable(model)        refused before any stage is cut: a layer of mixed or integer parameters
    refuse_shared_units(...)      refused: a weight two stages of one rank share (one root per stage)
    shard_stage(module, ...)      applied: each layer with parameters of its own a unit, then the stage the root
    units / gather / reshard      a stage's units, all-gathered or back to their shards
    stage_output(module)          a block without FSDP2's warning that the stage's output is a view
    ShardedReduce                 its gradient reduction (AR), as torch.distributed.pipelining's stage does it
    priced(memory, ...)           what the planner's memory model holds of it (the state over the replicas)
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from pipeengine.core.dtensors import tensor_parallel_numel
from pipeengine.core.ties import Ties
from pipeengine.observe.trace import Spans
from pipeengine.parallel.gradsync import Gathered, GradientSync, SyncBytes
from schedules import Action, Instruction, Kind, Memory

__all__ = [
    "ShardedReduce",
    "check_shardable",
    "gather",
    "priced",
    "refuse_shared_units",
    "reshard",
    "shard_stage",
    "stage_output",
    "units",
]


def units(module: nn.Module) -> list[nn.Module]:
    """The FSDP units of a stage module (fully_shard'ed modules, the stage's root among them); none without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    return [unit for unit in module.modules() if isinstance(unit, FSDPModule)]


def gather(module: nn.Module, keep: bool = False) -> nn.Module:
    """The module with FSDP's whole parameters in place (its units all-gathered; nothing without FSDP); ``keep``:
    held through forwards too (reshard_after_forward off until reshard())."""
    for unit in units(module):
        unit.unshard()  # type: ignore[operator]
        if keep:
            unit.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
    return module


def reshard(module: nn.Module, after_forward: bool = False) -> None:
    """Free what gather() gathered: each unit back to its shard (``after_forward``: as it was built, resharding
    after each forward again)."""
    for unit in units(module):
        unit.reshard()  # type: ignore[operator]
        if after_forward:
            unit.set_reshard_after_forward(True, recurse=False)  # type: ignore[operator]


@contextlib.contextmanager
def stage_output(module: nn.Module) -> Iterator[None]:
    """Run a sharded stage module without FSDP2's warning that it (or its last layer, whose output is the stage's)
    returned a view: its warning is about an in-place op on that view in a later module, and the engine, which takes
    the stage's output, makes none (it casts, sends, backpropagates). The other units still warn."""
    children = list(module.children())
    names = {type(module).__name__, *([type(children[-1]).__name__] if children else [])}
    pattern = rf"FSDP2-wrapped module \(({'|'.join(map(re.escape, names))})\) returned a view tensor"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=pattern)
        yield


class Sharded:
    """A stage with FSDP2's units in it, as its steps see it (pipeengine.step.stage.Sharding): gathered whole on
    demand, its forward run without FSDP2's warning about the view it returns (``stage_output``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def gather(self) -> None:
        gather(self.module)

    def forward(self) -> contextlib.AbstractContextManager[None]:
        return stage_output(self.module)


def sharding(module: nn.Module) -> Sharded | None:
    """The stage's Sharded, or None where FSDP2 sharded nothing of it."""
    return Sharded(module) if units(module) else None


def check_shardable(model: nn.Sequential) -> None:
    """Every layer's parameters are floating and of one dtype (FSDP2 gathers a unit's parameters as one flat
    buffer); checked on the whole model, so every rank refuses alike, before any stage is built."""
    for name, layer in model.named_children():
        dtypes = {p.dtype for p in layer.parameters()}
        if len(dtypes) > 1 or any(not d.is_floating_point for d in dtypes):
            shown = sorted(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(
                f"fsdp=True: layer {name} ({type(layer).__name__}) holds parameters of dtypes {shown}; FSDP2 shards "
                "a layer's parameters as one buffer of one floating dtype. Give the layer one dtype (e.g. .float()), "
                "make integer state a buffer, or train with fsdp=False"
            )


def refuse_shared_units(ties: Ties, placement: Sequence[int]) -> None:
    """FSDP2 shards a parameter within one root; a weight two stages of one rank share would be in two."""
    for group, stages in enumerate(ties.groups):
        ranks = [placement[s] for s in stages]
        shared = sorted({r for r in ranks if ranks.count(r) > 1})
        if shared:
            raise ValueError(
                f"fsdp=True: the weight tied as {list(ties.members[group])} is used by stages "
                f"{[s for s in stages if placement[s] == shared[0]]}, both on pipeline rank {shared[0]}; FSDP2 shards "
                "each stage on its own (one fully_shard root per stage) and cannot shard one parameter in two. Use a "
                "schedule that places those stages on different ranks (e.g. '1f1b', 'interleaved'), or fsdp=False"
            )


def shard_stage(module: nn.Module, stage: int, mesh: object, reshard_after_forward: bool) -> nn.Module:
    """FSDP2 over the mesh's "dp" dim: each layer with parameters of its own a unit (gathered and freed together;
    a layer sharing a parameter with another is left to the stage's unit), then the stage module, the root."""
    from torch.distributed.fsdp import fully_shard

    users: dict[int, int] = {}
    for layer in module.children():
        for param in set(layer.parameters()):
            users[id(param)] = users.get(id(param), 0) + 1
    units = [
        (f"layer {name}", layer)
        for name, layer in module.named_children()
        if [*layer.parameters()] and all(users[id(p)] == 1 for p in layer.parameters())
    ]
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


@dataclass
class ShardedReduce(GradientSync):
    """AR with fsdp=True: FSDP2's reduce-scatter of stage ``op.stage``'s gradients into its sharded parameters, once
    per step (each micro-batch's backward only accumulates: set_requires_gradient_sync(False) until then), as
    torch.distributed.pipelining's stage does it (perform_reduce_grad): its flags on, the post-backward of every
    parameter group, the root's final callback, the flags off again."""

    kind: ClassVar[Kind] = Kind.ALL_REDUCE
    roots: dict[int, nn.Module]  # stage -> its module, fully_shard'ed (an FSDPModule)
    replicas: int  # FSDP2 divides by this unless the step sums (a global token count)
    sum_only: bool = False  # the backend reduces with SUM alone (gloo): FSDP2 divides after, not in the collective
    reshard_after_forward: bool = False  # the units free their gathered parameters after each forward
    late_buffers: bool = False  # gloo: a unit's reduce-scatter lets its buffers go late, on gloo's thread (priced)
    _begun: list[nn.Module] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        for root in self.roots.values():
            self.accumulate(root)

    @staticmethod
    def accumulate(root: nn.Module) -> None:
        """Micro-batches' backwards add into the unsharded gradients: no reduce-scatter, parameters kept gathered."""
        root.set_is_last_backward(False)  # type: ignore[operator]
        root.set_reshard_after_backward(False)  # type: ignore[operator]
        root.set_requires_gradient_sync(False)  # type: ignore[operator]

    def start(self, op: Instruction, stream: tuple[Action, ...], average: bool, tracer: Spans) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        root = self.roots[op.stage]
        with tracer.span(op):
            root.set_is_last_backward(True)  # type: ignore[operator]
            root.set_reshard_after_backward(True)  # type: ignore[operator]
            root.set_requires_gradient_sync(True)  # type: ignore[operator]
            for unit in root.modules():  # each unit's own (these setters do not recurse)
                if isinstance(unit, FSDPModule):
                    unit.set_gradient_divide_factor(float(self.replicas if average else 1))
                    unit.set_force_sum_reduction_for_comms(self.sum_only)  # gloo has no PREMUL_SUM
            for state in fully_shard.state(root)._state_ctx.all_states:  # type: ignore[attr-defined]
                for group in _param_groups(state):
                    group.post_backward()  # the reduce-scatter into the sharded .grad; the parameters resharded
            self._begun.append(root)

    def finish(self, tracer: Spans) -> None:
        from torch.distributed.fsdp import fully_shard

        begun, self._begun = self._begun, []
        for root in begun:
            fully_shard.state(root)._root_post_backward_final_callback()  # type: ignore[attr-defined]
            self.accumulate(root)
        if not begun:  # a forward-only step (eval): no backward resharded what its forwards gathered
            for root in self.roots.values():
                reshard(root)

    def bytes(self, stream: tuple[Action, ...], into: SyncBytes) -> None:
        """Whole: gathered from the first F (which holds them once more while it gathers), gradients from the first
        B or W; the AR reshards the parameters and reduce-scatters unit by unit, each unit's shards made before its
        whole gradients go (the AR's rise), and FSDP2 keeps a unit's reduce-scatter input to the step's end (the
        largest unit's, a bound). reshard_after_forward frees them between a forward and the next backward (then
        gathered again): the model holds them from the first F to the AR as without it (an upper bound, by at most
        their size)."""
        for stage, root in self.roots.items():
            params = list(dict.fromkeys(root.parameters()))
            unit = max(_unit_gradients(root))  # FSDP2 keeps the last unit's reduce-scatter input (the largest, bound)
            grads = _whole_bytes(params)
            into.gathered[stage] = Gathered(
                _whole_bytes(params, trainable=False),
                grads,
                unit,
                _reduce_rise(unit, grads, self.replicas, self.late_buffers),
            )

    def gathered(self) -> list[nn.Parameter]:
        return [p for root in self.roots.values() for p in root.parameters()]

    @contextlib.contextmanager
    def whole(self, module: nn.Module) -> Iterator[None]:
        """Gathered (kept through forwards) inside the block; then its shards again, as built."""
        gather(module, keep=True)
        try:
            yield
        finally:
            reshard(module, self.reshard_after_forward)


def _reduce_rise(unit: float, gradients: float, replicas: int, late_buffers: bool) -> float:
    """The most a stage's AR holds above its start (bytes): its largest unit's shards, made before that unit's whole
    gradients go; where gloo lets a reduce-scatter's buffers go late, on its thread (``late_buffers``), the earlier
    units' too, up to the stage's whole gradients (measured on 4 gloo ranks: 0 to 2 units' more from step to step)."""
    return unit / replicas + (gradients if late_buffers else 0.0)


def _whole_bytes(params: Iterable[nn.Parameter], trainable: bool = True) -> float:
    """Bytes of these parameters gathered over the replicas (a tensor-parallel rank's part of each)."""
    return float(sum(tensor_parallel_numel(p) * p.element_size() for p in params if p.requires_grad or not trainable))


def _unit_gradients(root: nn.Module) -> list[float]:
    """Each FSDP unit's own whole gradients (bytes): shard_stage's layer units, then the root's other parameters."""
    inner = [unit for unit in units(root) if unit is not root]
    owned = {id(p) for unit in inner for p in unit.parameters()}
    rest = [p for p in dict.fromkeys(root.parameters()) if id(p) not in owned]
    return [*(_whole_bytes(dict.fromkeys(unit.parameters())) for unit in inner), _whole_bytes(rest)]


def probe_stage(module: nn.Module, group: object, device_type: str) -> nn.Module:
    """``module`` sharded over ``group`` as shard_stage shards a stage, its gradients accumulated whole between
    syncs as ShardedReduce keeps them: what the planner's calibration times (pipeengine.planner.probes). Its
    parameters are gathered by its next forward after ``regather(module)``; ``sync_next(module)`` makes its next
    backward reduce-scatter."""
    from pipeengine.parallel.tensor import group_mesh

    sharded = shard_stage(module, 0, group_mesh(group, device_type, "dp"), False)
    ShardedReduce.accumulate(sharded)
    return sharded


def regather(module: nn.Module) -> None:
    """A probe_stage's parameters freed to their shards, gathered again by its next forward; no sync until asked."""
    module.reshard()  # type: ignore[operator]
    ShardedReduce.accumulate(module)


def sync_next(module: nn.Module) -> None:
    """A probe_stage's next backward reduce-scatters its gradients into the shards and frees the gathered parameters."""
    module.set_requires_gradient_sync(True)  # type: ignore[operator]
    module.set_is_last_backward(True)  # type: ignore[operator]
    module.set_reshard_after_backward(True)  # type: ignore[operator]


def priced(
    memory: Memory,
    state: list[float],
    optimizer_copies: float,
    data_parallel: int,
    allocations: bool,
    units: Sequence[float],
    buffered: bool,
) -> Memory:
    """The planner's memory model of a layout with fsdp=True: each stage's state sharded over the replicas, its
    parameters and gradients gathered whole during the step, no flat all-reduce buffer. ``units``: each stage's
    largest layer's parameter bytes (a unit: its reduce-scatter input is what the AR leaves held, as
    ShardedReduce.bytes says of a built stage). ``buffered`` (gloo): the AR's rise holds the stage's whole gradients
    more (_reduce_rise)."""
    whole = [s / (2 + optimizer_copies) for s in state]  # each stage's parameters, gathered
    table = memory.per_stage(len(whole))
    # a unit's backward makes all its parameters' gradients before FSDP2's hook adds them to the whole ones (without
    # FSDP each is added as it is made): a B or W holds at least the largest unit's gradients while it runs
    backward, weight = (
        [max(t, u) for t, u in zip(table[name], units, strict=True)]
        for name in ("backward_transient", "weight_transient")
    )
    first = None
    if allocations:  # the first backward of a step makes every unit's whole gradient before it ends (FSDP2 keeps
        # each to accumulate into): at least that much on top while it runs (measured by the engine's traced steps)
        first = [max(t, w) for t, w in zip(table["first_transient"], whole, strict=True)]
    return dataclasses.replace(
        memory,
        state=[s / data_parallel for s in state],
        gathered=whole,
        gathered_grads=whole,
        sync=0.0,
        reduce_held=list(units),
        gather_transient=whole,
        reduce_transient=[_reduce_rise(u, w, data_parallel, buffered) for u, w in zip(units, whole, strict=True)],
        backward_transient=backward,
        weight_transient=weight,
        grads_late=[g / data_parallel for g in whole] if allocations else 0.0,
        optimizer=[o / data_parallel for o in memory.optimizer] if allocations else 0.0,  # type: ignore[union-attr]
        first_transient=first if first is not None else memory.first_transient,
    )


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list (``_fsdp_param_groups``) in torch 2.13; one group or None
    (``_fsdp_param_group``) in torch 2.11 and before (seen on a lent GPU's torch 2.11, where the list is absent)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]
