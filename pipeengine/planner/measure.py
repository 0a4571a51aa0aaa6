"""The one layer profiler: each layer's times (F, B, I, W) and bytes on a micro-batch, measured once.

The partitioner (pipeengine.planner.partition: LayerCosts, ``measure``) and the planner (pipeengine.planner.search)
both read it, through the cost model (pipeengine.planner.costmodel), so both count time and bytes alike.
Parameters are timed and counted on copies, the random state forked: the model is left as it was.

On the CPU each timed run starts with the processor's caches flushed (pipeengine.planner.caches: a buffer the size
of its last-level cache written over): a rank meets its stage's weights cold, since between two of its computes
other layers, other micro-batches, communication and the ranks sharing the machine run (the same layer timed back
to back, its weights still cached, ran 20-50% faster than in a pipeline's step on the 2-core machine of the
benchmarks). A rank that runs every layer of the model back to back (no pipeline: each layer follows the one before
on the same rank, with at most a collective between) meets a layer's weights cold but its host path warm: ``warm``
times each layer after the flush and a run of a copy of the layer (its own weights and input). Measured on 4 gloo
ranks of that machine, a tensor-parallel rank (tp=4) spent 1.9 ms of thread time on each block (forward and
backward, less the collectives' launch) in a step; timed warm 1.75 ms, timed cold 2.6 ms.

Under tensor parallelism each layer is measured as one tensor-parallel rank runs it: a copy parallelized by the
plan (torch's parallelize_module) on a process group of torch's fake backend, whose collectives do nothing, so
the times are the shard's computes alone and every collective the layer runs, forward and backward, is recorded
with its size, to be priced on the machine's measured links (pipeengine.planner.calibration). Where this process
already belongs to a process group (schedule="auto" on a rank), that is done in a fresh process.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from pipeengine.core.compiling import compile_in_place
from pipeengine.core.dtensors import local, settled, tensor_parallel_numel
from pipeengine.core.specs import Tensors, map_tensors, unpack
from pipeengine.observe.ledger import Ledger
from pipeengine.parallel import tensor
from pipeengine.planner import transients
from pipeengine.planner.caches import flusher
from pipeengine.planner.costmodel import LayerCosts, LayerProfile
from pipeengine.planner.elsewhere import elsewhere
from pipeengine.runtime.backward import backward_input

__all__ = ["measure", "parameter_keys", "profile_layers"]


def measure(
    model: nn.Sequential,
    sample: torch.Tensor | Tensors | None = None,
    *,
    timed: bool = False,
    repeats: int = 5,
    device: str | torch.device | None = None,
    compile: bool | Mapping[str, object] = False,
) -> LayerCosts:
    """Costs of every layer for one micro-batch ``sample`` (the first stage's input), with profile_layers.

    Parameters always; the bytes each layer saves for its backward when a sample is given; forward
    and backward time when ``timed``: on ``device``, after one warm-up, the median of ``repeats`` runs.
    """
    if sample is None:
        if timed:
            raise ValueError("timing the layers needs a sample micro-batch: pass sample=")
        return LayerCosts.of(None, model)
    if timed and repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    rows = unpack(sample)[0].shape[0]
    profile = profile_layers(model, sample, rows, repeats=repeats, device=torch.device(device or "cpu"), timed=timed,
                             compile=compile)  # fmt: skip
    return LayerCosts.of(profile, model)


def parameter_keys(model: Iterable[nn.Module], sizes: Sequence[Sequence[int]] | None = None
                   ) -> tuple[tuple[tuple[int, int], ...], ...]:  # fmt: skip
    """Per layer, (index among the model's distinct parameters, bytes) of each distinct parameter it holds; ``sizes``:
    per layer, the bytes of each in order where they are not the model's (a tensor-parallel rank's shards)."""
    index: dict[int, int] = {}
    layers = []
    for number, layer in enumerate(model):
        held = list(dict.fromkeys(layer.parameters()))  # a layer's own repeats once
        bytes_ = sizes[number] if sizes is not None else [_nbytes(p) for p in held]
        layers.append(tuple((index.setdefault(id(p), len(index)), n) for p, n in zip(held, bytes_, strict=True)))
    return tuple(layers)


def profile_layers(
    model: nn.Sequential, sample: torch.Tensor | Tensors, rows: int, *, repeats: int = 3, device: torch.device,
    threads: int | None = None, loss: Callable[..., torch.Tensor] | None = None, target: object = None,
    timed: bool = True, allocator: bool = False, compile: bool | Mapping[str, object] = False,
    progress: Callable[[], None] | None = None, tensor_parallel: int = 1, tp_plan: Mapping[str, object] | None = None,
    warm: bool = False,
) -> LayerProfile:  # fmt: skip
    """Measure every layer on the first ``rows`` rows of ``sample`` (each fed the real output of the one before),
    with ``threads`` torch threads (a rank's share of the cores; default: this process's). With ``loss`` and
    ``target`` (the batch's), ``loss(output, target's first rows)`` is measured as part of the last layer (the
    target itself is the user's, not counted). ``timed=False``: bytes only (one forward and backward a layer).
    ``allocator``: watch each compute's allocations too (pipeengine.planner.transients; one thread of this process
    may profile at a time). A layer is measured compiled where the engine runs it so: the user compiled it, or
    ``compile`` (the engine's compile=: True or torch.compile's keywords); a compiled layer's I then makes its weight
    gradients too, and its W is nothing (pipeengine.runtime.backward), as the engine runs it. ``progress()`` is called
    after each layer. ``tensor_parallel`` > 1: each layer as one of that many ranks runs it under ``tp_plan`` (the
    engine's: fnmatch patterns of the model's module names), with the collectives it runs (the module docstring); a
    plan that splits a parameter's dim into unequal shards is refused, naming it. ``warm``: on the CPU, each timed run
    (after the caches' flush) follows a forward and backward of a copy of the layer on a copy of its input, as a rank
    that runs every layer of the model back to back meets it (the module docstring)."""
    if tensor_parallel > 1:
        import torch.distributed as dist

        if tp_plan is None:
            raise ValueError(f"tensor_parallel={tensor_parallel} needs tp_plan= to shard the layers by")
        arguments = dict(repeats=repeats, device=device, threads=threads, loss=loss, target=target, timed=timed,
                         allocator=allocator, compile=compile, tensor_parallel=tensor_parallel, tp_plan=tp_plan,
                         warm=warm)  # fmt: skip
        if dist.is_initialized():  # one default group to a process: the fake one is made in a fresh process
            return elsewhere(profile_layers, model, sample, rows, arguments)
        with tensor.fake_mesh(tensor_parallel) as mesh:
            shards = _layer_plans(model, tp_plan, tensor_parallel)
            return _measured(model, sample, rows, **arguments, progress=progress, shard=(mesh, shards))  # type: ignore[arg-type]
    return _measured(model, sample, rows, repeats=repeats, device=device, threads=threads, loss=loss, target=target,
                     timed=timed, allocator=allocator, compile=compile, progress=progress, warm=warm)  # fmt: skip


def _measured(
    model: nn.Sequential, sample: torch.Tensor | Tensors, rows: int, *, repeats: int, device: torch.device,
    threads: int | None, loss: Callable[..., torch.Tensor] | None, target: object, timed: bool, allocator: bool,
    compile: bool | Mapping[str, object], progress: Callable[[], None] | None = None, tensor_parallel: int = 1,
    tp_plan: object = None, shard: tuple[object, list[dict[str, object]]] | None = None, warm: bool = False,
) -> LayerProfile:  # fmt: skip
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        layers = list(model)
        if loss is not None and target is not None:  # the loss runs on the last stage: that layer's, for stages
            part = map_tensors(target, lambda t: t[:rows].to(device).clone())  # type: ignore[arg-type]
            layers[-1] = _WithLoss(layers[-1], loss, part)
        profile = _profile(layers, sample, rows, repeats if timed else 0, device, allocator, compile, progress, shard,
                           warm)  # fmt: skip
        keys = profile.parameters if shard is not None else parameter_keys(model)  # the loss wrapper left out
        stash = torch.get_rng_state().numel() if device.type == "cpu" else 0  # checkpoint's preserve_rng_state
        return dataclasses.replace(profile, parameters=keys, timed=timed, tensor_parallel=tensor_parallel,
                                   checkpoint_stash=stash)  # fmt: skip
    finally:
        torch.set_num_threads(previous)


class _WithLoss(nn.Module):
    """The last layer followed by the loss: what the last stage runs in training."""

    def __init__(self, layer: nn.Module, loss: Callable[..., torch.Tensor], target: torch.Tensor | Tensors) -> None:
        super().__init__()
        self.layer, self.loss, self.target = layer, loss, target

    def forward(self, value: object) -> torch.Tensor:
        return self.loss(self.layer(value), self.target)


def _profile(
    model: Sequence[nn.Module], sample: torch.Tensor | Tensors, rows: int, repeats: int, device: torch.device,
    allocator: bool, compile: bool | Mapping[str, object] = False, progress: Callable[[], None] | None = None,
    shard: tuple[object, list[dict[str, object]]] | None = None, warm: bool = False,
) -> LayerProfile:  # fmt: skip
    value = map_tensors(sample, lambda t: t[:rows].to(device))
    columns: dict[str, list[float | int | bool]] = {
        key: []
        for key in ("forward", "backward", "backward_input", "backward_weight", "parameter_bytes", "parameter_count",
                    "output", "gradient", "saved_other", "saves_input", "saves_output", "kept", "output_kept",
                    "other_freed", "saved")
    }  # fmt: skip
    allocations: list[transients.Allocation] = []
    collectives, probes, shards_output = [], list[list[int]](), list[bool]()
    whole = value  # under tensor parallelism: the unsharded layers' outputs, to tell a shard from the whole
    flush = flusher(device) if repeats else (lambda: None)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for index, layer in enumerate(model):
            probe = copy.deepcopy(layer).to(device)
            if shard is not None:  # the shard's parameters and collectives, recorded before any compile
                probe = _sharded(probe, index, *shard)
                probes.append([_nbytes(p) for p in dict.fromkeys(probe.parameters())])
                collectives.append(_collectives(probe, value, index == 0))
            first = index == 0  # the user's batch: no gradient wanted for it
            before = flush  # what runs before each timed compute
            if warm and repeats and device.type == "cpu":  # a copy, compiled as the layer is (sharing its code)
                before = _warming(flush, _compiled(copy.deepcopy(probe), layer, compile), value, first)
            probe = _compiled(probe, layer, compile)
            timings = [_time(probe, value, first, device, before) for _ in range(repeats + 1)][1:] if repeats else []
            for index_, key in enumerate(("forward", "backward", "backward_input", "backward_weight")):
                columns[key].append(statistics.median(t[index_] for t in timings) if timings else 0.0)
            sizes = _bytes(probe, value, first)
            for key, size in sizes.items():
                columns[key].append(size)
            if allocator:
                allocations.append(transients.allocation(probe, lambda v=value, f=first: _leaves(v, f),  # type: ignore[misc]
                                                      isinstance(value, tuple), device))  # fmt: skip
            with torch.no_grad():
                value = map_tensors(probe(value), local)
                if shard is not None:
                    whole = unpack(copy.deepcopy(layer).to(device)(whole))
                    shapes = [tuple(t.shape) for t in unpack(value)], [tuple(t.shape) for t in whole]
                    shards_output.append(shapes[0] != shapes[1])
                    whole = whole if isinstance(value, tuple) else whole[0]
            del probe
            if progress is not None:
                progress()
    profile = LayerProfile(rows, **{key: tuple(values) for key, values in columns.items()})  # type: ignore[arg-type]
    keys = parameter_keys(model, probes) if probes else ()  # the shards' sizes, each tie once as in the model
    return dataclasses.replace(profile, allocations=tuple(allocations), collectives=tuple(collectives),
                               parameters=keys, shards_output=tuple(shards_output))  # fmt: skip


def _compiled(probe: nn.Module, layer: nn.Module, compile: bool | Mapping[str, object]) -> nn.Module:
    """The copy of ``layer`` to measure, compiled where the engine runs it so (a copy does not keep
    nn.Module.compile's compiled call: compiled again, as the user or compile= compiled the layer, with the user's own
    options unknown: torch.compile's defaults)."""
    if compile or getattr(layer, "_compiled_call_impl", None) is not None:
        compile_in_place(probe, {} if isinstance(compile, bool) else compile)
    return probe


def _warming(flush: Callable[[], None], twin: nn.Module, value: torch.Tensor | Tensors, first: bool
             ) -> Callable[[], None]:  # fmt: skip
    """What runs before each timed compute of a warm profile: ``flush()``, then a forward and backward of ``twin`` (a
    copy of the layer) on a copy of its input: the host's path through the layer warm, the layer's own weights and
    input cold."""
    other = map_tensors(value, lambda t: t.clone())

    def run() -> None:
        flush()
        inputs = _leaves(other, first)
        with torch.enable_grad():
            outputs = _graded(twin, inputs, other)
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
        twin.zero_grad(set_to_none=True)

    return run


def _leaves(value: torch.Tensor | Tensors, first: bool) -> Tensors:
    return unpack(map_tensors(value, lambda t: t.detach().requires_grad_(t.is_floating_point() and not first)))


def _graded(layer: nn.Module, inputs: Tensors, value: torch.Tensor | Tensors) -> list[torch.Tensor]:
    """The layer's outputs on ``inputs`` (``value``'s leaves: passed as a tuple where ``value`` is one) that a
    backward starts from, each settled (a tensor-parallel collective waited for)."""
    return [settled(o) for o in unpack(layer(inputs if isinstance(value, tuple) else inputs[0])) if o.requires_grad]


def _time(layer: nn.Module, value: torch.Tensor | Tensors, first: bool, device: torch.device,
          flush: Callable[[], None]) -> tuple[float, ...]:  # fmt: skip
    """Forward, full backward, input-gradient (I) and weight-gradient (W) seconds of one layer on one input,
    each through the engine's own code (pipeengine.runtime.backward for I and W, as a zero-bubble stage runs them),
    each after ``flush()`` (the CPU's caches emptied)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    params = [p for p in layer.parameters() if p.requires_grad]

    def forward(timed: bool = True) -> tuple[Tensors, list[torch.Tensor], float]:
        inputs = _leaves(value, first)
        with torch.enable_grad():
            sync()
            if timed:
                flush()
            start = time.perf_counter()
            outputs = _graded(layer, inputs, value)
            sync()
        return inputs, outputs, time.perf_counter() - start

    inputs, outputs, forward_time = forward()
    grads = tuple(torch.ones_like(o) for o in outputs)
    flush()
    start = time.perf_counter()
    if outputs:
        torch.autograd.backward(outputs, grads)
    sync()
    backward_time = time.perf_counter() - start
    inputs, outputs, _ = forward(timed=False)
    flush()
    start = time.perf_counter()
    weight_pass = backward_input(tuple(outputs), grads, inputs, params)[1] if outputs else None
    sync()
    input_time = time.perf_counter() - start
    flush()
    start = time.perf_counter()
    if weight_pass is not None:
        weight_pass.run()
    sync()
    weight_time = time.perf_counter() - start
    layer.zero_grad(set_to_none=True)
    return forward_time, backward_time, input_time, weight_time


def _bytes(layer: nn.Module, value: torch.Tensor | Tensors, first: bool) -> dict[str, int | bool]:
    """What one micro-batch's forward through the layer leaves for its backward, by storage."""
    inputs = _leaves(value, first)
    target = layer.target if isinstance(layer, _WithLoss) else ()
    ledger = Ledger(ignore=[*layer.parameters(), *unpack(target)])
    with ledger.watching(), torch.enable_grad():
        outputs = tuple(settled(o) for o in unpack(layer(inputs if isinstance(value, tuple) else inputs[0])))
        saved = dict(ledger.saved)  # storage -> [bytes, holders]
    mine = {local(t).untyped_storage().data_ptr(): local(t).untyped_storage().nbytes() for t in inputs if t.numel()}
    made = {local(t).untyped_storage().data_ptr(): local(t).untyped_storage().nbytes() for t in outputs if t.numel()}
    # the last stage keeps a new scalar (the loss, weighted) and lets the loss's own output go: count its elements
    output = sum(t.numel() * t.element_size() for t in outputs) if isinstance(layer, _WithLoss) else sum(made.values())
    gradient = sum(t.numel() * t.element_size() for t in outputs if t.is_floating_point())
    other = [key for key in saved if key not in mine and key not in made]
    kept, output_kept, other_freed = 0, any(key in saved for key in made), 0
    needing = tuple(o for o in outputs if o.requires_grad)
    if needing and any(x.requires_grad for x in inputs):  # what I keeps for W, as a zero-bubble stage's would
        params = [p for p in layer.parameters() if p.requires_grad]
        grads = tuple(torch.ones_like(o) for o in needing)
        _, weight_pass = backward_input(needing, grads, inputs, params)
        storages = {local(g).untyped_storage().data_ptr(): local(g).untyped_storage().nbytes()
                    for _, held, _ in weight_pass.roots for g in held if g is not None}  # fmt: skip
        kept = sum(storages.values())
        # the output outlives I only if W needs it: the nodes above W's restart points go with the output
        shown = weight_pass.fallback[0] if weight_pass.fallback is not None else ()
        del outputs, needing
        output_kept = all(ledger.holds(key, shown) for key in made)
        other_freed = sum(saved[key][0] for key in other if not ledger.holds(key, shown))
    return {
        "kept": kept,
        "parameter_bytes": sum(_nbytes(p) for p in layer.parameters()),
        "parameter_count": sum(tensor_parallel_numel(p) for p in layer.parameters()),
        "saved": sum(entry[0] for entry in saved.values()),
        "output": output,
        "gradient": gradient,
        "saved_other": sum(saved[key][0] for key in other),
        "saves_input": any(key in saved for key in mine),
        "saves_output": any(key in saved for key in made),
        "output_kept": output_kept,
        "other_freed": other_freed,
    }



def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of a parameter: a tensor-parallel shard where the plan split it."""
    return tensor_parallel_numel(tensor) * tensor.element_size()


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
    inner = probe.layer if isinstance(probe, _WithLoss) else probe  # the plan names the model's layer
    inner = tensor.shard_layer(inner, mesh, plan)
    if isinstance(probe, _WithLoss):
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

    OPS: Mapping[str, str] = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                              "reduce_scatter_tensor": "reduce_scatter"}  # fmt: skip

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
    inputs = _leaves(value, first)
    with torch.enable_grad(), _Recorder(size) as forward:
        outputs = _graded(layer, inputs, value)
    with _Recorder(size) as backward:
        if outputs:
            torch.autograd.backward(outputs, tuple(torch.ones_like(o) for o in outputs))
    layer.zero_grad(set_to_none=True)
    return tuple(("F", op, n) for op, n in forward.seen) + tuple(("B", op, n) for op, n in backward.seen)
