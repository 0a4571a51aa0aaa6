"""The communication layer's base: a Transport is one group of ranks as the engine uses it.

It runs a backend's program (pipeengine.comm.backends), posts point-to-point messages, tests
them and waits for them, and makes the few collectives the engine needs (the step header, the
loss, gradient reductions, checkpoints). Every wait, on every backend, is bounded by the
engine's timeout and fails as a PeerError saying what it waited for. The backends: gloo.py,
nccl.py (over distributed.py) and loopback.py; connect.py picks one.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pipeengine.comm.backends import Backend
from pipeengine.errors import PeerError
from schedules import Schedule, Semantics

__all__ = ["Pending", "Tensors", "Transfer", "Transport"]

Tensors = tuple[torch.Tensor, ...]
T = TypeVar("T")


@dataclass
class Transfer:
    """One posted send or recv: which way it goes, its tensors, the peer's rank in the group, the backend's handles.

    ``what``: what it carries, for messages (the schedule's instruction, e.g. ``1SF3``).
    """

    send: bool
    tensors: Tensors
    peer: int
    what: object = None
    handles: list[Any] = field(default_factory=list)


class Pending(abc.ABC):
    """An asynchronous collective (a gradient all-reduce): wait() blocks, within the timeout."""

    @abc.abstractmethod
    def wait(self) -> None: ...


class Transport(abc.ABC):
    """One group of ranks as the engine uses it. Every rank of the group calls each collective, in order."""

    backend: Backend  # its program and semantics (pipeengine.comm.backends)
    rank: int  # in this group
    size: int
    ranks: tuple[int, ...]  # the world ranks of the group, for messages
    device: torch.device
    timeout: float
    shared_clock: bool = False  # every rank reads one clock (threads of one process)
    group: dist.ProcessGroup | None = None  # the torch.distributed group, where there is one
    engines: int = 0  # engines built on this transport so far, on this rank (each rank builds them in one order)
    alone: bool = False  # the group's other ranks are not there (a dry run): what one would send, each works out

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def control_device(self) -> torch.device:
        """Where the engine's own exchanges (headers, objects, barriers) keep their values: the compute device, but
        for a dry run's rank, which computes on the meta device (pipeengine.comm.fake)."""
        return self.device

    @property
    def semantics(self) -> Semantics:
        return self.backend.semantics

    def program(self, schedule: Schedule) -> Schedule:
        """The streams this transport runs for a lowered schedule (validated under ``semantics``)."""
        return self.backend.program(schedule)

    # ---- point to point, in the schedule's order

    @abc.abstractmethod
    def post(self, transfers: Sequence[Transfer]) -> None:
        """Post sends and recvs together, in order; fills each transfer's handles."""

    @abc.abstractmethod
    def done(self, transfer: Transfer) -> bool:
        """Whether a transfer has completed (never blocks)."""

    @abc.abstractmethod
    def wait(self, transfer: Transfer) -> None:
        """Make the compute that follows see the transfer's data; raises if it fails or times out."""

    def open_channels(self) -> None:  # noqa: B027  (most transports need nothing more)
        """Make what point-to-point messages need beyond the group; every rank of the group calls it once."""

    def complete(self, transfers: Sequence[Transfer]) -> None:
        """Block the host until every transfer is done (the end of a step); raises as wait() does."""
        for transfer in transfers:
            self.wait(transfer)

    # ---- collectives: each bounded by the timeout; ``what`` names it in a failure

    @abc.abstractmethod
    def all_gather(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]: ...

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """In place, from group rank ``src``."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, what: str, op: str = "sum") -> None:
        """In place; ``op`` is "sum" or "max"."""

    @abc.abstractmethod
    def start_all_reduce(self, tensor: torch.Tensor, what: str) -> Pending:
        """A sum all-reduce in place that runs while the caller goes on; wait() on the result."""

    @abc.abstractmethod
    def all_gather_object(self, value: object, what: str) -> list[Any]: ...

    def built(self, engine: object) -> None:  # noqa: B027  (only a dry run's transport keeps them)
        """An engine was built on this transport (a dry run reports on it: pipeengine.launcher.dry)."""

    def gather_header(self, row: torch.Tensor, what: str) -> list[torch.Tensor]:
        """The step header's rows (pipeengine.comm.calls) of every rank: an all_gather, but on a dry run's rank,
        where the other ranks' rows are what the dry run recorded of them (pipeengine.comm.fake)."""
        return self.all_gather(row, what)

    def computed_once(self, key: Hashable, compute: Callable[[], T]) -> T:
        """What every rank of the group computes alike from the same inputs (``key`` names them): ranks that are
        threads of one process share one result (the first computes it); elsewhere each rank computes its own."""
        return compute()

    def barrier(self, what: str) -> None:
        self.all_reduce(torch.zeros(1, device=self.control_device), what)

    @abc.abstractmethod
    def subgroup(self, ranks: Sequence[int]) -> Transport | None:
        """A group of some of this group's ranks; every rank calls it (in the same order): None outside it."""

    def side_channel(self) -> Transport:
        """A second group over the same ranks, for a thread of its own (a background checkpoint's): its collectives
        never meet this group's. Every rank calls it, in the same order."""
        made = self.subgroup(range(self.size))
        if made is None:  # every rank is in it
            raise RuntimeError(f"rank {self.rank} is missing from its own group's copy")
        return made

    def of_group(self, group: dist.ProcessGroup) -> Transport:
        """A transport of the same backend over another torch.distributed group this rank is in (a mesh's)."""
        raise ValueError(f"the {self.name} transport has no torch.distributed groups")

    def split(self, groups: Sequence[Sequence[int]]) -> Transport:
        """Every rank calls it with the same groups (ranks of this group): the transport of the one it is in."""
        mine = None
        for ranks in groups:  # every rank makes every group, in the same order, as torch.distributed requires
            made = self.subgroup(ranks)
            mine = made if made is not None else mine
        if mine is None:
            raise ValueError(f"rank {self.rank} is in none of the groups {[list(g) for g in groups]}")
        return mine

    def failed(self, what: str, began: float, error: BaseException) -> PeerError:
        return PeerError(
            f"rank {self.rank} of {self.name} group {list(self.ranks)}: {what} failed after "
            f"{time.monotonic() - began:.1f} s: {type(error).__name__}: {error}"
        )
