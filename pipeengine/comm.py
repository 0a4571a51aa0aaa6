"""All point-to-point communication: one batch_isend_irecv per lowered Batch, in the schedule's order."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipeengine.streams import Streams
from schedules import Instruction

__all__: list[str] = []


@dataclass
class Transfer:
    """One posted send or recv: its instruction, its tensors and the work handles that complete it."""

    op: Instruction
    tensors: tuple[torch.Tensor, ...]
    peer: int
    works: list[dist.Work] = field(default_factory=list)


class P2P:
    """Posts messages to group ranks; the order of ops within and across batches is the schedule's."""

    def __init__(self, group: dist.ProcessGroup | None, streams: Streams) -> None:
        self.group = group
        self.streams = streams

    def post(self, transfers: list[tuple[bool, Transfer]]) -> None:
        """Post (is_send, transfer) pairs as one batch; fills each transfer's works."""
        ops, owners = [], []
        for is_send, transfer in transfers:
            verb = dist.isend if is_send else dist.irecv
            for tensor in transfer.tensors:
                ops.append(dist.P2POp(verb, tensor, group=self.group, group_peer=transfer.peer))
                owners.append(transfer)
        if not ops:
            return
        tensors = [op.tensor for op in ops]
        works = self.streams.post(tensors, lambda: dist.batch_isend_irecv(ops))
        if len(works) == len(ops):  # one handle per op (gloo)
            for owner, work in zip(owners, works, strict=True):
                owner.works.append(work)
        else:  # one handle for the whole batch (NCCL coalesces a batch)
            for _, transfer in transfers:
                transfer.works = list(works)

    def wait(self, transfer: Transfer) -> None:
        for work in transfer.works:
            self.streams.wait(work)
        transfer.works = []
