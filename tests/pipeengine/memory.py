"""Memory helpers shared by the tests that trace a step: a model whose activations dominate, the simulator fed what
the ledger counts, and one traced step of it whose measured and predicted peaks rank 0 saves."""

from __future__ import annotations

import dataclasses
import pickle

import torch
from torch import nn

from pipeengine import PipelineEngine
from schedules import Costs, Timeline, simulate
from tests.pipeengine import ranks
from tests.pipeengine.models import SEEDED


def activation_heavy() -> nn.Sequential:
    """8 Linear(16)+Tanh blocks: 1 KB of weights each, 16 KB per tensor of a 256-row micro-batch."""
    with SEEDED:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)])


def weight_heavy() -> nn.Sequential:
    """8 Linear(128, 128) layers: 64 KiB of weights each, 4 KiB per tensor of an 8-row micro-batch."""
    with SEEDED:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])


def ledger_costs(timeline: Timeline) -> Costs:
    """The simulator fed what the ledger counts: the sizes between computes (the allocator's transients left out)."""
    costs = Costs.from_timeline(timeline)
    assert costs.memory is not None
    return dataclasses.replace(costs, memory=costs.memory.without_transients())


def traced_peak(schedule: str, checkpoint: str, path: str) -> None:
    """One traced step of activation_heavy (after a step and an SGD step: momentum exists); rank 0 pickles the
    measured peaks, the simulator's fed the ledger's sizes, the state, the allocator's peaks and the simulator's fed
    the computes' transients as well."""
    m = 8
    engine = PipelineEngine(
        activation_heavy(),
        nn.functional.mse_loss,
        num_microbatches=m,
        schedule=schedule,
        checkpoint=checkpoint,
        partition="uniform",
    )
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(256 * m, 16, generator=generator), torch.randn(256 * m, 16, generator=generator)
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    optimizer.step()  # now it has a momentum buffer: one copy of each parameter
    with engine.tracing(optimizer):
        engine.train_step(x if engine.first else None, y if engine.last else None)
    timeline = engine.timeline()
    if ranks.rank() == 0:
        assert timeline is not None and timeline.memory is not None and timeline.sizes is not None
        predicted = simulate(engine.last_program, ledger_costs(timeline))  # type: ignore[arg-type]
        full = simulate(engine.last_program, Costs.from_timeline(timeline))  # type: ignore[arg-type]  # transients too
        state = timeline.sizes.state
        with open(path, "wb") as out:
            pickle.dump(
                (timeline.peak_memory, predicted.peak_memory, state, timeline.allocated_peak, full.peak_memory), out
            )


def step_then_trace(engine: PipelineEngine, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """One step and an optimizer step (its state exists), gradients set to None, then one traced step."""
    engine.train_step(x if engine.first else None, y if engine.last else None)
    optimizer.step()
    optimizer.zero_grad()
    with engine.tracing(optimizer):
        engine.train_step(x if engine.first else None, y if engine.last else None)
