"""PipelineEngine: the facade. It reads as a table of contents; each job is done by the module that owns it."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeengine.auto import resolve_auto
from pipeengine.comm.calls import Call, Calls
from pipeengine.comm.connect import connect
from pipeengine.comm.consensus import agree_on_model
from pipeengine.construction.assembly import Assembly, assemble
from pipeengine.core.config import DEFAULT_TIMEOUT, EngineConfig, check_arguments
from pipeengine.core.specs import Tensors
from pipeengine.step.precision import GradScaler
from pipeengine.step.stage import LossFn
from pipeengine.step.stepping import StageLayers, Stepper
from pipeengine.train.checkpoint import Checkpoints
from pipeengine.train.extras import Loaded
from pipeengine.train.parameters import Parameters
from pipeengine.train.tracing import Tracing
from schedules import Schedule, Timeline

__all__ = ["PipelineEngine", "DEFAULT_TIMEOUT"]


class PipelineEngine:
    """Train an ``nn.Sequential`` with pipeline parallelism, one pipeline position per rank (docs/: the guides).

    Every rank builds the same model (checked: pipeengine.comm.consensus) and keeps only its stages::

        engine = PipelineEngine(model, loss_fn, num_microbatches=8, schedule="1f1b")
        loss = engine.train_step(x, y)   # inputs on the first stage's rank, targets on the last; the mean loss
        optimizer.step()                 # an optimizer over engine.parameters() (the model's own names)

    Gradients equal one process's on the whole batch. The options are keywords, each described where it is checked
    (pipeengine.core.config.EngineConfig); what builds this rank's part is pipeengine.construction.assembly, what
    runs a step pipeengine.step.stepping, and each parallelism lives in pipeengine.parallel. ``engine.mesh`` is
    torch's DeviceMesh where a stage transform needed one.
    """

    def __init__(
        self,
        model: nn.Sequential,
        loss_fn: LossFn,
        *,
        num_microbatches: int | None = None,
        schedule: str | Schedule = "1f1b",
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
        parallelize: Callable[[nn.Module, object], nn.Module] | None = None,
        tensor_parallel: int = 1,
        tp_plan: Mapping[str, object] | None = None,
        fsdp: bool = False,
        reshard_after_forward: bool = False,
        compile: bool | Mapping[str, object] = False,
    ) -> None:
        check_arguments(model, loss_fn, group, data_parallel)
        self.config = EngineConfig(
            num_microbatches=num_microbatches,
            schedule=schedule,
            chunks=chunks,
            partition=partition,  # type: ignore[arg-type]
            device=torch.device(device) if device is not None else None,
            timeout=timeout,
            trace=trace,
            data_parallel=data_parallel,
            checkpoint=checkpoint,
            precision=precision,
            loss_count=loss_count,
            memory_limit=memory_limit,
            parallelize=parallelize,
            tensor_parallel=tensor_parallel,
            tp_plan=tp_plan,
            fsdp=fsdp,
            reshard_after_forward=reshard_after_forward,
            compile=compile,
        )
        world = connect(group, self.config.device, self.config.timeout)
        # first: in-process ranks build their models one at a time until here; the options every rank must share
        agree_on_model(model, world, self.config.shared())
        self.config, self.tuned = resolve_auto(self.config, model, loss_fn, sample, world, type(self))  # "auto"
        parts: Assembly = assemble(model, loss_fn, self.config, sample, world)
        self._expose(parts)
        self._params = Parameters(parts.stages, parts.ties, self.schedule.placement, self.pp_rank, self.pipeline)
        self._checkpoints = Checkpoints(model, self._params, self.topology, self.config.fsdp)
        self._calls = Calls(self.pipeline, self.topology.world, self.topology.grid.groups("pp"))
        self._tracing = Tracing(trace, self.device, self.pipeline, self.schedule.num_stages)
        layers = StageLayers(parts.stages, parts.meta_layers, self.bounds, self.schedule.placement)
        self._stepper = Stepper(
            parts.executor,
            parts.programs,
            self.topology,
            layers,
            self.config,
            loss_fn,
            self._calls,
            self._tracing,
            lambda: list(self.parameters()),
        )
        self.num_microbatches = self._stepper.num_microbatches
        self.first, self.last = self._stepper.first, self._stepper.last  # it runs the first (last) stage
        agree_max = functools.partial(self.topology.world.all_reduce, what="the loss scaler's overflow check", op="max")
        self.scaler = GradScaler(self.parameters, precision == "fp16", self.device, agree_max)
        world.built(self)  # a dry run's report (pipeengine.launcher.dry); nothing elsewhere

    def _expose(self, parts: Assembly) -> None:
        """What the engine shows of what this rank runs: its place on the grid, its stages, the schedule."""
        self.topology = parts.topology
        self.device = parts.device
        self.schedule = parts.schedule
        self.partition = parts.partition
        self.bounds = parts.partition.bounds
        self.stages = parts.stages
        self.pipeline = self.topology.pipeline
        self.group = self.pipeline.group  # this pipeline's torch.distributed group (None: the default group)
        self.pp_rank = self.topology.pp_rank
        self.dp_rank = self.topology.dp_rank
        self.tp_rank = self.topology.tp_rank
        self.data_parallel = self.topology.grid.dp
        self.mesh = parts.mesh  # torch's DeviceMesh ("dp", "pp", "tp"), or None

    @property
    def rank(self) -> int:
        """This rank's position in its pipeline (pp_rank), not its world rank."""
        return self.pp_rank

    @property
    def last_program(self) -> Schedule | None:
        """The streams the transport ran for the last step."""
        return self._stepper.last_program

    # ---- steps (pipeengine.step.stepping)

    def train_step(self, inputs: object = None, targets: object = None) -> float:
        """Forward and backward over all micro-batches; returns the mean loss on every rank."""
        return self._stepper.train(inputs, targets, self.scaler.scale)

    @torch.no_grad()
    def eval_step(self, inputs: object = None) -> torch.Tensor | Tensors | None:
        """Forward only; the last stage's rank returns the outputs of the whole batch, others None."""
        return self._stepper.eval(inputs)

    # ---- what an optimizer, clipping and a checkpoint see (pipeengine.train.parameters)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's names; a tied weight once, under the model's first name."""
        return self._params.named()

    def parameters(self) -> Iterator[nn.Parameter]:
        return (param for _, param in self._params.named())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state under the model's names; a tied weight once, under its first name."""
        return self._params.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset this rank's gradients, as nn.Module.zero_grad does (an optimizer's zero_grad does the same)."""
        self._params.zero_grad(set_to_none)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip every gradient by the model's total norm, as torch.nn.utils.clip_grad_norm_ (after train_step)."""
        self._calls.agree(Call.CLIP)
        return self._params.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def save(
        self,
        directory: str | os.PathLike[str],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        background: bool = False,
        keep: int | None = 1,
        **extra: Any,
    ) -> Path | Future[Path]:
        """Checkpoint this rank's part, optimizer, generators, ``extra``; ``keep``: how many stay (train.checkpoint)."""
        self._calls.agree(Call.SAVE_BACKGROUND if background else Call.SAVE)
        return self._checkpoints.save(directory, optimizer, extra, background, keep)

    def load(
        self, directory: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None, **extra: Any
    ) -> Loaded:
        """Load the latest checkpoint, saved in any layout, and each ``extra``: the plain values saved (a dict)."""
        self._calls.agree(Call.LOAD)
        return self._checkpoints.load(directory, optimizer, extra)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict (CPU, the model's keys and order, ties under each name) on world rank 0."""
        self._calls.agree(Call.EXPORT)
        return self._checkpoints.full_state()

    def train(self, mode: bool = True) -> PipelineEngine:
        """Set the training mode of this rank's stages (dropout, batch norm), as nn.Module.train."""
        for module in self.stages.values():
            module.train(mode)
        return self

    def eval(self) -> PipelineEngine:
        return self.train(False)

    # ---- tracing (pipeengine.train.tracing)

    @contextlib.contextmanager
    def tracing(self, optimizer: torch.optim.Optimizer | None = None) -> Iterator[PipelineEngine]:
        """Trace the steps run inside the block (every rank enters it); ``optimizer``: whose state counts."""
        with self._tracing.on(optimizer):
            yield self

    def timeline(self) -> Timeline | None:
        """The last traced step of this pipeline's ranks on one clock (seconds): on its pp_rank 0, else None."""
        return self._tracing.timeline
