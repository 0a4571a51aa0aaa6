"""Traced steps: when every instruction ran on every rank, and, for a training step, the memory each rank held.

``with engine.tracing():`` (or ``trace=True``) runs each step under a Tracer (pipeengine.observe.trace).
A traced training step first measures each of this rank's stages once per batch shape and program
(``measure_stage``: its worker run on the step's first micro-batch under a ledger, its state from the
optimizer's), then samples the bytes held after every instruction. Rank 0 gathers one Timeline.

    sizes (per stage)  ──► timeline.sizes     what the simulator is fed (Costs.from_timeline)
    ledger samples     ──► timeline.memory    the bytes held over the step, its peaks
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from pipeengine.comm.base import Transport
from pipeengine.core.dtensors import local_bytes
from pipeengine.core.sharding import gather, reshard
from pipeengine.core.specs import Boundary, Tensors, unpack
from pipeengine.observe.allocator import AllocatorWatch, training_bytes
from pipeengine.observe.ledger import Ledger, StageSizes, optimizer_copies, storage
from pipeengine.observe.trace import NULL_TRACER, RANGES_ONLY, Tracer, profiler_open, profiling
from pipeengine.runtime.executor import Executor, StepInputs, StepResult
from pipeengine.runtime.gradsync import ReplicaMean, ShardedReduce, TieSum
from pipeengine.runtime.stage import StageWorker
from schedules import Kind, Schedule, Timeline

__all__: list[str] = []


class Tracing:
    """Whether steps are traced, and the last traced step's timeline (on group rank 0 of the pipeline)."""

    def __init__(self, enabled: bool, device: torch.device, pipeline: Transport, num_stages: int) -> None:
        self.enabled = enabled
        self.optimizer: torch.optim.Optimizer | None = None  # while tracing: whose state counts
        self.timeline: Timeline | None = None
        self._tracer = Tracer(device)
        self._pipeline, self._num_stages = pipeline, num_stages
        self._allocator = AllocatorWatch.available(device, shared_process=pipeline.shared_clock)
        self._sizes: dict[tuple[object, ...], dict[int, StageSizes]] = {}  # per batch shape, program, optimizer
        self._said = False  # the warning that the user's profiler turns the allocator watch off, given once

    @contextlib.contextmanager
    def on(self, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
        previous, self.enabled, self.optimizer = self.enabled, True, optimizer
        try:
            yield
        finally:
            self.enabled, self.optimizer = previous, None

    def run(self, executor: Executor, program: Schedule, step: StepInputs, params: list[nn.Parameter]) -> StepResult:
        """Run a step, traced if tracing is on (every rank of the pipeline alike)."""
        profiled = profiling()  # the user's profiler records: each instruction is a range in it
        if not self.enabled:
            return executor.run(program, step, RANGES_ONLY if profiled else NULL_TRACER)
        self._tracer.profiled = profiled
        # on the CPU the allocator is watched by a profiler of ours: not while one of the user's is open
        allocator = self._allocator and not (self._tracer.device.type == "cpu" and step.train and profiler_open())
        if allocator != self._allocator and not self._said:
            self._said = True
            warnings.warn(
                "engine.tracing(): a torch.profiler is open (yours), and on the CPU the allocator is watched by one "
                "(one at a time): the traced steps' allocator figures (timeline.allocated_peak) are not measured while "
                "it is open; the ledger's (timeline.peak_memory) are. Your profiler shows each instruction as a range "
                "named as in the timeline",
                stacklevel=4,
            )
        if not step.train:
            self._tracer.begin()
            result = executor.run(program, step, self._tracer)
        else:  # memory too: the sizes of this rank's stages, then what it holds after every instruction
            sizes = self._measure(executor, program, step, params, allocator)
            batch = [t for mb in (step.inputs or ()) for t in mb]
            batch += [t for target in (step.targets or ()) for t in unpack(target) if isinstance(t, torch.Tensor)]  # type: ignore[arg-type]
            gathered = None  # FSDP: the parameters a stage gathers are the state's, not activations, wherever they are
            if isinstance(executor.syncs.get(Kind.ALL_REDUCE), ShardedReduce):
                gathered = lambda: [p for w in executor.workers.values() for p in w.module.parameters()]  # noqa: E731
            ledger = Ledger(ignore=[*params, *batch], ignore_live=gathered)  # the user's batch is theirs
            self._tracer.begin(ledger, sum(s.state for s in sizes.values()), sizes)
            live = training_bytes(params, self.optimizer)
            with ledger.watching(), AllocatorWatch(self._tracer.device) if allocator else _nothing() as watch:
                result = executor.run(program, step, self._tracer)
            self._tracer.allocated = live + watch.peak if watch is not None else None
        self.timeline = self._tracer.gather(f"{program.name} measured", self._pipeline, self._num_stages)
        return result

    def _measure(self, executor: Executor, program: Schedule, step: StepInputs, params: list[nn.Parameter],
                 allocator: bool) -> dict[int, StageSizes]:  # fmt: skip
        """This rank's stages measured on the step's first micro-batch (once per batch shape and program)."""
        copies = optimizer_copies(self.optimizer, params)
        key = (step.first_input, tuple(step.boundaries), id(program), copies, allocator)
        sizes = self._sizes.get(key)
        if sizes is not None:
            return sizes
        sizes, seen, workers = {}, set(), executor.workers
        last = self._num_stages - 1
        split = {op.stage for rank in range(program.num_ranks) for _, op in program.ops(rank)
                 if op.kind is Kind.BACKWARD_INPUT}  # fmt: skip
        device = self._tracer.device
        fsdp = executor.syncs.get(Kind.ALL_REDUCE)
        sharded = isinstance(fsdp, ShardedReduce)
        regathered = sharded and fsdp.reshard_after_forward  # type: ignore[union-attr]
        for s, worker in sorted(workers.items()):
            mine = [p for p in dict.fromkeys(worker.module.parameters()) if id(p) not in seen]
            seen |= {id(p) for p in mine}  # a weight shared by two stages of this rank is held once
            if s == 0:
                inputs, packed = step.inputs[0], step.first_input.is_tuple  # type: ignore[index]
            else:
                boundary = step.boundaries[s - 1]
                inputs = tuple(  # leaves, as the executor makes them
                    torch.zeros(spec.shape, dtype=spec.dtype, device=device).requires_grad_(spec.requires_grad)
                    for spec in boundary.specs
                )
                packed = boundary.is_tuple
            if sharded:  # measured on the gathered parameters; the step then starts sharded, as untraced ones do
                gather(worker.module, keep=True)
            sizes[s] = measure_stage(
                worker, inputs, packed, step.targets[0] if s == last else None,  # type: ignore[index]
                None if s == last else step.boundaries[s], split=s in split,
                parameter_bytes=sum(_size(p) for p in mine), optimizer_copies=copies,
                allocator=allocator,
            )  # fmt: skip
            late = sum(_size(p) for p in mine if p.grad is None and p.requires_grad)  # zero_grad(set_to_none=True)
            sizes[s] = dataclasses.replace(sizes[s], grads_late=float(late))
            if sharded:  # whole: gathered from the first F, gradients from the first B or W; the AR's flat input (the
                # whole gradients) comes after FSDP2 reshards the parameters, so it never tops the level before the AR.
                # reshard_after_forward frees them between a forward and the next backward (then gathered again): the
                # model holds them from the first F to the AR as without it (an upper bound, by at most their size)
                whole = float(sum(p.numel() * p.element_size() for p in mine if p.requires_grad))
                everything = float(sum(p.numel() * p.element_size() for p in mine))
                sizes[s] = dataclasses.replace(sizes[s], gathered=everything, gathered_grads=whole)

                reshard(worker.module, regathered)
        if allocator and sizes:  # the optimizer steps over all of this rank's parameters at once
            first = min(sizes)
            sizes[first] = dataclasses.replace(sizes[first], optimizer=optimizer_transient(self.optimizer, params))
        stream = program.instructions[executor.rank]
        replicas = executor.syncs.get(Kind.ALL_REDUCE)
        if isinstance(replicas, ReplicaMean):  # what each stage's AR flattens, to the step's end
            for s, owned in replicas.owned(stream).items():
                sizes[s] = dataclasses.replace(sizes[s], sync=float(sum(_size(p) for p in owned)))
        ties = executor.syncs.get(Kind.TIE_REDUCE)
        self._tracer.tie_sync = {g: float(sum(_size(p) for p in tie.params)) for g, tie in ties.groups.items()} if (
            isinstance(ties, TieSum)) else {}  # fmt: skip
        self._sizes[key] = sizes
        return sizes


def measure_stage(
    worker: StageWorker,
    inputs: Tensors,
    packed: bool,
    target: object,
    output: Boundary | None,
    *,
    split: bool,
    parameter_bytes: float,
    optimizer_copies: float,
    allocator: bool = False,
) -> StageSizes:
    """Run a stage's forward and backward once on a sample micro-batch, counting what it holds after each.

    The stage's gradients, buffers and random state are as they were afterwards. ``inputs`` are
    the stage input as the executor makes it (leaves needing grad as the boundary says); the
    first stage's input is the user's batch, never counted. ``parameter_bytes``: the stage's
    parameters not already held by another stage of the rank, for the step-long state. ``allocator``:
    watch each compute's allocations too (pipeengine.observe.allocator), for its transient peak.
    """
    params = list(dict.fromkeys(worker.module.parameters()))
    targets = target if isinstance(target, tuple) else (target,)
    user = [*(inputs if worker.index == 0 else ()), *(t for t in targets if isinstance(t, torch.Tensor))]
    ledger = Ledger(ignore=[*params, *user])  # the user's batch (inputs, targets) is theirs, not the engine's
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in worker.module.buffers()]
    devices = [t.device for t in inputs if t.device.type == "cuda"][:1]
    device = next((t.device for t in inputs), torch.device("cpu"))
    transients = [0.0, 0.0, 0.0, 0.0]  # F, B, I, W
    first = 0.0  # the stage's first B (or W): it makes the parameters' gradients, which later ones add to

    @contextlib.contextmanager
    def watched(kind: int) -> Iterator[None]:
        """The compute's peak above its start (its gradient for a parameter is whole before .grad takes it)."""
        if not allocator:
            yield
            return
        with AllocatorWatch(device) as watch:
            yield
        transients[kind] = float(watch.peak)

    try:
        for param in params:
            param.grad = None
        if allocator:  # once without gradients, as the step's first micro-batch finds them, for ``first``
            with torch.random.fork_rng(devices=devices):
                _run_stage(worker, inputs, packed, target, output, split, device, watched)
            first = transients[3] if split else transients[1]
        with torch.random.fork_rng(devices=devices), ledger.watching():
            with torch.enable_grad(), watched(0):  # the worker keeps what it keeps; nothing else holds a reference
                worker.forward(-1, inputs, packed, train=True, target=target, expected=output)
            activation = ledger.bytes([*inputs, *worker.held()])
            incoming = None
            if output is not None:  # the gradient of the output, as a received buffer
                incoming = tuple(torch.zeros(s.shape, dtype=s.dtype, device=device) for s in output.grad_specs) or None
            outputs = [storage(t)[0] for t in worker.saved[-1][1] if t.numel()]  # by storage: no reference kept
            keeps_output = keeps_input = True
            if split:
                with watched(2):
                    worker.backward_input(-1, incoming)
                held = list(worker.held())
                after_input = ledger.bytes(held)
                keeps_output = all(ledger.holds(key, held) for key in outputs)
                keeps_input = all(ledger.holds(storage(t)[0], held) for t in inputs if t.numel())
                del held
                with watched(3):
                    worker.backward_weight(-1)
            else:
                with watched(1):
                    worker.backward(-1, incoming)
                after_input = activation
    finally:
        worker.saved.pop(-1, None)
        worker.weight_passes.pop(-1, None)
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        with torch.no_grad():
            for buffer, value in zip(worker.module.buffers(), buffers, strict=True):
                buffer.copy_(value)
    return StageSizes(
        state=parameter_bytes * (2 + optimizer_copies),
        activation=float(activation),
        after_input=float(after_input),
        boundary=float(sum(_bytes(s) for s in output.specs)) if output is not None else 0.0,
        gradient=float(sum(_bytes(s) for s in output.grad_specs)) if output is not None else 0.0,
        output_after_input=keeps_output,
        input_after_input=keeps_input,
        transients=(transients[0], transients[1], transients[2], transients[3]),
        first_transient=first,
    )


def _run_stage(worker: StageWorker, inputs: Tensors, packed: bool, target: object, output: Boundary | None,
               split: bool, device: torch.device, watched: Callable[[int], Any]) -> None:  # fmt: skip
    """One forward and backward of a stage on a sample micro-batch, each compute watched."""
    with torch.enable_grad(), watched(0):
        worker.forward(-1, inputs, packed, train=True, target=target, expected=output)
    incoming = None
    if output is not None:
        incoming = tuple(torch.zeros(s.shape, dtype=s.dtype, device=device) for s in output.grad_specs) or None
    if split:
        with watched(2):
            worker.backward_input(-1, incoming)
        with watched(3):
            worker.backward_weight(-1)
    else:
        with watched(1):
            worker.backward(-1, incoming)


def optimizer_transient(optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter]) -> float:
    """The optimizer step's temporaries over ``params``: a second step of a fresh optimizer of the same kind and
    settings over copies of them (its state made by the first, as in training), watched by the allocator. It holds
    the copies meanwhile (the parameters, their gradients, the optimizer's state, once more)."""
    if optimizer is None or not params:
        return 0.0
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for copy in copies:
        copy.grad = torch.zeros_like(copy)
    probe = type(optimizer)(copies, **settings)
    probe.step()
    with AllocatorWatch(copies[0].device) as watch:
        probe.step()
    return float(watch.peak)


def _size(param: nn.Parameter) -> int:
    return local_bytes(param)  # a DTensor's shard


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield None


def _bytes(spec: object) -> int:
    shape, dtype = spec.shape, spec.dtype  # type: ignore[attr-defined]
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()
