"""Rank functions that go wrong on purpose, for test_errors.py."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

from pipeengine import PipelineEngine
from schedules import build_schedule
from tests.pipeengine import ranks
from tests.pipeengine.models import mlp, mse


class Fault(nn.Module):
    """Identity, except on one rank at its n-th call: raise, die, hang, or lie about its shape."""

    def __init__(self, rank: int, at_call: int, how: str) -> None:
        super().__init__()
        self.rank, self.at_call, self.how, self.calls = rank, at_call, how, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            return x
        if self.how == "shape":
            return x[:, :-1]  # real output narrower than the meta device said
        if ranks.rank() != self.rank:
            return x
        self.calls += 1
        if self.calls == self.at_call:
            if self.how == "raise":
                raise RuntimeError(f"planted failure in a layer on rank {self.rank}")
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "hang":
                time.sleep(3600)
        return x


def train_with_fault(rank: int, how: str, timeout: float) -> None:
    """4 ranks, 1F1B, 8 micro-batches; the Fault sits in ``rank``'s stage and strikes at its 3rd call."""
    layers = list(mlp(layers=4))  # 9 layers; with the Fault 10, split uniformly as [0,2) [2,5) [5,7) [7,10)
    at = {0: 1, 1: 3, 2: 5, 3: 8}[rank]
    model = nn.Sequential(*layers[:at], Fault(rank, 3, how), *layers[at:])
    engine = PipelineEngine(model, mse, num_microbatches=8, schedule="1f1b", partition="uniform", timeout=timeout)
    x, y = torch.randn(16, 16), torch.randn(16, 4)
    engine.train_step(x if engine.first else None, y if engine.last else None)


def construct(case: str) -> None:
    """Engines that must be refused, identically, on every rank."""
    world = ranks.size()
    if case == "not_sequential":
        PipelineEngine(nn.ModuleList([nn.Linear(2, 2)]), mse, num_microbatches=4)  # type: ignore[arg-type]
    elif case == "more_stages_than_layers":
        torch.manual_seed(0)  # in-process ranks build it one at a time (pipeengine.comm.loopback): alike everywhere
        PipelineEngine(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)), mse, num_microbatches=4)
    elif case == "interleaved_needs_more_microbatches":
        PipelineEngine(mlp(), mse, num_microbatches=world // 2, schedule="interleaved")
    elif case == "schedule_for_another_world":
        PipelineEngine(mlp(), mse, num_microbatches=4, schedule=build_schedule("1f1b", world * 2, 4))
    elif case == "partition_does_not_fit":
        PipelineEngine(mlp(), mse, num_microbatches=4, partition=[1] * (world + 1))
    elif case == "dp_does_not_divide":
        PipelineEngine(mlp(), mse, num_microbatches=4, data_parallel=3)
    else:
        raise AssertionError(case)


def refused_everywhere(cases: dict[str, tuple[str, str]], check: str) -> None:
    """Each case raises the expected error on this rank (every rank runs this: none may hang)."""
    import re

    run = construct if check == "construct" else bad_batch
    for case, (error, message) in cases.items():
        try:
            run(case)
        except Exception as raised:  # noqa: BLE001  (the type is checked below)
            assert type(raised).__name__ == error and re.search(message, str(raised)), (case, raised)
        else:
            raise AssertionError(f"{case} was accepted")
        ranks.barrier()  # every rank refused it, and none is left waiting


def bad_batch(case: str) -> None:
    """Steps that every rank must refuse together, before any transfer."""
    engine = PipelineEngine(mlp(), mse, num_microbatches=4, schedule="1f1b")
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    if case == "no_targets":
        engine.train_step(x if engine.first else None, None)
    elif case == "uneven":
        engine.train_step(torch.randn(10, 16) if engine.first else None, torch.randn(10, 4) if engine.last else None)
    elif case == "rows_disagree":
        engine.train_step(x if engine.first else None, y[:6] if engine.last else None)
    elif case == "inputs_not_tensors":
        engine.train_step([1, 2, 3] if engine.first else None, y if engine.last else None)
    elif case == "smaller_than_m":
        engine.train_step(torch.randn(2, 16) if engine.first else None, torch.randn(2, 4) if engine.last else None)
    elif case == "scalar_input":
        engine.train_step(torch.tensor(1.0) if engine.first else None, y if engine.last else None)
    else:
        raise AssertionError(case)
