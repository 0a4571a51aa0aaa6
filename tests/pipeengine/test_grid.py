"""One grid for every axis, and the seam where a stage module is transformed on its device mesh."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine
from pipeengine.core.grid import Grid
from tests.pipeengine import ranks
from tests.pipeengine.models import batch, mlp, mse
from tests.pipeengine.parity import OneProcess, check_grads, close
from tests.pipeengine.ranks import on_ranks


def test_the_grid_lays_ranks_out_as_device_mesh_does() -> None:
    grid = Grid.of(8, data_parallel=2, tensor_parallel=2)
    assert (grid.dp, grid.pp, grid.tp) == (2, 2, 2)
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # neighbours: one node under torchrun
    assert grid.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.nested() == torch.arange(8).view(2, 2, 2).tolist()  # picotron's and DeviceMesh's layout
    assert all(grid.rank(*grid.coordinates(r)) == r for r in range(8))
    assert grid.select(pp=[0, 1], tp=[1]) == [1, 3, 5, 7]
    plain = Grid.of(4, data_parallel=2)  # tensor-parallel size 1: each replica's pipeline on consecutive ranks
    assert plain.groups("pp") == [[0, 1], [2, 3]] and plain.groups("dp") == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match=r"a world of 6 ranks does not split into data_parallel=4 equal pipelines"):
        Grid.of(6, data_parallel=4)


def transformed(expect_mesh: bool) -> None:
    """parallelize(stage, mesh) is called once per stage of this rank, before its worker runs it, with the rank's
    device mesh (real processes) or None (in-process ranks); the transformed stages train as one process, and a
    parallelize that returns no module is refused."""
    seen = []

    def parallelize(stage: nn.Module, mesh: object) -> nn.Module:
        seen.append(mesh)
        return stage

    model = mlp()
    one = OneProcess(model, mse)
    engine = PipelineEngine(model, mse, num_microbatches=2, parallelize=parallelize)
    assert len(seen) == len(engine.stages)  # once per stage of this rank, before its worker runs it
    if expect_mesh:
        mesh = seen[0]
        assert mesh.mesh_dim_names == ("dp", "pp", "tp") and tuple(mesh.shape) == (1, ranks.size(), 1)  # type: ignore[attr-defined]
        assert list(mesh.get_coordinate()) == [0, ranks.rank(), 0]  # type: ignore[attr-defined]
    else:
        assert seen == [None]  # in-process ranks have no torch.distributed
    x, y = batch("mlp", 4, seed=0)
    close(engine.train_step(x if engine.first else None, y if engine.last else None), one.step([(x, y)]), "loss")
    check_grads(engine, one, "a transformed stage")

    def not_a_module(stage: nn.Module, mesh: object) -> object:
        return "oops"

    with pytest.raises(TypeError, match=r"parallelize\(stage_module, mesh\) must return the module to run"):
        PipelineEngine(mlp(), mse, num_microbatches=2, parallelize=not_a_module)
    ranks.barrier()


@pytest.mark.timeout(90)
@on_ranks(2, timeout=60, in_process=True)
def test_each_stage_is_transformed_before_its_worker_runs_it_on_in_process_ranks() -> None:
    transformed(expect_mesh=False)


@pytest.mark.timeout(90)
@on_ranks(2, timeout=60)
def test_each_stage_is_transformed_on_the_mesh_before_its_worker_runs_it() -> None:
    transformed(expect_mesh=True)
