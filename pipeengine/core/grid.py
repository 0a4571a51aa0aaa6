"""The grid: every rank of the world at one place on one (dp, pp, tp) grid, as torch's DeviceMesh lays it out.

Tensor-parallel ranks are innermost (neighbouring ranks, one node under torchrun), then the
pipeline, then the data-parallel replicas (picotron's ``torch.arange(world).view(dp, pp, tp)``)::

    world 8, dp=2 pp=2 tp=2      rank = (d * pp + p) * tp + t
    tp groups  [0,1] [2,3] [4,5] [6,7]      a stage's tensor-parallel ranks
    pp groups  [0,2] [1,3] [4,6] [5,7]      a pipeline: the same tensor-parallel index in every stage
    dp groups  [0,4] [1,5] [2,6] [3,7]      the replicas of one (stage, tensor-parallel index)

Every group the engine uses is taken from here (pipeline neighbours, replicas, tensor groups, the
holders of a tied weight), never computed by index elsewhere. Pure Python: no process group needed.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

__all__ = ["DIMS", "Grid"]

DIMS = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Grid:
    dp: int
    pp: int
    tp: int = 1

    @classmethod
    def of(cls, world: int, data_parallel: int = 1, tensor_parallel: int = 1) -> Grid:
        """The grid of ``world`` ranks with these data- and tensor-parallel sizes; the rest is the pipeline."""
        for name, size in (("data_parallel", data_parallel), ("tensor_parallel", tensor_parallel)):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        if world % (data_parallel * tensor_parallel):
            of = f" of tensor_parallel={tensor_parallel} ranks a stage" if tensor_parallel > 1 else ""
            raise ValueError(
                f"a world of {world} ranks does not split into data_parallel={data_parallel} equal pipelines{of}: "
                f"use a data_parallel{' x tensor_parallel' if of else ''} that divides {world}, or launch "
                f"{data_parallel} x (pipeline ranks){f' x {tensor_parallel}' if of else ''} processes"
            )
        return cls(data_parallel, world // (data_parallel * tensor_parallel), tensor_parallel)

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.dp, self.pp, self.tp)

    def rank(self, dp: int, pp: int, tp: int = 0) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) of a world rank."""
        rest, tp = divmod(rank, self.tp)
        dp, pp = divmod(rest, self.pp)
        return dp, pp, tp

    def select(
        self, dp: Collection[int] | None = None, pp: Collection[int] | None = None, tp: Collection[int] | None = None
    ) -> list[int]:
        """The world ranks whose coordinates are in the given sets (None: any), in rank order."""
        return [
            self.rank(d, p, t)
            for d in range(self.dp)
            if dp is None or d in dp
            for p in range(self.pp)
            if pp is None or p in pp
            for t in range(self.tp)
            if tp is None or t in tp
        ]

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim`` (ranks that differ only there), each in order; every rank is in one."""
        if dim not in DIMS:
            raise ValueError(f"the grid's dims are {DIMS}, got {dim!r}")
        others = [d for d in DIMS if d != dim]
        sizes = dict(zip(DIMS, self.shape, strict=True))
        out = []
        for a in range(sizes[others[0]]):
            for b in range(sizes[others[1]]):
                fixed = {others[0]: [a], others[1]: [b]}
                out.append(self.select(**fixed))
        return out

    def nested(self) -> list[list[list[int]]]:
        """The ranks as a (dp, pp, tp) nested list: DeviceMesh's mesh argument."""
        return [[[self.rank(d, p, t) for t in range(self.tp)] for p in range(self.pp)] for d in range(self.dp)]
