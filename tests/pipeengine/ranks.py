"""What a test worker needs of its world, in-process (loopback threads) or in real processes (torch.distributed)."""

from __future__ import annotations

from typing import Any

from pipeengine.comm.base import Transport
from pipeengine.comm.connect import connect
from pipeengine.comm.loopback import current


def world() -> Transport:
    """This rank's world: the thread's loopback world, else the default process group (on NCCL, the current CUDA
    device: a CUDA test's ranks join NCCL, which moves CUDA tensors only)."""
    return current() or connect(None, None, 60.0)


def rank() -> int:
    return world().rank


def size() -> int:
    return world().size


def all_gather_object(value: object) -> list[Any]:
    return world().all_gather_object(value, "a test's all_gather_object")


def barrier() -> None:
    world().barrier("a test's barrier")
