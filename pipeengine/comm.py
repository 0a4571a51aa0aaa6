"""All point-to-point communication: one batch_isend_irecv per lowered Post, in the schedule's order.

On gloo, messages to a lower rank travel on a second group over the same ranks, so that
each connection carries data one way. gloo's connection to a peer is one socket whose
lock is shared by the thread that posts (a send writes inline) and gloo's I/O thread
(which reads what arrives): when both ranks send to each other at once, as in 1F1B's steady
state, posting waits for the reads. Measured with benchmarks/vs_torch.py --width 256:
1F1B 21.7 / 22.7 ms a step on one group, 15.6 / 18.4 ms on two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

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
    """Posts messages to group ranks; the order of ops within and across batches is the schedule's.

    ``down``: the group that carries messages from a higher rank to a lower one (the same
    ranks as ``group``); None sends everything on ``group``.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, streams: Streams, down: dist.ProcessGroup | None = None
    ) -> None:
        self.group = group
        self.streams = streams
        self.rank = dist.get_rank(group)
        self.down = down or group

    def post(self, transfers: list[tuple[bool, Transfer]]) -> None:
        """Post (is_send, transfer) pairs as one batch; fills each transfer's works."""
        by_group: dict[int, tuple[list[dist.P2POp], list[Transfer]]] = {}
        for is_send, transfer in transfers:
            verb = dist.isend if is_send else dist.irecv
            downward = transfer.peer < self.rank if is_send else transfer.peer > self.rank
            group = self.down if downward else self.group
            ops, owners = by_group.setdefault(id(group), ([], []))
            for tensor in transfer.tensors:
                ops.append(dist.P2POp(verb, tensor, group=group, group_peer=transfer.peer))
                owners.append(transfer)
        for ops, owners in by_group.values():  # each group keeps the schedule's order of its messages
            works = self.streams.post([op.tensor for op in ops], partial(dist.batch_isend_irecv, ops))
            if len(works) == len(ops):  # one handle per op (gloo)
                for owner, work in zip(owners, works, strict=True):
                    owner.works.append(work)
            else:  # one handle for the whole batch (NCCL coalesces a batch)
                for transfer in owners:
                    transfer.works = list(works)

    def wait(self, transfer: Transfer) -> None:
        for work in transfer.works:
            self.streams.wait(work)
        transfer.works = []


_SECOND: dict[tuple[int, ...], tuple[object, dist.ProcessGroup]] = {}  # ranks -> (default group, second)


def second_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A second gloo group over the ranks of ``group``, made once per process group; all its ranks call this."""
    world = dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group or world))
    made = _SECOND.get(ranks)
    if made is None or made[0] is not world:  # none yet, or torch.distributed was set up again since
        made = _SECOND[ranks] = (world, dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True))
    return made[1]
