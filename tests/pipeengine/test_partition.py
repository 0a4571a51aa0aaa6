import pytest
import torch
from torch import nn

from pipeengine import uniform_partition
from pipeengine.partition import check_bounds, stage_module


@pytest.mark.parametrize(
    "layers, stages, bounds",
    [
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
        (5, 1, [(0, 5)]),
    ],
)
def test_uniform_partition_tiles_the_layers(layers: int, stages: int, bounds: list[tuple[int, int]]) -> None:
    assert uniform_partition(layers, stages) == bounds


def test_more_stages_than_layers_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="5 stages but the model has 4 layers: .* use at most 4 ranks x chunks"):
        uniform_partition(4, 5)


@pytest.mark.parametrize("bounds", [[(0, 2), (3, 4)], [(0, 2), (2, 2), (2, 4)], [(0, 3)], [(1, 4)]])
def test_bounds_must_tile_the_layers_in_order(bounds: list[tuple[int, int]]) -> None:
    with pytest.raises(ValueError, match="layers"):
        check_bounds(bounds, 4)


def test_stage_modules_keep_the_sequentials_names_and_modules() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 3), nn.Linear(3, 1))
    stage = stage_module(model, 2, 4)
    assert [name for name, _ in stage.named_parameters()] == ["2.weight", "2.bias", "3.weight", "3.bias"]
    assert stage[0] is model[2]  # the same module, not a copy
    x = torch.randn(5, 3)
    torch.testing.assert_close(stage(x), model[3](model[2](x)))
