"""PipelineEngine: an nn.Sequential split into stages, trained with a pipeline schedule across ranks."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipeengine.assembly import agree_partition, check_no_shared_parameters, resolve_device, resolve_schedule
from pipeengine.checkpoint import load_checkpoint, save_checkpoint
from pipeengine.comm import P2P, second_group
from pipeengine.errors import PeerError
from pipeengine.executor import Executor, Step
from pipeengine.header import Header, exchange
from pipeengine.partition import stage_module
from pipeengine.precision import PRECISIONS, GradScaler
from pipeengine.specs import Boundary, Tensors, infer_boundaries, meta_copy, unpack
from pipeengine.stage import LossFn, StageWorker
from pipeengine.streams import Streams
from pipeengine.topology import Topology
from pipeengine.trace import Tracer
from schedules import Schedule, Timeline, forward_only, receives_first, with_gradient_sync

__all__ = ["PipelineEngine", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 120.0  # seconds a rank waits on a peer before it gives up
CHECKPOINTING = ("never", "always", "except_last")  # activation checkpointing, per stage


class PipelineEngine:
    """Train an ``nn.Sequential`` with pipeline parallelism, one pipeline position per rank.

    Every rank builds the same model (same seed) and keeps only its stages. Inputs are read
    on the first stage's rank and targets on the last; other ranks may pass None::

        engine = PipelineEngine(model, loss_fn, num_microbatches=8, schedule="1f1b")
        loss = engine.train_step(x, y)   # the mean loss, the same float on every rank
        optimizer.step()                 # an optimizer over engine.parameters()

    Gradients equal those of one process running the whole batch with a mean-reduced loss,
    and accumulate across steps until zeroed. Parameter names are the model's own.

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

    ``trace=True`` (or ``with engine.tracing():``) records every instruction of every step,
    and waits on communication, on every rank; ``engine.timeline()`` on rank 0 returns the
    last traced step as a schedules.Timeline (plot it, export it, simulate from it).
    """

    def __init__(
        self,
        model: nn.Sequential,
        loss_fn: LossFn,
        *,
        num_microbatches: int,
        schedule: str | Schedule = "1f1b",  # "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", or a Schedule
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
    ) -> None:
        if not isinstance(model, nn.Sequential):
            raise TypeError(
                f"PipelineEngine splits an nn.Sequential into stages, got {type(model).__name__}; "
                "write the model as nn.Sequential(layer, layer, ...)"
            )
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: start the ranks with pipeengine.launch(fn, nprocs=N) "
                "or torchrun (and call torch.distributed.init_process_group)"
            )
        self.topology = Topology.build(data_parallel, group)
        self.group = self.topology.pipeline_group  # this replica's pipeline
        self.rank = self.topology.pp_rank  # the position in it
        self.dp_rank, self.data_parallel = self.topology.dp_rank, self.topology.data_parallel
        world = self.topology.pipeline
        self.device = resolve_device(device, group)
        self.timeout = timeout
        self.schedule = resolve_schedule(schedule, world, num_microbatches, chunks)
        if self.data_parallel > 1:  # average each stage's gradients over the replicas, in the stream
            self.schedule = with_gradient_sync(self.schedule)
        self.num_microbatches = num_microbatches
        num_stages = self.schedule.num_stages
        # every replica must cut the model alike: the whole world agrees when there are several
        agreeing = None if self.data_parallel > 1 else self.group
        self.partition = agree_partition(model, self.schedule, partition, sample, agreeing, self.device)
        self.bounds = self.partition.bounds
        check_no_shared_parameters(model, self.bounds, self.schedule.placement)

        placement = self.schedule.placement
        self.first, self.last = placement[0] == self.rank, placement[-1] == self.rank
        self._layer_names = [name for name, _ in model.named_children()]
        self._model_keys = set(model.state_dict())  # to tell a checkpoint of another model
        self.stages = {
            s: stage_module(model, *self.bounds[s]).to(self.device) for s in self.schedule.stages_of(self.rank)
        }
        self._meta_layers = [meta_copy(layer) for layer in model]  # every rank infers every boundary locally
        runs = (self.schedule, forward_only(self.schedule))
        gloo = dist.get_backend(self.group) == "gloo"
        if gloo:  # posting never blocks there: each step's recvs go out first
            runs = (receives_first(runs[0]), receives_first(runs[1]))
        self._train_run, self._forward_run = runs  # what the executor runs
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(map(str, PRECISIONS))}, got {precision!r}")
        self.precision = PRECISIONS[precision]
        self.scaler = GradScaler(self.parameters, precision == "fp16", self.device)
        if checkpoint not in CHECKPOINTING:
            raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINTING)}, got {checkpoint!r}")
        self._workers = {
            s: StageWorker(
                s, module, is_last=s == num_stages - 1, loss_fn=loss_fn, num_microbatches=num_microbatches,
                checkpointed=checkpoint == "always" or (checkpoint == "except_last" and s != num_stages - 1),
                precision=self.precision,
            )
            for s, module in self.stages.items()
        }  # fmt: skip
        down = second_group(self.group) if gloo and world > 1 else None  # see pipeengine.comm
        p2p = P2P(self.group, Streams(self.device, timeout), down)
        self._executor = Executor(self.rank, self._workers, p2p, self.device, self.topology.data_group)
        self._boundaries: dict[Boundary, list[Boundary]] = {}
        self._trace = trace
        self._tracer = Tracer(self.device)
        self._timeline: Timeline | None = None

    # ---- what an optimizer and a checkpoint see: this rank's stages, under the model's names

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        seen: set[int] = set()  # a weight tied between two stages of this rank is listed once, as nn.Module does
        for module in self.stages.values():
            for name, param in module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, param in self.named_parameters():
            yield param

    def state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for module in self.stages.values():
            state.update(module.state_dict())
        return state

    def save(self, directory: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> Path:
        """Write a checkpoint (every rank calls it): each stage under the model's names, with the optimizer's
        state, atomically; loadable into any number of stages (see pipeengine.checkpoint)."""
        names = {id(param): name for name, param in self.named_parameters()}
        writer = self.dp_rank == 0  # the replicas are identical
        return save_checkpoint(directory, self.state_dict(), optimizer, names, layers=self._layer_names,
                               writer=writer, pipeline=self.group)  # fmt: skip

    def load(self, directory: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> Path:
        """Load the latest checkpoint in ``directory`` into this rank's stages (and optimizer), whatever
        partition saved it. A checkpoint of another model is refused, naming the missing and unexpected keys."""
        names = {id(param): name for name, param in self.named_parameters()}
        return load_checkpoint(directory, self.stages.values(), optimizer, names, expected=self._model_keys)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients of the whole model by its total norm, as torch.nn.utils.clip_grad_norm_.

        The norm is reduced over the pipeline's stages (every rank returns the same total).
        With data parallelism the replicas hold the same averaged gradients, so it is not
        reduced over them. Call it after train_step, before optimizer.step().
        """
        norm_type = float(norm_type)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type).float() for g in grads])
            local = norms.max() if norm_type == math.inf else (norms**norm_type).sum()
        reduce = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(local, op=reduce, group=self.group)
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
    def tracing(self) -> Iterator[PipelineEngine]:
        """Trace the steps run inside the block (every rank must enter it)."""
        previous, self._trace = self._trace, True
        try:
            yield self
        finally:
            self._trace = previous

    def timeline(self) -> Timeline | None:
        """The last traced step on every rank, aligned on one clock (seconds): on rank 0, None elsewhere."""
        return self._timeline

    def _traced(self, schedule: Schedule, step: Step) -> dict[int, Tensors]:
        tracer = self._tracer if self._trace else None
        if tracer:
            tracer.begin()
        results = self._executor.run(schedule, step, tracer)
        if tracer:
            label = f"{schedule.name} measured"
            self._timeline = tracer.gather(schedule.num_ranks, label, self.group)
        return results

    # ---- steps

    def train_step(self, inputs: object = None, targets: object = None) -> float:
        """Forward and backward over all micro-batches; returns the mean loss on every rank."""
        header = self._agree_on(inputs, targets, train=True)
        step = Step(
            train=True,
            inputs=self._split(inputs) if self.first else None,
            targets=[mb if isinstance(targets, tuple) else mb[0] for mb in self._split(targets)] if self.last else None,
            first_input=header.microbatch_inputs,
            outputs=self._infer(header.microbatch_inputs),
        )
        self._traced(self._train_run, step)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.last:
            worker = self._workers[self.schedule.num_stages - 1]
            loss = torch.stack([worker.losses.pop(mb) for mb in range(self.num_microbatches)]).float().mean()
        last = self.schedule.placement[-1]
        try:
            dist.broadcast(loss, group_src=last, group=self.group)
            if self.data_parallel > 1:  # the mean over every replica's batch
                dist.all_reduce(loss, group=self.topology.data_group)
                loss /= self.data_parallel
        except Exception as error:
            raise PeerError(f"rank {self.rank}: waiting for the loss from rank {last} failed: {error}") from error
        return loss.item()

    @torch.no_grad()
    def eval_step(self, inputs: object = None) -> torch.Tensor | Tensors | None:
        """Forward only; the last stage's rank returns the outputs of the whole batch, others None."""
        header = self._agree_on(inputs, None, train=False)
        outputs = self._infer(header.microbatch_inputs)
        step = Step(False, self._split(inputs) if self.first else None, None, header.microbatch_inputs, outputs)
        results = self._traced(self._forward_run, step)
        if not self.last:
            return None
        parts = [results[mb] for mb in range(self.num_microbatches)]
        joined = tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))
        return outputs[-1].pack(joined)

    # ---- helpers

    def _agree_on(self, inputs: object, targets: object, train: bool) -> Header:
        """Every rank of the pipeline learns the batch (or refuses it, together): see pipeengine.header."""
        return exchange(inputs, targets, first=self.first, last=self.last, train=train,
                        num_microbatches=self.num_microbatches, group=self.group, device=self.device)  # fmt: skip

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
            boundaries = infer_boundaries(self._meta_layers, self.bounds, inputs)
            if self.precision is not None:  # floating tensors cross in the autocast dtype (see precision)
                boundaries = [b.in_dtype(self.precision) for b in boundaries[:-1]] + boundaries[-1:]
            self._boundaries[inputs] = boundaries
        for s, worker in self._workers.items():
            worker.output = boundaries[s] if s < self.schedule.num_stages - 1 else None
            worker.loss_scale = self.scaler.scale
        return boundaries
