"""Tensors that may be DTensors (a stage parallelized on its tensor-parallel mesh): this rank's part, and the whole.

local(t)    the tensor this rank holds (a DTensor's local shard, an async collective's result; a plain tensor)
settle(ts)  wait for the collectives still writing any of these tensors
whole(t)    the full tensor (a DTensor gathered over its mesh: every rank of the mesh calls it)
spread(t, like)   a full tensor cut as ``like`` is (its mesh and placements), with no communication
tensor_parallel_numel(t)   the elements of this rank's shard along the mesh's "tp" dim alone
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable

import torch

__all__ = ["is_dtensor", "local", "local_bytes", "settle", "spread", "tensor_parallel_numel", "whole"]


def is_dtensor(tensor: object) -> bool:
    """Without torch.distributed.tensor imported nothing is a DTensor: not imported for it (seconds of CPU)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local(tensor: torch.Tensor, wait: bool = True) -> torch.Tensor:
    """This rank's tensor: a DTensor's shard; the tensor inside an AsyncCollectiveTensor (what RowwiseParallel's
    output is until first used), whose own storage cannot be read, once its collective completed (a gradient's
    shard is then scaled or reduced in place: before the wait, that would race the collective). ``wait=False``: that
    tensor as it is, the collective maybe still writing it: its storage's address and size, never its values."""
    if is_dtensor(tensor):  # its shard may itself be an AsyncCollectiveTensor (RowwiseParallel's output, as the
        tensor = tensor.to_local()  # type: ignore[attr-defined]  # next ColwiseParallel saves it for backward)
    module = sys.modules.get("torch.distributed._functional_collectives")  # not imported: none of them exists
    if module is not None and isinstance(tensor, module.AsyncCollectiveTensor):
        return tensor.trigger_wait() if wait else tensor.elem  # type: ignore[no-any-return]
    return tensor


def settle(tensors: Iterable[torch.Tensor | None]) -> None:
    """Wait for the collectives still writing any of these tensors (tensor parallel's, asynchronous until used).
    A compute watched by the allocator (pipeengine.observe.allocator) settles what it made before its watch closes:
    gloo runs a collective on its own thread, which reports to the profiler that was on when it was launched."""
    for tensor in tensors:
        if tensor is not None:
            local(tensor)


def settled(tensor: torch.Tensor) -> torch.Tensor:
    """An AsyncCollectiveTensor (RowwiseParallel's output) waited on, as a plain tensor still in the autograd graph
    (``local`` leaves the graph); any other tensor as it is. A profile's outputs: each collective waited on."""
    module = sys.modules.get("torch.distributed._functional_collectives")
    if module is not None and isinstance(tensor, module.AsyncCollectiveTensor):
        return tensor * 1  # type: ignore[no-any-return]
    return tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def spread(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` as a DTensor placed as ``like`` (every rank holds ``full``: each keeps its part, nothing is sent); a
    DTensor already (read shard by shard) as it is."""
    if not is_dtensor(like) or is_dtensor(full):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        full.to(like.device, like.dtype),
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        src_data_rank=None,
    )


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of a tensor."""
    mine = local(tensor, wait=False)
    return mine.numel() * mine.element_size()


def tensor_parallel_numel(tensor: torch.Tensor) -> int:
    """Elements of this rank's shard of a tensor split over the mesh's "tp" dim, as DTensor splits it (torch.chunk's
    sizes); a split over any other dim (FSDP's over "dp") is not counted: the tensor-parallel rank's share."""
    if not is_dtensor(tensor):
        return tensor.numel()
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    shape = list(tensor.shape)
    for dim, (name, placement) in enumerate(zip(mesh.mesh_dim_names or (), tensor.placements, strict=False)):  # type: ignore[attr-defined]
        if name == "tp" and placement.is_shard():
            size, index, n = mesh.size(dim), mesh.get_local_rank(dim), shape[placement.dim]
            chunk = -(-n // size)
            shape[placement.dim] = max(0, min(chunk, n - index * chunk))
    return math.prod(shape)
