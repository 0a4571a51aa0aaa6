"""EngineConfig: every option of a PipelineEngine in one frozen value, checked when it is made."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from schedules import SCHEDULES, Schedule

__all__ = [
    "AUTO",
    "CHECKPOINTING",
    "DEFAULT_TIMEOUT",
    "METHODS",
    "PRECISIONS",
    "EngineConfig",
    "check_arguments",
    "check_memory_limit",
]

METHODS = ("uniform", "parameters", "time", "memory")  # how partition= cuts a model (construction.partition)

AUTO = "auto"  # schedule="auto": pipeengine.tune chooses schedule, micro-batches, chunks and partition

DEFAULT_TIMEOUT = 120.0  # seconds a rank waits on a peer before it gives up
CHECKPOINTING = ("never", "always", "except_last")  # activation checkpointing, per stage
PRECISIONS: dict[str | None, torch.dtype | None] = {
    None: None,
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The options of PipelineEngine, by keyword; a bad value is refused with the valid ones.

    Attributes:
        num_microbatches: micro-batches a step; the batch must split into them equally (None: schedule="auto").
        schedule: "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min", "dualpipe-v", a
            `schedules.Schedule`, or "auto" (the planner chooses schedule, micro-batches, chunks and partition).
        chunks: stages per rank, for interleaved and the V schedules (default: the schedule's own).
        partition: "time", "parameters", "memory", "uniform", or the layers of each stage (default: "time" with
            PipelineEngine's `sample=`, else "parameters").
        device: where this rank computes (default: its CUDA device under NCCL, else the CPU).
        timeout: seconds any wait on another rank may take before every rank stops.
        trace: record every step (or trace chosen steps with `engine.tracing()`).
        data_parallel: replicas of the pipeline; each reads its share of the batch.
        checkpoint: "never", "always" or "except_last": recompute activations in the backward.
        precision: None or "fp32", "bf16", "fp16" (autocast; fp16 with a loss scaler, `engine.scaler`).
        loss_count: `fn(target)`, the units (tokens) in a micro-batch's target: `loss_fn` returns their sum and
            the engine divides by the step's total (a token-mean loss over padded batches).
        memory_limit: bytes per rank that schedule="auto" keeps each rank under.
        parallelize: `fn(stage_module, mesh)`, run on each stage after `tp_plan`; returns the module to run.
        tensor_parallel: ranks per stage (innermost on the grid), with `tp_plan`.
        tp_plan: fnmatch patterns over the model's module names, each to a torch `ParallelStyle`.
        fsdp: shard weights, gradients and optimizer state over the replicas (FSDP2; data_parallel > 1).
        reshard_after_forward: with fsdp, free the gathered weights after each forward and gather them again.
        compile: torch.compile each layer of every stage (True, or torch.compile's keywords).
    """

    num_microbatches: int | None = None  # None: chosen by schedule="auto"
    schedule: str | Schedule = "1f1b"
    chunks: int | None = None
    partition: str | tuple[int, ...] | None = None
    device: torch.device | None = None
    timeout: float = DEFAULT_TIMEOUT
    trace: bool = False
    data_parallel: int = 1
    checkpoint: str = "never"
    precision: str | None = None
    loss_count: Callable[[object], object] | None = None  # units (tokens) in a micro-batch's target: a summed loss
    memory_limit: float | None = None  # bytes per rank that schedule="auto" keeps under
    parallelize: Callable[..., object] | None = None  # fn(stage_module, mesh) -> module, per stage (construction)
    tensor_parallel: int = 1  # ranks per stage, innermost on the grid (core.grid)
    tp_plan: Mapping[str, object] | None = None  # fnmatch pattern over the model's module names -> a ParallelStyle
    fsdp: bool = False  # FSDP2 over the data-parallel replicas: each holds 1/dp of weights, gradients, optimizer state
    reshard_after_forward: bool = False  # fsdp: free the gathered weights after each forward (gather again in B)
    compile: bool | Mapping[str, object] = False  # torch.compile each layer of every stage (True, or its keywords)

    def __post_init__(self) -> None:
        if self.num_microbatches is not None or self.schedule != AUTO:
            _positive_int("num_microbatches", self.num_microbatches)
        if isinstance(self.schedule, str):
            if self.schedule not in SCHEDULES and self.schedule != AUTO:
                raise ValueError(
                    f"unknown schedule {self.schedule!r}; valid names: {', '.join(SCHEDULES)}, or 'auto' (tuned)"
                )
        elif not isinstance(self.schedule, Schedule):
            raise TypeError(f"schedule must be a name or a schedules.Schedule, got {type(self.schedule).__name__}")
        if self.chunks is not None:
            _positive_int("chunks", self.chunks)
            if isinstance(self.schedule, Schedule) and self.chunks != self.schedule.chunks:
                raise ValueError(
                    f"chunks={self.chunks}, but the schedule given runs {self.schedule.chunks} chunk(s) per rank: "
                    "a Schedule fixes its own chunks; leave chunks= out"
                )
        if isinstance(self.partition, str):
            if self.partition not in METHODS:
                raise ValueError(
                    f"unknown partition method {self.partition!r}; valid: {', '.join(METHODS)}, "
                    "or a list of layers per stage"
                )
        elif self.partition is not None:
            if isinstance(self.partition, (bytes, dict)) or not isinstance(self.partition, Sequence):
                raise TypeError(f"partition must be a method name or the layers of each stage, got {self.partition!r}")
            object.__setattr__(self, "partition", tuple(self.partition))
            for count in self.partition:
                _positive_int("each stage's layer count in partition", count)
        if self.device is not None:
            object.__setattr__(self, "device", torch.device(self.device))
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        _positive_int("data_parallel", self.data_parallel)
        if self.checkpoint not in CHECKPOINTING:
            raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINTING)}, got {self.checkpoint!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(map(str, PRECISIONS))}, got {self.precision!r}")
        check_memory_limit(self.memory_limit)
        if self.memory_limit is not None and self.schedule != AUTO:
            raise ValueError(
                f"memory_limit= is the bound schedule='auto' plans under; with schedule={_shown(self.schedule)} "
                "nothing reads it: use schedule='auto' (with sample=) to choose under it, or leave memory_limit out"
            )
        _positive_int("tensor_parallel", self.tensor_parallel)
        self._check_tensor_parallel()
        self._check_fsdp()
        if not isinstance(self.compile, bool | Mapping):
            raise TypeError(
                "compile must be True, False or the keywords of torch.compile (e.g. {'backend': 'aot_eager', "
                f"'fullgraph': True}}), got {type(self.compile).__name__}"
            )
        if self.parallelize is not None and not callable(self.parallelize):
            raise TypeError(
                "parallelize must be callable as parallelize(stage_module, mesh) -> module, got "
                f"{type(self.parallelize).__name__}"
            )
        if self.loss_count is not None and not callable(self.loss_count):
            raise TypeError(
                "loss_count must be callable as loss_count(target) -> the number of units (e.g. tokens) the "
                f"micro-batch's target holds, got {type(self.loss_count).__name__}"
            )

    def _check_tensor_parallel(self) -> None:
        if self.tp_plan is not None:
            from torch.distributed.tensor.parallel import ParallelStyle

            if not isinstance(self.tp_plan, Mapping) or not self.tp_plan:
                raise TypeError(
                    "tp_plan must map fnmatch patterns of module names to ParallelStyles, e.g. "
                    "{'*.mlp.0': ColwiseParallel(), '*.mlp.2': RowwiseParallel()}"
                )
            for pattern, style in self.tp_plan.items():
                if not isinstance(pattern, str) or not isinstance(style, ParallelStyle):
                    raise TypeError(
                        f"tp_plan maps a pattern (str) to a torch ParallelStyle (ColwiseParallel(), "
                        f"RowwiseParallel(), ...); got {pattern!r}: {type(style).__name__}"
                    )
            if self.tensor_parallel == 1:
                raise ValueError(
                    "tp_plan= shards layers over tensor_parallel ranks, but tensor_parallel=1: nothing "
                    "reads it; pass tensor_parallel=2 (or more), or leave tp_plan out"
                )
        if self.tensor_parallel > 1 and self.tp_plan is None and self.parallelize is None:
            raise ValueError(
                f"tensor_parallel={self.tensor_parallel} with neither tp_plan= nor parallelize=: no layer would be "
                "parallelized, every rank of a stage would compute the same; pass tp_plan={pattern: ParallelStyle}"
            )

    def _check_fsdp(self) -> None:
        for name in ("fsdp", "reshard_after_forward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.fsdp and self.data_parallel < 2:
            raise ValueError(
                f"fsdp=True shards each stage's weights, gradients and optimizer state over the data-parallel "
                f"replicas, but data_parallel={self.data_parallel}: there is nothing to shard over; pass "
                "data_parallel=2 (or more), or leave fsdp out"
            )
        if self.reshard_after_forward and not self.fsdp:
            raise ValueError(
                "reshard_after_forward=True frees FSDP's gathered weights after each forward; without "
                "fsdp=True nothing is gathered: pass fsdp=True, or leave it out"
            )

    def shared(self) -> dict[str, tuple[object, str]]:
        """The options every rank must pass alike, as consensus.agree_on_model compares them across the world: each
        as (what is compared, how it is shown). They shape the program each rank runs (the schedule, its
        micro-batches and chunks, the cut, the layout, what a step exchanges); a difference would hang, abort or
        train wrongly. Each rank's own: device, timeout, sample (read on the first stage's rank), compile (a
        rank's local kernels). A function (loss_count, parallelize) is compared by whether it is given."""
        schedule = self.schedule
        if isinstance(schedule, Schedule):  # a user's schedule: by its streams
            digest = hashlib.sha256(repr(schedule).encode()).hexdigest()[:12]
            shown_schedule: tuple[object, str] = (digest, f"a Schedule ({schedule.describe()}; streams {digest})")
        else:
            shown_schedule = (schedule, repr(schedule))
        plan = None if self.tp_plan is None else {k: type(v).__name__ for k, v in sorted(self.tp_plan.items())}
        styles = None if plan is None else tuple(plan.items())
        precision = self.precision or "fp32"  # None and "fp32" run alike

        def plain(value: object) -> tuple[object, str]:
            return value, repr(value)

        def given(fn: Callable[..., object] | None) -> tuple[object, str]:
            return fn is not None, "None" if fn is None else getattr(fn, "__qualname__", type(fn).__name__)

        return {
            "schedule": shown_schedule,
            "num_microbatches": plain(self.num_microbatches),
            "chunks": plain(self.chunks),
            "partition": plain(self.partition),
            "data_parallel": plain(self.data_parallel),
            "tensor_parallel": plain(self.tensor_parallel),
            "tp_plan": (styles, repr(plan)),
            "parallelize": given(self.parallelize),
            "fsdp": plain(self.fsdp),
            "reshard_after_forward": plain(self.reshard_after_forward),
            "checkpoint": plain(self.checkpoint),
            "precision": plain(precision),
            "loss_count": given(self.loss_count),
            "trace": plain(self.trace),
            "memory_limit": plain(self.memory_limit),
        }

    @property
    def needs_mesh(self) -> bool:
        """Whether the stages are transformed on torch's DeviceMesh (construction.transform)."""
        return self.parallelize is not None or self.tensor_parallel > 1 or self.fsdp

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype, or None in full precision."""
        return PRECISIONS[self.precision]

    def checkpointed(self, stage: int, num_stages: int) -> bool:
        """Whether a stage recomputes its activations in backward."""
        return self.checkpoint == "always" or (self.checkpoint == "except_last" and stage != num_stages - 1)


def _shown(schedule: str | Schedule) -> str:
    return repr(schedule) if isinstance(schedule, str) else f"a Schedule ({schedule.name})"


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_arguments(model: object, loss_fn: object, group: object, data_parallel: int) -> None:
    """What PipelineEngine refuses before any option: a model that is not an nn.Sequential, a loss that cannot be
    called, and a pipeline group of the user's together with data parallelism."""
    from torch import nn

    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"PipelineEngine splits an nn.Sequential into stages, got {type(model).__name__}; "
            "write the model as nn.Sequential(layer, layer, ...)"
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
    if group is not None and data_parallel > 1:
        raise ValueError("pass either group= (your own pipeline group) or data_parallel=, not both")


def check_memory_limit(value: object) -> None:
    """A memory limit is None (no limit) or a positive number of bytes per rank (the engine's and tune's)."""
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(
            f"memory_limit must be a positive number of bytes per rank (or None: no limit), got "
            f"{value!r}; for '64MiB' write 64 * 2**20"
        )
