"""schedule="auto": the planner's choice (pipeengine.planner.search), reached from the engine alone.

The planner sits above construction, imported by nothing below it, and ``import pipeengine`` loads none of it: the
engine asks it here, and only for schedule="auto" (tests/test_layout.py holds it to this)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from pipeengine.comm.base import Transport
from pipeengine.core.config import AUTO, EngineConfig
from pipeengine.step.stage import LossFn

__all__: list[str] = []


def resolve_auto(
    config: EngineConfig,
    model: nn.Sequential,
    loss_fn: LossFn,
    sample: object,
    world: Transport,
    engine: Callable[..., object],
) -> tuple[EngineConfig, object | None]:
    """schedule="auto": the planner's choice (pipeengine.planner.search), the same on every rank, and the candidate it
    built; any other schedule as it is, and None. ``engine``: the engine's class (the planner's calibration runs
    it where this machine's prices are not kept)."""
    if config.schedule != AUTO:
        return config, None
    if world.alone:
        raise ValueError(
            "schedule='auto' measures the layers and this machine to choose a layout, and a dry run "
            "(pipeengine.dry_run) computes nothing: dry-run the layout auto chooses, its row of "
            "python -m pipeengine.tune (candidate.engine_kwargs()), or a schedule of your own"
        )
    from pipeengine.planner.search import choose  # here: `import pipeengine` and `python -m pipeengine.tune` must
    # find the planner not yet imported

    return choose(config, model, loss_fn, sample, world, engine)
