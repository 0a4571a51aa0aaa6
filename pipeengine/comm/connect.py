"""connect(): the transport of a torch.distributed group (gloo or NCCL), or of this thread's in-process world."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipeengine.comm.base import Transport
from pipeengine.comm.gloo import GlooTransport
from pipeengine.comm.loopback import current
from pipeengine.comm.nccl import NcclTransport

__all__ = ["connect"]


def connect(group: dist.ProcessGroup | None, device: torch.device | None, timeout: float) -> Transport:
    """The transport of a torch.distributed group (None: the default group), or of this thread's loopback world.

    ``device``: where the rank computes (default: the current CUDA device on NCCL, else the CPU).
    """
    local = current()
    if local is not None:
        if device is not None and device.type != "cpu":
            raise ValueError(f"in-process (loopback) ranks compute on the CPU, got device={device}")
        local.timeout = timeout
        return local
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: start the ranks with pipeengine.launcher.launch(fn, nprocs=N) "
            "or torchrun (and call torch.distributed.init_process_group)"
        )
    backend = dist.get_backend(group)
    if backend == "nccl":
        if device is not None and device.type != "cuda":
            raise ValueError(f"the process group uses NCCL, which moves CUDA tensors only; got device={device}")
        return NcclTransport(group, device or torch.device("cuda", torch.cuda.current_device()), timeout)
    if backend == "gloo":
        return GlooTransport(group, device or torch.device("cpu"), timeout)
    if backend == "fake":  # a dry run (pipeengine.dry_run): tensors on the meta device, whatever device= says (a
        from pipeengine.comm.fake import FakeTransport  # main written for CUDA allocates nothing on a GPU here)

        return FakeTransport(group, torch.device("meta"), timeout)
    raise ValueError(f"pipeengine runs on gloo (CPU) or NCCL (CUDA) process groups, got backend {backend!r}")
