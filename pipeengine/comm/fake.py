"""fake: one rank of a big world built and stepped in this process, before the cluster is booked (pipeengine.dry_run).

On torch's fake process group (``init_process_group("fake", ...)``: every collective and message completes at once,
moving nothing) the rank runs the lowered program as NCCL would (its semantics: rendezvous), with the model's
tensors on the meta device: shapes flow, nothing of the real size is allocated. A collective gives back this rank's
own contribution as every rank's (torch's fake all_gather copies it), and the step's header, which the other ranks
would fill (the first stage's inputs, the last stage's targets), is read from the dry run's record of them
(``Ghosts``): what the first stage's rank said for that call when the dry run built it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeengine.comm.backends import BACKENDS
from pipeengine.comm.base import Transfer
from pipeengine.comm.calls import BATCH, N_INPUTS, STATUS, Call
from pipeengine.comm.distributed import Distributed

__all__ = ["FakeTransport", "Ghosts"]


@dataclass
class Ghosts:
    """What a dry run keeps while it runs its ranks: what the ranks it does not build would say in a step's header
    (the rows the first stage's rank gave, by call number, recorded when the dry run built it), the engines the
    rank being run built, and what its saves would have written."""

    first: dict[int, list[int]] = field(default_factory=dict)
    engines: list[Any] = field(default_factory=list)  # the engines built on the rank being run, for its report
    saved: dict[str, tuple[Any, dict[str, Any]]] = field(default_factory=dict)  # directory -> (the checkpoint a save
    # would have written, its plain extras): what a later load in the same run reads, as nothing was written

    def rows(self, mine: list[int], rank: int, size: int) -> list[list[int]]:
        """Every rank's header row for the call in ``mine`` (this rank's, at ``rank`` of ``size``): the others say
        what the first stage's rank said (its inputs' shapes, recorded), and hold the targets: this rank's, where it
        holds them (so that its are checked against the inputs), else as many rows as the inputs, what the real
        run's last stage must pass."""
        number = mine[1]
        if mine[0] not in (Call.TRAIN, Call.EVAL):  # save, load, clip: no batch, every rank says the same
            return [list(mine) for _ in range(size)]
        if mine[N_INPUTS] > 0:  # this rank holds the inputs: the record the others will read
            self.first[number] = list(mine)
        elif number not in self.first:
            raise ValueError(
                f"the dry run has no record of the first stage's inputs for call {number} (rank {rank} "
                "is not the first stage's): pipeengine.dry_run builds a first stage's rank before the "
                "others, so that their steps learn the batch's shapes from it"
            )
        ghost = list(self.first[number])
        ghost[:2], ghost[STATUS] = mine[:2], 0
        ghost[-1] = mine[-1] if mine[-1] >= 0 else ghost[BATCH]
        return [list(mine) if r == rank else list(ghost) for r in range(size)]


GHOSTS = Ghosts()  # the dry run in progress (pipeengine.dry_run sets it up and clears it)


class FakeTransport(Distributed):
    """A rank on torch's fake process group: messages and collectives complete at once (the module docstring)."""

    backend = BACKENDS["fake"]
    alone = True

    @property
    def control_device(self) -> torch.device:
        return torch.device("cpu")

    def post(self, transfers: Sequence[Transfer]) -> None:
        for transfer in transfers:
            transfer.handles = []

    def done(self, transfer: Transfer) -> bool:
        return True

    def wait(self, transfer: Transfer) -> None:
        transfer.handles = []

    def settle(self, work: dist.Work, what: str, began: float) -> None:
        work.wait()

    def built(self, engine: object) -> None:
        GHOSTS.engines.append(engine)

    def gather_header(self, row: torch.Tensor, what: str) -> list[torch.Tensor]:
        table = GHOSTS.rows([int(x) for x in row.tolist()], self.rank, self.size)
        return [torch.tensor(r, dtype=row.dtype, device=self.control_device) for r in table]

    def side_channel(self) -> FakeTransport:
        return type(self)(dist.new_group(list(self.ranks)), self.device, self.timeout)
