"""What the gloo and NCCL transports share: a torch.distributed group, its collectives bounded by the timeout."""

from __future__ import annotations

import abc
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeengine.comm.base import Pending, Transport

__all__: list[str] = []


class Distributed(Transport):
    """What gloo and NCCL share: a torch.distributed group."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, timeout: float) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        self.device, self.timeout = device, timeout

    @abc.abstractmethod
    def settle(self, work: dist.Work, what: str, began: float) -> None:
        """Host-wait for a collective's work within the timeout (a PeerError past it)."""

    def all_gather(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        began = time.monotonic()
        try:
            work = dist.all_gather(out, tensor, group=self.group, async_op=True)
        except Exception as error:
            raise self.failed(what, began, error) from error
        self.settle(work, what, began)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        began = time.monotonic()
        try:
            work = dist.broadcast(tensor, group_src=src, group=self.group, async_op=True)
        except Exception as error:
            raise self.failed(what, began, error) from error
        self.settle(work, what, began)

    def all_reduce(self, tensor: torch.Tensor, what: str, op: str = "sum") -> None:
        reduce = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        began = time.monotonic()
        try:
            work = dist.all_reduce(tensor, op=reduce, group=self.group, async_op=True)
        except Exception as error:
            raise self.failed(what, began, error) from error
        self.settle(work, what, began)

    def start_all_reduce(self, tensor: torch.Tensor, what: str) -> Pending:
        began = time.monotonic()
        try:
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
        except Exception as error:
            raise self.failed(what, began, error) from error
        return _Work(self, work, what, began)

    def all_gather_object(self, value: object, what: str) -> list[Any]:
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(self.control_device)
        sizes = self.all_gather(torch.tensor([data.numel()], device=self.control_device), what)
        longest = int(max(size.item() for size in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.control_device)
        padded[: data.numel()] = data
        gathered = self.all_gather(padded, what)
        return [pickle.loads(g[: int(n.item())].cpu().numpy().tobytes()) for g, n in zip(gathered, sizes, strict=True)]

    def of_group(self, group: dist.ProcessGroup) -> Transport:
        return type(self)(group, self.device, self.timeout)

    def subgroup(self, ranks: Sequence[int]) -> Transport | None:
        made = dist.new_group([self.ranks[r] for r in ranks])
        return type(self)(made, self.device, self.timeout) if self.rank in ranks else None


@dataclass
class _Work(Pending):
    transport: Distributed
    work: dist.Work
    what: str
    began: float

    def wait(self) -> None:
        self.transport.settle(self.work, self.what, self.began)
