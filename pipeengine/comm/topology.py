"""The topology: the transports of this rank's groups, every one a slice of the one grid (pipeengine.core.grid).

    world      every rank of the engine
    pipeline   this rank's pipeline: one rank per stage position, the same (replica, tensor index)
    data       the replicas of this (stage position, tensor index); None without data parallelism
    tensor     this stage's tensor-parallel ranks; None without tensor parallelism

Groups are made in one order on every rank (pipelines, then data groups, then tensor groups), as
torch.distributed requires. ``subgroup(ranks)`` makes any other group of the grid (the holders of
a tied weight).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeengine.comm.base import Transport
from pipeengine.core.grid import DIMS, Grid

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    grid: Grid
    dp_rank: int
    pp_rank: int
    tp_rank: int
    world: Transport  # every rank of the engine (all replicas)
    pipeline: Transport  # this rank's pipeline
    data: Transport | None  # the replicas of this pipeline position; None without data parallelism
    tensor: Transport | None  # this stage's tensor-parallel ranks; None without tensor parallelism

    @classmethod
    def build(cls, grid: Grid, world: Transport, mesh: object | None = None) -> Topology:
        """Split the world along the grid (every rank must call this). With torch's DeviceMesh over the same grid
        (``mesh``), its groups serve: none is made twice."""
        if grid.size != world.size:
            raise ValueError(f"a grid of {grid.shape} (dp, pp, tp) needs {grid.size} ranks, the world has {world.size}")
        dp, pp, tp = grid.coordinates(world.rank)

        def along(dim: str) -> Transport:
            """This rank's group along ``dim``: the world itself where that is the whole world."""
            if dict(zip(DIMS, grid.shape, strict=True))[dim] == world.size:
                return world
            if mesh is not None:
                return world.of_group(mesh.get_group(dim))  # type: ignore[attr-defined]
            return world.split(grid.groups(dim))

        pipeline = along("pp")  # always one, if only of this rank: the step's loss is broadcast over it
        data = along("dp") if grid.dp > 1 else None
        tensor = along("tp") if grid.tp > 1 else None
        return cls(grid, dp, pp, tp, world, pipeline, data, tensor)

    @property
    def data_parallel(self) -> int:
        return self.grid.dp

    @property
    def pipeline_size(self) -> int:
        return self.grid.pp

    @property
    def tensor_parallel(self) -> int:
        return self.grid.tp

    def subgroup(self, ranks: Sequence[int]) -> Transport | None:
        """A group of these world ranks (every rank calls it, in one order): None on the ranks outside it."""
        return self.world.subgroup(ranks)
