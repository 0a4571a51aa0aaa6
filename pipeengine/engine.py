"""PipelineEngine: an nn.Sequential split into stages, trained with a pipeline schedule across ranks."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipeengine.assembly import Assembly, assemble
from pipeengine.checkpoint import load_checkpoint, save_checkpoint
from pipeengine.config import AUTO, DEFAULT_TIMEOUT, EngineConfig
from pipeengine.consensus import agree_on_model
from pipeengine.executor import StepInputs, StepResult
from pipeengine.header import Call, Header, agree, exchange
from pipeengine.losses import count_units
from pipeengine.memory import Ledger, StageSizes, measure_stage, optimizer_copies
from pipeengine.precision import GradScaler
from pipeengine.specs import Boundary, Tensors, infer_boundaries, unpack
from pipeengine.stage import LossFn
from pipeengine.trace import NULL_TRACER, Tracer
from pipeengine.transport import connect
from schedules import Kind, Schedule, Timeline

__all__ = ["PipelineEngine", "DEFAULT_TIMEOUT"]


class PipelineEngine:
    """Train an ``nn.Sequential`` with pipeline parallelism, one pipeline position per rank.

    Every rank builds the same model (same seed) and keeps only its stages. Inputs are read
    on the first stage's rank and targets on the last; other ranks may pass None::

        engine = PipelineEngine(model, loss_fn, num_microbatches=8, schedule="1f1b")
        loss = engine.train_step(x, y)   # the mean loss, the same float on every rank
        optimizer.step()                 # an optimizer over engine.parameters()

    Gradients equal those of one process running the whole batch with a mean-reduced loss,
    and accumulate across steps until zeroed. Parameter names are the model's own.

    ``loss_count=fn``: ``fn(target)`` is how many units (tokens) a micro-batch's target holds,
    and ``loss_fn`` returns the SUM of the loss over them. Each micro-batch's sum is divided by
    the step's total over all micro-batches and replicas before its backward, so gradients and
    the loss returned equal one process's token-mean over the whole global batch, padding and
    variable lengths included. Without it, each micro-batch's (mean) loss counts 1/m.

    A weight shared by layers of stages on different ranks (a GPT's tied embedding and output
    projection) is kept on every rank that holds one of them, its gradients summed over exactly
    those ranks after their last backward touching it: see pipeengine.ties.

    ``partition``: "uniform" (layer count), "parameters", "time" (each layer's forward and
    backward measured on one micro-batch of ``sample``, an example input batch), "memory",
    or the layers of each stage. Default "time" when the first stage's rank has a ``sample``,
    else "parameters". The first stage's rank measures, every rank solves alike, and
    ``engine.partition`` reports the result.

    ``data_parallel=d`` splits the world into d replicas of a pipeline of world/d ranks (each
    pipeline on consecutive ranks). Each replica reads its own batch; every stage's gradients
    are averaged over the replicas right after its last backward, while the rest of the step
    runs; the loss returned is the mean over all replicas. ``engine.dp_rank`` and
    ``engine.rank`` (the position in the pipeline) tell where a rank sits.

    ``checkpoint``: "always" keeps only each stage's input through the forward and recomputes
    the rest in its backward (less memory, about one more forward of compute); "except_last"
    spares the last stage, whose backward follows its forward at once; "never" (default).

    ``precision``: "bf16" or "fp16" runs each stage's forward and the loss in torch.autocast;
    floating tensors cross stages in that dtype. fp16 also scales the loss: step the optimizer
    through ``engine.scaler`` (see pipeengine.precision). None (default) is full precision.

    ``schedule="auto"`` (with ``sample=``, an input batch, on the first stage's rank): pipeengine.tune
    prices every schedule, micro-batch count (``num_microbatches``, if given, is kept), chunk count
    and partition on that rank and every rank builds the fastest that fits ``memory_limit`` (bytes
    per rank); ``engine.tuned`` is the choice.

    ``timeout``: seconds any wait of the engine on another rank may take (transfers, the step
    header, the loss, all-reduces, checkpoints) before it fails naming what it waited for.

    ``trace=True`` (or ``with engine.tracing():``) records every instruction of every step,
    and waits on communication, on every rank; ``engine.timeline()`` on rank 0 returns the
    last traced step as a schedules.Timeline (plot it, export it, simulate from it). A traced
    training step also measures memory: each stage's sizes on the step's first micro-batch
    (``timeline.sizes``, what ``Costs.from_timeline`` gives the simulator) and the bytes each
    rank held after every instruction (``timeline.memory``, ``timeline.peak_memory``), both as
    schedules.memory counts them; ``engine.last_program`` is the program that ran.

    A stage boundary whose tensors need no gradient (frozen first stages, a detached output)
    carries none: no gradient is sent across it. Set requires_grad before building the engine.
    """

    def __init__(
        self,
        model: nn.Sequential,
        loss_fn: LossFn,
        *,
        num_microbatches: int | None = None,
        schedule: str | Schedule = "1f1b",  # a registered name (schedules.SCHEDULES), a Schedule, or "auto"
        chunks: int | None = None,
        partition: str | Sequence[int] | None = None,
        sample: object = None,
        device: str | torch.device | None = None,
        group: dist.ProcessGroup | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        trace: bool = False,
        data_parallel: int = 1,
        checkpoint: str = "never",
        precision: str | None = None,
        loss_count: Callable[[object], object] | None = None,
        memory_limit: float | None = None,
    ) -> None:
        if not isinstance(model, nn.Sequential):
            raise TypeError(
                f"PipelineEngine splits an nn.Sequential into stages, got {type(model).__name__}; "
                "write the model as nn.Sequential(layer, layer, ...)"
            )
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
        self.config = EngineConfig(
            num_microbatches, schedule, chunks, partition,  # type: ignore[arg-type]  # a sequence becomes a tuple
            torch.device(device) if device is not None else None, timeout, trace, data_parallel, checkpoint, precision,
            loss_count, memory_limit,
        )  # fmt: skip
        if group is not None and data_parallel > 1:
            raise ValueError("pass either group= (your own pipeline group) or data_parallel=, not both")
        world = connect(group, self.config.device, self.config.timeout)
        agree_on_model(model, world)  # first: in-process ranks build their models one at a time until here
        self.tuned = None  # schedule="auto": the pipeengine.tune candidate every rank built
        if self.config.schedule == AUTO:
            from pipeengine.tune import choose  # here: `python -m pipeengine.tune` must find it not yet imported

            self.config, self.tuned = choose(self.config, model, loss_fn, sample, world)
        if self.config.num_microbatches is None:  # EngineConfig allows None only with "auto", which sets it
            raise ValueError("num_microbatches is required unless schedule='auto' chooses it")
        num_microbatches = self.config.num_microbatches
        self._parts: Assembly = assemble(model, loss_fn, self.config, sample, world)
        parts = self._parts
        self.topology = parts.topology
        self.group = self.topology.pipeline.group  # this pipeline's torch.distributed group (None: default)
        self.rank, self.dp_rank = self.topology.pp_rank, self.topology.dp_rank  # position in the pipeline, replica
        self.data_parallel = self.topology.data_parallel
        self.device, self.schedule, self.partition = parts.device, parts.schedule, parts.partition
        self.bounds, self.stages = parts.partition.bounds, parts.stages
        self.num_microbatches = num_microbatches
        placement = self.schedule.placement
        self.first, self.last = placement[0] == self.rank, placement[-1] == self.rank
        self._loss_fn = loss_fn
        self._summed_checked = False  # loss_count: whether loss_fn was found to return a sum (pipeengine.losses)
        self._layer_names = [name for name, _ in model.named_children()]
        self._model_keys = list(model.state_dict())  # to tell a checkpoint of another model, and its key order
        self._boundaries: dict[Boundary, list[Boundary]] = {}
        self._calls = 0  # collective calls made (train, eval, save, load, clip): the header checks all agree
        self._steps = {True: 0, False: 0}  # training and evaluation steps run, for error messages
        self._trace = trace
        self._tracer = Tracer(self.device)
        self._timeline: Timeline | None = None
        self._optimizer: torch.optim.Optimizer | None = None  # while tracing: whose state counts
        self._sizes: dict[tuple[object, ...], dict[int, StageSizes]] = {}  # measured per batch shape and program
        self.last_program: Schedule | None = None  # the streams the transport ran for the last step
        world_max = self.topology.world

        def agree_max(found: torch.Tensor) -> None:
            world_max.all_reduce(found, "the loss scaler's overflow check", op="max")

        self.scaler = GradScaler(self.parameters, precision == "fp16", self.device, agree_max)

    # ---- what an optimizer and a checkpoint see: this rank's stages, under the model's names

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's names; a tied weight once, under the model's first name."""
        seen: set[int] = set()
        names = self._parts.ties.names
        for module in self.stages.values():
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield names[id(param)], param

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, param in self.named_parameters():
            yield param

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset this rank's gradients, as nn.Module.zero_grad does (an optimizer's zero_grad does the same)."""
        for module in self.stages.values():
            module.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state under the model's names; a tied weight once, under its first name."""
        state: dict[str, torch.Tensor] = {}
        names = self._parts.ties.names
        for module in self.stages.values():
            for key, value in module.state_dict(keep_vars=True).items():
                name = names.get(id(value), key) if isinstance(value, nn.Parameter) else key
                state.setdefault(name, value.detach())
        return state

    def save(self, directory: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> Path:
        """Write a checkpoint (every rank calls it): each stage under the model's names, with the optimizer's
        state, atomically; loadable into any number of stages (see pipeengine.checkpoint)."""
        agree(Call.SAVE, self._call(), self.topology.pipeline)
        elsewhere = self._parts.ties.shared_elsewhere(self.schedule.placement, self.rank)  # another rank writes those
        names = {id(param): name for name, param in self.named_parameters() if name not in elsewhere}
        state = {key: value for key, value in self.state_dict().items() if key not in elsewhere}
        writer = self.dp_rank == 0  # the replicas are identical
        return save_checkpoint(directory, state, optimizer, names, layers=self._layer_names, keys=self._model_keys,
                               aliases=self._parts.ties.aliases, writer=writer, pipeline=self.topology.pipeline,
                               world=self.topology.world)  # fmt: skip

    def load(self, directory: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> Path:
        """Load the latest checkpoint in ``directory`` into this rank's stages (and optimizer), whatever
        partition saved it. A checkpoint of another model is refused, naming the missing and unexpected keys."""
        agree(Call.LOAD, self._call(), self.topology.pipeline)
        names = {id(param): name for name, param in self.named_parameters()}
        return load_checkpoint(directory, self.stages.values(), optimizer, names, expected=set(self._model_keys))

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients of the whole model by its total norm, as torch.nn.utils.clip_grad_norm_.

        The norm is reduced over the pipeline's stages (every rank returns the same total).
        With data parallelism the replicas hold the same averaged gradients, so it is not
        reduced over them. Call it after train_step, before optimizer.step().
        """
        agree(Call.CLIP, self._call(), self.topology.pipeline)
        norm_type = float(norm_type)
        elsewhere = self._parts.ties.shared_elsewhere(self.schedule.placement, self.rank)  # counted by their owner
        named = [(name, p.grad) for name, p in self.named_parameters() if p.grad is not None]
        grads = [grad for _, grad in named]
        counted = [grad for name, grad in named if name not in elsewhere]
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        if counted:
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type).float() for g in counted])
            local = norms.max() if norm_type == math.inf else (norms**norm_type).sum()
        reduce = "max" if norm_type == math.inf else "sum"
        self.topology.pipeline.all_reduce(local, "the gradient norms of the other stages", op=reduce)
        total = local if norm_type == math.inf else local ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it cannot "
                "be clipped; pass error_if_nonfinite=False to clip anyway"
            )
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale.to(grad.dtype))
        return total

    def train(self, mode: bool = True) -> PipelineEngine:
        """Set the training mode of this rank's stages (dropout, batch norm), as nn.Module.train."""
        for module in self.stages.values():
            module.train(mode)
        return self

    def eval(self) -> PipelineEngine:
        return self.train(False)

    # ---- tracing

    @contextlib.contextmanager
    def tracing(self, optimizer: torch.optim.Optimizer | None = None) -> Iterator[PipelineEngine]:
        """Trace the steps run inside the block (every rank must enter it). ``optimizer``: its state counts in
        the memory held all step (without it, AdamW's two copies of every parameter)."""
        previous, self._trace, self._optimizer = self._trace, True, optimizer
        try:
            yield self
        finally:
            self._trace, self._optimizer = previous, None

    def timeline(self) -> Timeline | None:
        """The last traced step on every rank, aligned on one clock (seconds): on rank 0, None elsewhere."""
        return self._timeline

    # ---- steps

    def train_step(self, inputs: object = None, targets: object = None) -> float:
        """Forward and backward over all micro-batches; returns the mean loss on every rank."""
        header = self._agree_on(Call.TRAIN, inputs, targets)
        boundaries = self._infer(header.microbatch_inputs)
        no_gradient = frozenset(b for b, boundary in enumerate(boundaries[:-1]) if not boundary.grad_specs)
        targets_split = None
        if self.last:
            targets_split = [mb if isinstance(targets, tuple) else mb[0] for mb in self._split(targets)]
        total = None
        if self.config.loss_count is not None:  # the first step also checks that loss_fn returns a sum
            check = None if self._summed_checked else (self._loss_fn, boundaries[-1])
            total = count_units(self.config.loss_count, targets_split, self.topology, self.schedule.placement[-1],
                                check)  # fmt: skip
            self._summed_checked = True
        step = StepInputs(
            True, self._steps[True], self._split(inputs) if self.first else None, targets_split,
            header.microbatch_inputs, boundaries, loss_weight=1.0 / (total or self.num_microbatches),
            loss_scale=self.scaler.scale, average_replicas=total is None,  # a global count: replicas' shares add up
        )  # fmt: skip
        result = self._run(self._parts.programs.get(True, no_gradient), step)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.last:
            losses = torch.stack([result.losses[mb] for mb in range(self.num_microbatches)]).double()
            loss = (losses.sum() / total if total is not None else losses.mean()).float()
        last = self.schedule.placement[-1]
        self.topology.pipeline.broadcast(loss, last, f"the step's loss from rank {last}")
        if self.topology.data is not None:  # every replica's share: over the global count, or the mean of the means
            self.topology.data.all_reduce(loss, "the losses of the other data-parallel replicas")
            if total is None:
                loss /= self.data_parallel
        return loss.item()

    @torch.no_grad()
    def eval_step(self, inputs: object = None) -> torch.Tensor | Tensors | None:
        """Forward only; the last stage's rank returns the outputs of the whole batch, others None."""
        header = self._agree_on(Call.EVAL, inputs, None)
        outputs = self._infer(header.microbatch_inputs)
        split = self._split(inputs) if self.first else None
        step = StepInputs(False, self._steps[False], split, None, header.microbatch_inputs, outputs)
        result = self._run(self._parts.programs.get(False), step)
        if not self.last:
            return None
        parts = [result.outputs[mb] for mb in range(self.num_microbatches)]
        joined = tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))
        return outputs[-1].pack(joined)

    # ---- helpers

    def _call(self) -> int:
        self._calls += 1
        return self._calls

    def _agree_on(self, call: Call, inputs: object, targets: object) -> Header:
        """Every rank of the pipeline learns the batch (or refuses it, together): see pipeengine.header."""
        return exchange(call, self._call(), inputs, targets, first=self.first, last=self.last,
                        num_microbatches=self.num_microbatches, transport=self.topology.pipeline)  # fmt: skip

    def _run(self, program: Schedule, step: StepInputs) -> StepResult:
        self._steps[step.train] += 1
        self.last_program = program
        if not self._trace:
            return self._parts.executor.run(program, step, NULL_TRACER)
        if not step.train:
            self._tracer.begin()
            result = self._parts.executor.run(program, step, self._tracer)
        else:  # memory too: the sizes of this rank's stages, then what it holds after every instruction
            sizes = self._measure(program, step)
            batch = [t for mb in (step.inputs or ()) for t in mb]
            batch += [t for target in (step.targets or ()) for t in unpack(target) if isinstance(t, torch.Tensor)]  # type: ignore[arg-type]
            ledger = Ledger(ignore=[*self.parameters(), *batch])  # the user's batch is theirs, not the engine's
            self._tracer.begin(ledger, sum(s.state for s in sizes.values()), sizes)
            with ledger.watching():
                result = self._parts.executor.run(program, step, self._tracer)
        self._timeline = self._tracer.gather(f"{program.name} measured", self.topology.pipeline,
                                             self.schedule.num_stages)  # fmt: skip
        return result

    def _measure(self, program: Schedule, step: StepInputs) -> dict[int, StageSizes]:
        """This rank's stages measured on the step's first micro-batch (once per batch shape and program)."""
        copies = optimizer_copies(self._optimizer, self.parameters())
        key = (step.first_input, tuple(step.outputs), id(program), copies)
        sizes = self._sizes.get(key)
        if sizes is not None:
            return sizes
        sizes, seen = {}, set()
        last = self.schedule.num_stages - 1
        split = {op.stage for rank in range(program.num_ranks) for _, op in program.ops(rank)
                 if op.kind is Kind.BACKWARD_INPUT}  # fmt: skip
        for s, worker in sorted(self._parts.workers.items()):
            params = [p for p in dict.fromkeys(worker.module.parameters()) if id(p) not in seen]
            seen |= {id(p) for p in params}  # a weight shared by two stages of this rank is held once
            if s == 0:
                inputs, packed = step.inputs[0], step.first_input.is_tuple  # type: ignore[index]
            else:
                boundary = step.outputs[s - 1]
                inputs = tuple(
                    torch.zeros(spec.shape, dtype=spec.dtype, device=self.device).requires_grad_(spec.requires_grad)
                    for spec in boundary.specs
                )  # fmt: skip  (leaves, as the executor makes them)
                packed = boundary.is_tuple
            sizes[s] = measure_stage(
                worker, inputs, packed, step.targets[0] if s == last else None,  # type: ignore[index]
                None if s == last else step.outputs[s], split=s in split,
                parameter_bytes=sum(p.numel() * p.element_size() for p in params), optimizer_copies=copies,
            )  # fmt: skip
        self._sizes[key] = sizes
        return sizes

    def _split(self, value: object) -> list[Tensors]:
        """Per micro-batch tuples of tensors, on this rank's device (the header checked the shapes)."""
        tensors = unpack(value)  # type: ignore[arg-type]
        size = tensors[0].shape[0] // self.num_microbatches
        pieces = [t.detach().to(self.device, non_blocking=True).split(size) for t in tensors]
        return [tuple(piece[mb] for piece in pieces) for mb in range(self.num_microbatches)]

    def _infer(self, inputs: Boundary) -> list[Boundary]:
        """Output boundary of every stage for this micro-batch input, cached per input signature."""
        boundaries = self._boundaries.get(inputs)
        if boundaries is None:
            boundaries = infer_boundaries(self._parts.meta_layers, self.bounds, inputs)
            if self.config.dtype is not None:  # floating tensors cross in the autocast dtype (see precision)
                boundaries = [b.in_dtype(self.config.dtype) for b in boundaries[:-1]] + boundaries[-1:]
            self._boundaries[inputs] = boundaries
        return boundaries
