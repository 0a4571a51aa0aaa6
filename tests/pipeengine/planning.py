"""What the layout planner's tests share: a model of small MLP blocks, its data, and injected prices."""

from __future__ import annotations

import torch
from torch import nn

from pipeengine.planner.calibration import Link, Prices
from tests.pipeengine.models import SEEDED

WIDTH, BATCH = 8, 16


def blocks(count: int = 4, width: int = WIDTH) -> nn.Sequential:
    with SEEDED:
        torch.manual_seed(0)
        return nn.Sequential(
            *[nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(count)]
        )


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)


# prices given, not measured: each collective's latency and bandwidth as a test sets them
PRICES = Prices(
    0.0,
    Link(0.0, 0.0),
    {"all_reduce": {2: Link(1.0, 1e-3)}, "all_gather": {2: Link(0.5, 0.0)}, "reduce_scatter": {2: Link(0.25, 0.0)}},
    "injected",
    frame={},
    post=0.0,
    post_message=0.0,
    copy=0.0,
    fsdp={},
)
