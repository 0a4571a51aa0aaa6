"""The planner's layer profile: the lean measurement (pipeengine.construction.measure: each layer's times F, B, I, W and
bytes on a micro-batch) with what the planner measures more, as a LayerProfile (pipeengine.planner.costmodel).

A rank that runs every layer of the model back to back (no pipeline: each layer follows the one before on the same
rank, with at most a collective between) meets a layer's weights cold (the lean measurement flushes the CPU's caches
before each timed run) but its host path warm: ``warm`` times each layer after the flush and a run of a copy of the
layer (its own weights and input): timed so, a tensor-parallel rank's block comes out near the thread time it spends
in a step, where timed cold it is a third longer (docs/benchmarks.md).

Under tensor parallelism each layer is measured as one tensor-parallel rank runs it: a copy parallelized by the
plan (torch's parallelize_module) on a process group of torch's fake backend, whose collectives do nothing, so
the times are the shard's computes alone and every collective the layer runs, forward and backward, is recorded
with its size, to be priced on the machine's measured links (pipeengine.planner.calibration). Where this process
already belongs to a process group (schedule="auto" on a rank), that is done in a fresh process.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from pipeengine.construction.measure import WithLoss, compiled, graded, leaves, nbytes, profile_columns
from pipeengine.core.specs import Tensors, map_tensors, unpack
from pipeengine.parallel import tensor
from pipeengine.planner import transients
from pipeengine.planner.costmodel import LayerProfile
from pipeengine.planner.elsewhere import elsewhere, one_process

__all__ = ["measure_layouts", "parameter_keys", "profile_layers"]


def parameter_keys(
    model: Iterable[nn.Module], sizes: Sequence[Sequence[int]] | None = None
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per layer, (index among the model's distinct parameters, bytes) of each distinct parameter it holds; ``sizes``:
    per layer, the bytes of each in order where they are not the model's (a tensor-parallel rank's shards)."""
    index: dict[int, int] = {}
    layers = []
    for number, layer in enumerate(model):
        held = list(dict.fromkeys(layer.parameters()))  # a layer's own repeats once
        bytes_ = sizes[number] if sizes is not None else [nbytes(p) for p in held]
        layers.append(tuple((index.setdefault(id(p), len(index)), n) for p, n in zip(held, bytes_, strict=True)))
    return tuple(layers)


def profile_layers(
    model: nn.Sequential,
    sample: torch.Tensor | Tensors,
    rows: int,
    *,
    repeats: int = 3,
    device: torch.device,
    threads: int | None = None,
    loss: Callable[..., torch.Tensor] | None = None,
    target: object = None,
    timed: bool = True,
    allocator: bool = False,
    compile: bool | Mapping[str, object] = False,
    progress: Callable[[], None] | None = None,
    tensor_parallel: int = 1,
    tp_plan: Mapping[str, object] | None = None,
    warm: bool = False,
) -> LayerProfile:
    """Measure every layer on the first ``rows`` rows of ``sample`` (each fed the real output of the one before),
    with ``threads`` torch threads (a rank's share of the cores; default: this process's). With ``loss`` and
    ``target`` (the batch's), ``loss(output, target's first rows)`` is measured as part of the last layer (the
    target itself is the user's, not counted). ``timed=False``: bytes only (one forward and backward a layer).
    ``allocator``: watch each compute's allocations too (pipeengine.planner.transients; one thread of this process
    may profile at a time). A layer is measured compiled where the engine runs it so: the user compiled it, or
    ``compile`` (the engine's compile=: True or torch.compile's keywords); a compiled layer's I then makes its weight
    gradients too, and its W is nothing (pipeengine.step.backward), as the engine runs it. ``progress()`` is called
    after each layer. ``tensor_parallel`` > 1: each layer as one of that many ranks runs it under ``tp_plan`` (the
    engine's: fnmatch patterns of the model's module names), with the collectives it runs (the module docstring); a
    plan that splits a parameter's dim into unequal shards is refused, naming it. ``warm``: on the CPU, each timed run
    (after the caches' flush) follows a forward and backward of a copy of the layer on a copy of its input, as a rank
    that runs every layer of the model back to back meets it (the module docstring)."""
    arguments = dict(
        repeats=repeats,
        device=device,
        threads=threads,
        loss=loss,
        target=target,
        timed=timed,
        allocator=allocator,
        compile=compile,
        warm=warm,
    )
    if tensor_parallel > 1:
        import torch.distributed as dist

        if tp_plan is None:
            raise ValueError(f"tensor_parallel={tensor_parallel} needs tp_plan= to shard the layers by")
        arguments.update(tensor_parallel=tensor_parallel, tp_plan=tp_plan)
        if dist.is_initialized():  # one default group to a process: the fake one is made in a fresh process
            return elsewhere(profile_layers, model, sample, rows, arguments)
        with tensor.fake_mesh(tensor_parallel) as mesh:
            shards = _layer_plans(model, tp_plan, tensor_parallel)
            return _measured(model, sample, rows, **arguments, progress=progress, shard=(mesh, shards))  # type: ignore[arg-type]
    return _measured(model, sample, rows, **arguments, progress=progress)  # type: ignore[arg-type]


def measure_layouts(
    model: nn.Sequential,
    sample: torch.Tensor | Tensors,
    wanted: Sequence[tuple[int, int, bool]],
    measuring: Mapping[str, object],
    progress: Callable[[int, int, int], None] | None = None,
) -> tuple[dict[tuple[int, int, bool], LayerProfile], dict[int, str]]:
    """The layers profiled (``profile_layers`` with ``measuring``'s options) at each (rows, tensor-parallel degree,
    host path warm) in ``wanted``, and the degrees whose plan cannot split a layer equally (tp -> why; their other
    sizes are not measured). ``progress(done, layers, sizes)``: 0 first, then after each layer at each size."""
    done, layers = 0, len(model)
    if progress is not None:
        progress(0, layers, len(wanted))

    def layer_done() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, layers, len(wanted))

    profiles: dict[tuple[int, int, bool], LayerProfile] = {}
    failed: dict[int, str] = {}
    with one_process():  # on a rank (schedule="auto"), the TP shards measured in one fresh process, not one each
        for rows, tp, alone in wanted:
            if tp in failed:
                continue
            try:
                profiles[rows, tp, alone] = profile_layers(
                    model,
                    sample,
                    rows,
                    progress=layer_done,
                    tensor_parallel=tp,
                    warm=alone,
                    **measuring,  # type: ignore[arg-type]
                )
            except ValueError as error:
                if tp == 1:
                    raise
                failed[tp] = str(error)
    return profiles, failed


def _measured(
    model: nn.Sequential,
    sample: torch.Tensor | Tensors,
    rows: int,
    *,
    repeats: int,
    device: torch.device,
    threads: int | None,
    loss: Callable[..., torch.Tensor] | None,
    target: object,
    timed: bool,
    allocator: bool,
    compile: bool | Mapping[str, object],
    progress: Callable[[], None] | None = None,
    tensor_parallel: int = 1,
    tp_plan: object = None,
    shard: tuple[object, list[dict[str, object]]] | None = None,
    warm: bool = False,
) -> LayerProfile:
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        layers = list(model)
        if loss is not None and target is not None:  # the loss runs on the last stage: that layer's, for stages
            part = map_tensors(target, lambda t: t[:rows].to(device).clone())  # type: ignore[arg-type]
            layers[-1] = WithLoss(layers[-1], loss, part)
        profile = _profile(
            layers, sample, rows, repeats if timed else 0, device, allocator, compile, progress, shard, warm
        )
        keys = profile.parameters if shard is not None else parameter_keys(model)  # the loss wrapper left out
        stash = torch.get_rng_state().numel() if device.type == "cpu" else 0  # checkpoint's preserve_rng_state
        return dataclasses.replace(
            profile, parameters=keys, timed=timed, tensor_parallel=tensor_parallel, checkpoint_stash=stash
        )
    finally:
        torch.set_num_threads(previous)


def _profile(
    model: Sequence[nn.Module],
    sample: torch.Tensor | Tensors,
    rows: int,
    repeats: int,
    device: torch.device,
    allocator: bool,
    compile: bool | Mapping[str, object] = False,
    progress: Callable[[], None] | None = None,
    shard: tuple[object, list[dict[str, object]]] | None = None,
    warm: bool = False,
) -> LayerProfile:
    extras = _Extras(repeats, device, allocator, compile, shard, warm)
    columns = profile_columns(model, sample, rows, repeats, device, compile, progress, extras)
    profile = LayerProfile(rows, **columns)  # type: ignore[arg-type]
    keys = parameter_keys(model, extras.probes) if extras.probes else ()  # the shards' sizes, each tie once
    return dataclasses.replace(
        profile,
        allocations=tuple(extras.allocations),
        collectives=tuple(extras.collectives),
        parameters=keys,
        shards_output=tuple(extras.shards_output),
    )


class _Extras:
    """What the planner measures of each layer beyond the lean measurement's columns (its Extras): under tensor
    parallelism the shard's parameters and collectives (recorded before any compile) and whether its output is a
    shard; the allocator's view; the host path warm before each timed compute."""

    def __init__(
        self,
        repeats: int,
        device: torch.device,
        allocator: bool,
        compile: bool | Mapping[str, object],
        shard: tuple[object, list[dict[str, object]]] | None,
        warm: bool,
    ) -> None:
        self.repeats, self.device, self.allocator, self.compile, self.shard, self.warm = (
            repeats,
            device,
            allocator,
            compile,
            shard,
            warm,
        )
        self.allocations: list[transients.Allocation] = []
        self.collectives: list[tuple[tuple[str, str, int], ...]] = []
        self.probes: list[list[int]] = []
        self.shards_output: list[bool] = []
        self.whole: torch.Tensor | Tensors | None = None  # under tensor parallelism: the unsharded layers' outputs

    def prepare(
        self, index: int, layer: nn.Module, probe: nn.Module, value: torch.Tensor | Tensors, flush: Callable[[], None]
    ) -> tuple[nn.Module, Callable[[], None]]:
        first = index == 0
        if first:
            self.whole = value  # to tell a shard from the whole
        if self.shard is not None:  # the shard's parameters and collectives, recorded before any compile
            probe = _sharded(probe, index, *self.shard)
            self.probes.append([nbytes(p) for p in dict.fromkeys(probe.parameters())])
            self.collectives.append(_collectives(probe, value, first))
        before = flush
        if self.warm and self.repeats and self.device.type == "cpu":  # a copy, compiled as the layer is (its code)
            before = _warming(flush, compiled(copy.deepcopy(probe), layer, self.compile), value, first)
        return probe, before

    def measured(self, probe: nn.Module, value: torch.Tensor | Tensors, first: bool) -> None:
        if self.allocator:
            self.allocations.append(
                transients.allocation(
                    probe,
                    lambda v=value, f=first: leaves(v, f),  # type: ignore[misc]
                    isinstance(value, tuple),
                    self.device,
                )
            )

    def passed(self, layer: nn.Module, value: torch.Tensor | Tensors) -> None:
        if self.shard is None:
            return
        whole = unpack(copy.deepcopy(layer).to(self.device)(self.whole))
        shapes = [tuple(t.shape) for t in unpack(value)], [tuple(t.shape) for t in whole]
        self.shards_output.append(shapes[0] != shapes[1])
        self.whole = whole if isinstance(value, tuple) else whole[0]


def _warming(
    flush: Callable[[], None], twin: nn.Module, value: torch.Tensor | Tensors, first: bool
) -> Callable[[], None]:
    """What runs before each timed compute of a warm profile: ``flush()``, then a forward and backward of ``twin`` (a
    copy of the layer) on a copy of its input: the host's path through the layer warm, the layer's own weights and
    input cold."""
    other = map_tensors(value, lambda t: t.clone())

    def run() -> None:
        flush()
        inputs = leaves(other, first)
        with torch.enable_grad():
            outputs = graded(twin, inputs, other)
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
        twin.zero_grad(set_to_none=True)

    return run


def _layer_plans(model: nn.Sequential, plan: Mapping[str, object], degree: int) -> list[dict[str, object]]:
    """Per layer, the plan's styles by module name within the layer ("" for the layer itself)."""
    resolved = tensor.plan_matches(model, plan, degree)
    names = [name for name, _ in model.named_children()]
    layers: list[dict[str, object]] = [{} for _ in names]
    for name, style in resolved.items():
        head, _, rest = name.partition(".")
        layers[names.index(head)][rest] = style
    return layers


def _sharded(probe: nn.Module, index: int, mesh: object, plans: list[dict[str, object]]) -> nn.Module:
    """The probe parallelized by its layer's part of the plan; refused where a split leaves unequal shards."""
    plan = plans[index]
    if not plan:
        return probe
    inner = probe.layer if isinstance(probe, WithLoss) else probe  # the plan names the model's layer
    inner = tensor.shard_layer(inner, mesh, plan)
    if isinstance(probe, WithLoss):
        probe.layer = inner
    else:
        probe = inner
    size = mesh.size()  # type: ignore[attr-defined]
    for name, param in probe.named_parameters():
        for placement in getattr(param, "placements", ()):
            if placement.is_shard() and param.shape[placement.dim] % size:
                raise ValueError(
                    f"tensor_parallel={size}: layer {index}'s parameter {name} {tuple(param.shape)} is split on dim "
                    f"{placement.dim} of {param.shape[placement.dim]}, which {size} ranks cannot share equally; use a "
                    "tensor-parallel degree that divides it"
                )
    return probe


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Each functional collective run inside it: (op, bytes of the whole tensor)."""

    OPS: Mapping[str, str] = {
        "all_reduce": "all_reduce",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
    }

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.seen = size, list[tuple[str, int]]()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        namespace, _, name = func.name().partition("::")
        if namespace == "_c10d_functional" and not name.startswith(("wait", "_wrap")):
            base = name.split(".")[0].removesuffix("_")
            tensor = args[0]
            nbytes = tensor.numel() * tensor.element_size()
            op = self.OPS.get(base, "all_gather")  # all-to-all and the rest: priced as gathering the whole
            self.seen.append((op, nbytes * self.size if op == "all_gather" else nbytes))
        return func(*args, **(kwargs or {}))


def _collectives(layer: nn.Module, value: torch.Tensor | Tensors, first: bool) -> tuple[tuple[str, str, int], ...]:
    """The collectives a sharded layer runs in its forward ("F") and its backward ("B") on one micro-batch."""
    import torch.distributed as dist

    size = dist.get_world_size()
    inputs = leaves(value, first)
    with torch.enable_grad(), _Recorder(size) as forward:
        outputs = graded(layer, inputs, value)
    with _Recorder(size) as backward:
        if outputs:
            torch.autograd.backward(outputs, tuple(torch.ones_like(o) for o in outputs))
    layer.zero_grad(set_to_none=True)
    return tuple(("F", op, n) for op, n in forward.seen) + tuple(("B", op, n) for op, n in backward.seen)
