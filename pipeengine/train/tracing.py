"""Traced steps: when every instruction ran on every rank, and, for a training step, the memory each rank held.

``with engine.tracing():`` (or ``trace=True``) runs each step under a Tracer (pipeengine.observe.trace) that
the stepper hands down to the executor (``with tracing.step(...) as tracer: executor.run(..., tracer)``).
A traced training step first measures each of this rank's stages once per batch shape and program
(pipeengine.step.sizes: its worker run on the step's first micro-batch under a ledger, its state from the
optimizer's; what the gradient syncs hold from their protocol, pipeengine.parallel.gradsync), then samples the
bytes held after every instruction. Rank 0 gathers one Timeline when the step ends.

    sizes (per stage)  ──► timeline.sizes     what the simulator is fed (Costs.from_timeline)
    ledger samples     ──► timeline.memory    the bytes held over the step, its peaks
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from pipeengine.comm.base import Transport
from pipeengine.core.dtensors import local_bytes
from pipeengine.core.specs import unpack
from pipeengine.observe.allocator import AllocatorWatch, training_bytes
from pipeengine.observe.ledger import Ledger, StageSizes, optimizer_copies
from pipeengine.observe.trace import RANGES_ONLY, Spans, Tracer, profiler_open, profiling
from pipeengine.step.executor import UNTRACED, Executor, StepInputs
from pipeengine.step.sizes import optimizer_transient, stage_sizes
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

    @contextlib.contextmanager
    def step(
        self, executor: Executor, program: Schedule, step: StepInputs, params: list[nn.Parameter]
    ) -> Iterator[Spans]:
        """The tracer a step runs under (every rank of the pipeline alike): none, the user's profiler's ranges, or
        ours, watching memory in a training step; the timeline gathered when the step ends."""
        profiled = profiling()  # the user's profiler records: each instruction is a range in it
        if not self.enabled:
            yield RANGES_ONLY if profiled else UNTRACED
            return
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
                stacklevel=5,
            )
        if not step.train:
            self._begin()
            yield self._tracer
        else:  # memory too: the sizes of this rank's stages, then what it holds after every instruction
            sizes = self._stage_sizes(executor, program, step, params, allocator)
            batch = [t for mb in (step.inputs or ()) for t in mb]
            batch += [t for target in (step.targets or ()) for t in unpack(target) if isinstance(t, torch.Tensor)]  # type: ignore[arg-type]
            # the parameters a sync gathers whole (FSDP) are the state's, not activations, wherever they are
            ledger = Ledger(ignore=[*params, *batch], ignore_live=executor.syncs.gathered)  # the batch is the user's
            live = training_bytes(params, self.optimizer)
            with ledger.watching(), AllocatorWatch(self._tracer.device) if allocator else _nothing() as watch:
                self._begin(ledger, sum(s.state for s in sizes.values()), sizes)
                yield self._tracer
            self._tracer.allocated = live + watch.peak if watch is not None else None
        self.timeline = self._tracer.gather(f"{program.name} measured", self._pipeline, self._num_stages)

    def _begin(
        self, ledger: Ledger | None = None, state: float = 0.0, sizes: dict[int, StageSizes] | None = None
    ) -> None:
        """Time zero, once every rank of the pipeline has set its tracing up: what a rank does first in a traced step
        (measuring its stages, starting the allocator's watch: up to seconds in a process's first) takes each rank its
        own time, and the ranks ready first would start the step alone, their work drawn ahead of the others' by as
        much. The barrier leaves them as aligned as the step's header leaves an untraced step."""
        self._pipeline.barrier("the traced step's start")
        self._tracer.begin(ledger, state, sizes)

    def _stage_sizes(
        self, executor: Executor, program: Schedule, step: StepInputs, params: list[nn.Parameter], allocator: bool
    ) -> dict[int, StageSizes]:
        """This rank's stages measured on the step's first micro-batch (once per batch shape and program)."""
        copies = optimizer_copies(self.optimizer, params)
        key = (step.first_input, tuple(step.boundaries), id(program), copies, allocator)
        sizes = self._sizes.get(key)
        if sizes is not None:
            return sizes
        sizes, seen, workers, syncs = {}, set(), executor.workers, executor.syncs
        last = self._num_stages - 1
        split = {
            op.stage
            for rank in range(program.num_ranks)
            for _, op in program.ops(rank)
            if op.kind is Kind.BACKWARD_INPUT
        }
        device = self._tracer.device
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
            with syncs.whole(worker.module):  # measured as the step runs it (FSDP: gathered); after, as it was
                sizes[s] = stage_sizes(
                    worker,
                    inputs,
                    packed,
                    step.targets[0] if s == last else None,  # type: ignore[index]
                    None if s == last else step.boundaries[s],
                    split=s in split,
                    parameter_bytes=sum(local_bytes(p) for p in mine),
                    optimizer_copies=copies,
                    allocator=allocator,
                )
            late = sum(local_bytes(p) for p in mine if p.grad is None and p.requires_grad)  # zero_grad(set_to_none)
            sizes[s] = dataclasses.replace(sizes[s], grads_late=float(late))
        if allocator and sizes:  # the optimizer steps over all of this rank's parameters at once
            first = min(sizes)
            sizes[first] = dataclasses.replace(sizes[first], optimizer=optimizer_transient(self.optimizer, params))
        held = syncs.bytes(program.instructions[executor.rank])
        for s, flat in held.flat.items():
            sizes[s] = dataclasses.replace(sizes[s], sync=flat)
        for s, whole in held.gathered.items():
            sizes[s] = dataclasses.replace(
                sizes[s],
                gathered=whole.parameters,
                gathered_grads=whole.gradients,
                reduce_held=whole.reduce_held,
                reduce_transient=whole.reduce_transient,
                gather_transient=whole.parameters,
            )
        self._tracer.tie_sync = held.ties
        self._sizes[key] = sizes
        return sizes


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield None
