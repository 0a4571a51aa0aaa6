"""Boundary shapes inferred on the meta device, without processes or data."""

import pytest
import torch
from torch import nn

from pipeengine import solve
from pipeengine.core.specs import Boundary, TensorSpec, infer_boundaries, meta_copy
from tests.pipeengine.models import LENGTH, VOCAB, WIDTH, mlp, transformer


def test_meta_copy_allocates_nothing_and_keeps_requires_grad() -> None:
    layer = nn.Linear(4, 3)
    layer.bias.requires_grad_(False)
    copy = meta_copy(layer)
    assert copy.weight.is_meta and copy.weight.requires_grad and not copy.bias.requires_grad
    assert layer.weight.device.type == "cpu"  # the original is untouched


def test_transformer_boundaries_are_tuples_whose_mask_needs_no_gradient() -> None:
    model = transformer(blocks=3)
    bounds = solve([1.0] * len(model), 3)
    inputs = Boundary((TensorSpec((4, LENGTH), torch.int64, False),), False)
    outputs = infer_boundaries([meta_copy(layer) for layer in model], bounds, inputs)
    hidden = TensorSpec((4, LENGTH, WIDTH), torch.float32, True)
    mask = TensorSpec((4, LENGTH), torch.bool, False)
    assert outputs[0] == Boundary((hidden, mask), True) and outputs[1] == outputs[0]
    assert outputs[0].grad_specs == (hidden,)
    assert outputs[2] == Boundary((TensorSpec((4, LENGTH, VOCAB), torch.float32, True),), False)


def test_the_same_boundaries_as_a_real_forward() -> None:
    model = mlp()
    bounds = solve([1.0] * len(model), 4)
    inputs = Boundary((TensorSpec((3, 16), torch.float32, False),), False)
    inferred = infer_boundaries([meta_copy(layer) for layer in model], bounds, inputs)
    value = torch.randn(3, 16)
    for (start, end), boundary in zip(bounds, inferred, strict=True):
        for index in range(start, end):
            value = model[index](value)
        assert boundary == Boundary.of(value, "real")


def test_a_layer_that_returns_a_list_is_refused_with_the_rule() -> None:
    class Listy(nn.Module):
        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            return [x]

    inputs = Boundary((TensorSpec((2, 2), torch.float32, False),), False)
    with pytest.raises(TypeError, match="stage 0 .* is list; a stage boundary carries a tensor or a non-empty tuple"):
        infer_boundaries([Listy(), nn.Identity()], [(0, 1), (1, 2)], inputs)


def test_a_data_dependent_layer_gets_a_clear_error() -> None:
    class Nonzero(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > 0]

    inputs = Boundary((TensorSpec((2, 2), torch.float32, False),), False)
    with pytest.raises(RuntimeError, match="could not infer the shapes leaving layer 0 .*no data-dependent shapes"):
        infer_boundaries([Nonzero()], [(0, 1)], inputs)
