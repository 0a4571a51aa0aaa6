"""Rank functions for test_reliability.py: frozen stages, ranks that die or hang between steps, mismatched calls."""

from __future__ import annotations

import copy
import itertools
import os
import time
from pathlib import Path

import torch
from torch import nn

from pipeengine import PipelineEngine
from tests.pipeengine import ranks
from tests.pipeengine.models import SEEDED, mlp, mse
from tests.pipeengine.workers import close, step_both


class Detach(nn.Module):
    """Passes its input on without its gradient: the stages before it learn nothing from the loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


def frozen_model(how: str, num_stages: int) -> tuple[nn.Sequential, list[int]]:
    """An MLP of one Linear+Tanh pair per stage (and a head); the first half of the stages frozen or cut off."""
    with SEEDED:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(num_stages):
            layers += [nn.Linear(16, 16), nn.Tanh()]
        layers.append(nn.Linear(16, 4))
    cut = max(1, num_stages // 2)  # stages [0, cut) need no gradient
    if how == "frozen":
        for layer in layers[: 2 * cut]:
            layer.requires_grad_(False)
    elif how == "detached":
        layers.insert(2 * cut, Detach())  # the last layer of stage cut-1
    counts = [2] * num_stages
    counts[-1] += 1  # the head
    if how == "detached":
        counts[cut - 1] += 1
    return nn.Sequential(*layers), counts


def frozen_parity(schedule: str, how: str, steps: int = 3) -> None:
    """Stages that need no gradient train like one process: the others match it, theirs get no gradient."""
    world = ranks.size()
    chunks = 2 if schedule in ("interleaved", "zb-v") else 1
    model, counts = frozen_model(how, world * chunks)
    reference = copy.deepcopy(model)
    m = 2 * world
    engine = PipelineEngine(model, mse, num_microbatches=m, schedule=schedule, chunks=chunks, partition=counts)
    trainable = [p for p in engine.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2) if trainable else None
    reference_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    expected = dict(reference.named_parameters())
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * m, 16, generator=generator), torch.randn(2 * m, 4, generator=generator)
        loss = engine.train_step(x if engine.first else None, y if engine.last else None)
        want = mse(reference(x), y)
        want.backward()
        close(loss, want.item(), f"{schedule} {how} step {step}: loss")
        for name, param in engine.named_parameters():
            if expected[name].grad is None:  # frozen, or before the cut: no gradient on either side
                assert param.grad is None or not param.grad.any(), (schedule, how, name)
            else:
                close(param.grad, expected[name].grad, f"{schedule} {how} step {step}: grad of {name}")  # type: ignore[arg-type]
        step_both(optimizer, reference_optimizer)
    for name, param in engine.named_parameters():
        close(param.detach(), expected[name].detach(), f"{schedule} {how}: {name} after {steps} steps")


def reproduction() -> None:
    """The issue's case: 4 Linear(8, 8), the first two frozen, partition [2, 2], one train_step."""
    with SEEDED:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    reference = copy.deepcopy(model)
    engine = PipelineEngine(model, mse, num_microbatches=2, partition=[2, 2])
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 8)
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    want = mse(reference(x), y)
    want.backward()
    close(loss, want.item(), "loss")
    for name, param in engine.named_parameters():
        wanted = dict(reference.named_parameters())[name].grad
        assert (param.grad is None) == (wanted is None), name
        if wanted is not None:
            close(param.grad, wanted, name)  # type: ignore[arg-type]


def under_inference_mode() -> None:
    engine = PipelineEngine(mlp(), mse, num_microbatches=2)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    with torch.inference_mode():
        engine.train_step(x if engine.first else None, y if engine.last else None)


def write_pid_and_train_forever(folder: str) -> None:
    """Each rank trains a few steps, leaves its pid in ``folder`` (it is mid-training now, done with the launcher's
    store), then trains until something stops it."""
    engine = PipelineEngine(mlp(), mse, num_microbatches=2)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    for step in itertools.count():
        engine.train_step(x if engine.first else None, y if engine.last else None)
        if step == 3:
            Path(folder, f"rank{ranks.rank()}.pid").write_text(str(os.getpid()))


def dies_between_steps(how: str, timeout: float) -> None:
    """Rank 1 leaves the run after a train_step, before clip_grad_norm_: exits (code 1 or 0) or hangs."""
    engine = PipelineEngine(mlp(), mse, num_microbatches=2, timeout=timeout)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    if ranks.rank() == 1:
        if how == "exit 1":
            os._exit(1)
        if how == "exit 0":
            os._exit(0)
        time.sleep(3600)  # hangs
    engine.clip_grad_norm_(1.0)
    engine.train_step(x if engine.first else None, y if engine.last else None)


def mismatched(case: str) -> None:
    """Ranks that call different things: every rank is told what each one called."""
    engine = PipelineEngine(mlp(), mse, num_microbatches=2, timeout=30)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    if case == "eval vs train":
        if ranks.rank() == 0:
            engine.eval_step(x)
        else:
            engine.train_step(None, y)
    elif case == "save on rank 0 only":
        if ranks.rank() == 0:
            engine.save("unused")
        engine.train_step(x if engine.first else None, y if engine.last else None)
    else:
        raise AssertionError(case)
