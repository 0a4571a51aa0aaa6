"""CUDA streams behind a thin layer: compute on the current stream, communication on its own; no-ops on CPU.

    compute stream   ── F(mb) ──●───────────────────────────●── F(mb+1) reads buf
                                │ event (wait_stream)       ▲ work.wait(): stream waits, host does not
    comm stream                 └──► isend(out)  irecv(buf) ┘
                                     record_stream(comm) on every tensor that crosses

Used by the NCCL transport (pipeengine.comm.base); on CPU every call is a plain call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

__all__: list[str] = []

T = TypeVar("T")


class Streams:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
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
