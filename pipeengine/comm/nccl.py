"""NCCL: CUDA ranks; the lowered program as is, communication on a CUDA stream of its own."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from pipeengine.comm.backends import BACKENDS
from pipeengine.comm.base import Transfer, Transport
from pipeengine.comm.distributed import Distributed
from pipeengine.comm.gloo import GlooTransport
from pipeengine.comm.streams import Streams

__all__ = ["NcclTransport"]


class NcclTransport(Distributed):
    """CUDA ranks on NCCL: the lowered program as is; communication on a stream of its own.

    A wait before a compute is stream-ordered (the compute stream waits for the comm stream; the
    host goes on), so the host learns of a hung peer only at the end of the step: complete()
    polls every transfer of the step until the timeout, then raises, as every collective does.
    """

    backend = BACKENDS["nccl"]

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, timeout: float) -> None:
        super().__init__(group, device, timeout)
        self.streams = Streams(device)
        self._outstanding: list[tuple[dist.Work, float]] = []  # waited on the stream, not yet seen complete

    def side_channel(self) -> Transport:
        """On gloo over the same ranks: what a background thread sends is on the CPU (NCCL's kernels would share the
        GPU with the step's)."""
        group = dist.new_group(list(self.ranks), backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        return GlooTransport(group, torch.device("cpu"), self.timeout)

    def post(self, transfers: Sequence[Transfer]) -> None:
        ops = [
            dist.P2POp(dist.isend if t.send else dist.irecv, tensor, group=self.group, group_peer=t.peer)
            for t in transfers
            for tensor in t.tensors
        ]
        works = self.streams.post([op.tensor for op in ops], lambda: dist.batch_isend_irecv(ops))
        for transfer in transfers:  # NCCL coalesces a batch: its work handles complete together
            transfer.handles = list(works)

    def done(self, transfer: Transfer) -> bool:
        return all(work.is_completed() for work in transfer.handles)

    def wait(self, transfer: Transfer) -> None:
        now = time.monotonic()
        for work in transfer.handles:
            work.wait()  # the compute stream waits for the comm stream; the host does not block
            self._outstanding.append((work, now))
        transfer.handles = []

    def complete(self, transfers: Sequence[Transfer]) -> None:
        for transfer in transfers:
            self.wait(transfer)
        outstanding, self._outstanding = self._outstanding, []
        for work, began in outstanding:
            self._poll(work.is_completed, began, "the step's transfers")

    def settle(self, work: dist.Work, what: str, began: float) -> None:
        self._poll(work.is_completed, began, what)
        work.wait()  # order the current stream after it (it is done already)

    def _poll(self, finished: Callable[[], bool], began: float, what: str) -> None:
        while not finished():
            if time.monotonic() - began > self.timeout:
                raise self.failed(what, began, TimeoutError(f"not done within timeout={self.timeout:g} s"))
            time.sleep(1e-4)
