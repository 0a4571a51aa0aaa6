"""The grid: world = data_parallel x pipeline ranks, each replica's pipeline on consecutive ranks.

world ranks   0 1 2 3 | 4 5 6 7         dp=2, pp=4
pipeline      replica 0 | replica 1     (neighbours in a pipeline are neighbouring ranks,
data groups   {0,4} {1,5} {2,6} {3,7}    the same node under torchrun when pp divides it)
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeengine.transport import Transport

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    data_parallel: int
    pipeline_size: int
    dp_rank: int
    pp_rank: int
    world: Transport  # every rank of the engine (all replicas)
    pipeline: Transport  # this replica's pipeline
    data: Transport | None  # the replicas of this pipeline position; None without data parallelism

    @classmethod
    def build(cls, data_parallel: int, world: Transport) -> Topology:
        """Split the world into pipelines and data-parallel groups (every rank must call this)."""
        if data_parallel == 1:
            return cls(1, world.size, 0, world.rank, world, world, None)
        if world.size % data_parallel:
            raise ValueError(
                f"a world of {world.size} ranks does not split into data_parallel={data_parallel} equal pipelines: "
                f"use a data_parallel that divides {world.size}, or {data_parallel} x (pipeline ranks) processes"
            )
        pp = world.size // data_parallel
        pipeline = world.split([list(range(d * pp, (d + 1) * pp)) for d in range(data_parallel)])
        data = world.split([list(range(k, world.size, pp)) for k in range(pp)])
        dp_rank, pp_rank = divmod(world.rank, pp)
        return cls(data_parallel, pp, dp_rank, pp_rank, world, pipeline, data)
