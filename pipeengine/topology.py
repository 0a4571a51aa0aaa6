"""The grid: world = data_parallel x pipeline ranks, each replica's pipeline on consecutive ranks.

world ranks   0 1 2 3 | 4 5 6 7         dp=2, pp=4
pipeline      replica 0 | replica 1     (neighbours in a pipeline are neighbouring ranks,
data groups   {0,4} {1,5} {2,6} {3,7}    the same node under torchrun when pp divides it)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    data_parallel: int
    pipeline: int
    dp_rank: int
    pp_rank: int
    pipeline_group: dist.ProcessGroup | None  # None: the default group (no data parallelism)
    data_group: dist.ProcessGroup | None  # None: no data parallelism

    @classmethod
    def build(cls, data_parallel: int, group: dist.ProcessGroup | None) -> Topology:
        """Split the default group into pipelines and data-parallel groups (every rank must call this)."""
        if not isinstance(data_parallel, int) or data_parallel < 1:
            raise ValueError(f"data_parallel must be a positive int, got {data_parallel!r}")
        if data_parallel == 1:
            return cls(1, dist.get_world_size(group), 0, dist.get_rank(group), group, None)
        if group is not None:
            raise ValueError("pass either group= (your own pipeline group) or data_parallel=, not both")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % data_parallel:
            raise ValueError(
                f"a world of {world} ranks does not split into data_parallel={data_parallel} equal pipelines: "
                f"use a data_parallel that divides {world}, or {data_parallel} x (pipeline ranks) processes"
            )
        pp = world // data_parallel
        # every rank creates every group, in the same order, as torch.distributed requires
        pipelines = [dist.new_group(list(range(d * pp, (d + 1) * pp))) for d in range(data_parallel)]
        replicas = [dist.new_group(list(range(k, world, pp))) for k in range(pp)]
        dp_rank, pp_rank = divmod(rank, pp)
        return cls(data_parallel, pp, dp_rank, pp_rank, pipelines[dp_rank], replicas[pp_rank])
