"""gloo: CPU ranks; posting never blocks, so each step's recvs are all posted first."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipeengine.comm.backends import BACKENDS
from pipeengine.comm.base import Transfer, Transport
from pipeengine.comm.distributed import Distributed

__all__ = ["GlooTransport", "second_group"]


class GlooTransport(Distributed):
    """CPU ranks on gloo: posting never blocks, so each step's recvs are all posted first.

    Messages to a lower rank travel on a second gloo group over the same ranks, so that each
    connection carries data one way. gloo's connection to a peer is one socket whose lock is
    shared by the thread that posts (a send writes inline) and gloo's I/O thread (which reads
    what arrives): when both ranks send to each other at once, as in 1F1B's steady state,
    posting waits for the reads: two groups make 1F1B's steps faster (benchmarks/vs_torch.py
    --width 256). A recv posted early costs only its buffer, while one posted mid-step contends
    with the I/O thread (docs/benchmarks.md).
    """

    backend = BACKENDS["gloo"]

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, timeout: float) -> None:
        super().__init__(group, device, timeout)
        self._wait_for = datetime.timedelta(seconds=timeout)
        self._down: dist.ProcessGroup | None = None

    def side_channel(self) -> Transport:
        group = dist.new_group(list(self.ranks), backend="gloo", timeout=self._wait_for)
        return type(self)(group, self.device, self.timeout)

    def open_channels(self) -> None:
        """The second group, for messages to a lower rank (without it, they share the first)."""
        if self._down is None and self.size > 1:
            self._down = second_group(self.ranks, self._wait_for)

    def post(self, transfers: Sequence[Transfer]) -> None:
        by_group: dict[int, tuple[dist.ProcessGroup | None, list[dist.P2POp], list[Transfer]]] = {}
        for transfer in transfers:
            is_send = transfer.send
            downward = transfer.peer < self.rank if is_send else transfer.peer > self.rank
            group = self._down if downward and self._down is not None else self.group
            _, ops, owners = by_group.setdefault(id(group), (group, [], []))
            verb = dist.isend if is_send else dist.irecv
            for tensor in transfer.tensors:
                ops.append(dist.P2POp(verb, tensor, group=group, group_peer=transfer.peer))
                owners.append(transfer)
        for _, ops, owners in by_group.values():  # each group keeps the schedule's order of its messages
            for owner, work in zip(owners, dist.batch_isend_irecv(ops), strict=True):  # one work per op on gloo
                owner.handles.append(work)

    def done(self, transfer: Transfer) -> bool:
        """gloo marks a work complete only once it is waited on: a zero-timeout wait tests it without blocking
        (a finished send returns at once, and its tensors are free to go: gloo has taken the bytes)."""
        for work in transfer.handles:
            if not work.is_completed():
                try:
                    work.wait(_NOW)
                except Exception:  # noqa: BLE001  (not yet; a real failure shows in complete())
                    return False
        return True

    def wait(self, transfer: Transfer) -> None:
        for work in transfer.handles:
            work.wait(self._wait_for)
        transfer.handles = []

    def settle(self, work: dist.Work, what: str, began: float) -> None:
        try:
            work.wait(self._wait_for)
        except Exception as error:
            raise self.failed(what, began, error) from error


_NOW = datetime.timedelta(0)
_SECOND: dict[tuple[int, ...], tuple[object, dist.ProcessGroup]] = {}  # ranks -> (default group, second group)
_SECOND_LOCK = threading.Lock()


def second_group(ranks: tuple[int, ...], timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A second gloo group over ``ranks``, made once per process group; every one of the ranks calls this."""
    world = dist.group.WORLD
    with _SECOND_LOCK:
        made = _SECOND.get(ranks)
        if made is None or made[0] is not world:  # none yet, or torch.distributed was set up again since
            second = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
            # every member has finished making it before anyone sends on it (gloo: "Pair is not connected")
            dist.barrier(group=second, async_op=True).wait(timeout)
            made = _SECOND[ranks] = (world, second)
    return made[1]
