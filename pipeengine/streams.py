"""CUDA streams behind a thin layer: compute on the current stream, communication on its own; no-ops on CPU.

    compute stream   ── F(mb) ──●───────────────────────────●── F(mb+1) reads buf
                                │ event (wait_stream)       ▲ work.wait(): stream waits, host does not
    comm stream                 └──► isend(out)  irecv(buf) ┘
                                     record_stream(comm) on every tensor that crosses

On CPU (gloo) every method is a plain call, so CPU and CUDA run the same executor code.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

__all__: list[str] = []

T = TypeVar("T")


class Streams:
    def __init__(self, device: torch.device, timeout: float) -> None:
        self.cuda = device.type == "cuda"
        self.timeout = datetime.timedelta(seconds=timeout)
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.comm = torch.cuda.Stream(device)

    def post(self, tensors: Sequence[torch.Tensor], launch: Callable[[], T]) -> T:
        """Launch communication after the compute so far, on the comm stream; ``tensors`` cross to it."""
        if not self.cuda:
            return launch()
        self.comm.wait_stream(self.compute)
        for tensor in tensors:
            tensor.record_stream(self.comm)
        with torch.cuda.stream(self.comm):
            return launch()

    def wait(self, work: dist.Work) -> None:
        """Make the compute stream (CUDA) or the host (CPU) wait for a transfer.

        On CUDA the wait is stream-ordered and never blocks the host; a hung peer is caught by
        the process group's timeout (its watchdog). On CPU the host waits at most ``timeout``.
        """
        if self.cuda:
            work.wait()
        else:
            work.wait(self.timeout)
