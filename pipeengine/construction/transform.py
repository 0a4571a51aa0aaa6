"""The stage transform: the seam between cutting a stage out of the model and building its worker.

    stage_module(model, a, b) ──► transform_stage(module, stage, config, mesh) ──► StageWorker
                                    1. tensor parallel: tp_plan on mesh["tp"] (pipeengine.parallel.tensor)
                                    2. parallelize=fn: fn(stage_module, mesh) -> module, what a plan cannot say
                                    3. compile=True: torch.compile each layer (in place: the names stay)
                                    4. fsdp=True: FSDP2's fully_shard on mesh["dp"] (pipeengine.parallel.fsdp)

as torchtitan orders them (TP first; sharding, FSDP, after). The mesh is torch's DeviceMesh over the
grid (dims "dp", "pp", "tp"), built only where a transform needs one; the in-process (loopback)
ranks have no torch.distributed: they get None, and tensor parallelism and FSDP are refused there.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from pipeengine.core.compiling import compile_in_place
from pipeengine.core.config import EngineConfig
from pipeengine.parallel import fsdp, tensor

__all__ = ["compile_layers", "transform_stage"]


def transform_stage(
    module: nn.Module, stage: int, config: EngineConfig, mesh: object | None, plan: Mapping[str, object]
) -> nn.Module:
    """The stage's module as its worker runs it: tensor parallel (``plan``: resolved names), parallelize=, compiled,
    FSDP."""
    if plan:
        tensor.apply(module, mesh, plan)
    if config.parallelize is not None:
        module = _user(module, stage, config, mesh)
    if config.compile:
        options = {} if config.compile is True else dict(config.compile)
        if any(param.is_meta for param in module.parameters()):  # a dry run: dynamo's capture and AOT autograd are
            options["backend"] = "aot_eager"  # checked on meta tensors, for which inductor generates no code
        compile_layers(module, options)
    if config.fsdp:
        module = fsdp.shard_stage(module, stage, mesh, config.reshard_after_forward)
    return module


def _user(module: nn.Module, stage: int, config: EngineConfig, mesh: object | None) -> nn.Module:
    made = config.parallelize(module, mesh)  # type: ignore[misc]
    if not isinstance(made, nn.Module):
        raise TypeError(
            f"parallelize(stage_module, mesh) must return the module to run (an nn.Module); for stage {stage} it "
            f"returned {type(made).__name__}"
        )
    return made


def compile_layers(module: nn.Module, options: dict[str, object]) -> None:
    """compile=True: torch.compile each layer of the stage in place (nn.Module.compile: the names stay the model's),
    as torchtitan compiles each block: after tensor parallelism, before FSDP. A layer compiled already is left."""
    for layer in module.children():
        if getattr(layer, "_compiled_call_impl", None) is None and type(layer).__name__ != "OptimizedModule":
            compile_in_place(layer, options)
