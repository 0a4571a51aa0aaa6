"""The in-process loopback: every rank a thread of this process, messages and collectives in memory.

``launch(fn, nprocs, in_process=True)`` runs ``fn`` on ``nprocs`` threads (pipeengine.launcher.threads);
a PipelineEngine built on such a thread talks to the others through a LoopbackTransport instead of
torch.distributed.
It runs the lowered program (what NCCL runs) under buffered semantics, copies every message,
and names the ranks that did not arrive when a collective times out. For tests and debugging:
no processes to spawn, and a debugger sees every rank. torch.distributed calls are not available
on them.

The ranks share one process, and so torch's one default random generator. So that the usual
pattern (``torch.manual_seed(0)``, then build the model) gives every rank the same model, the
ranks start one at a time, in rank order: each runs alone until it first waits on another rank
(its engine's first collective, which every rank joins) or ends, then the next starts. After
that they run together and draw from the one generator in no set order: draw data from a
``torch.Generator`` of your own.

    rank 0 thread ─ post(send) ─► hub.sent[(group, 0, 1)] = [msg0, msg1, ...] ─► wait(recv) ─ rank 1 thread
                                   recvs match sends in order on each channel
"""

from __future__ import annotations

import copy
import pickle
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeengine.comm.backends import BACKENDS
from pipeengine.comm.base import Pending, T, Transfer, Transport
from pipeengine.errors import PeerError

__all__ = ["INTERRUPTED", "Hub", "LoopbackTransport", "bind", "current"]

INTERRUPTED = -1  # the failing "rank" when the launching thread is interrupted (Ctrl-C)
_local = threading.local()  # the transport of the world this thread is a rank of (set by run())


def current() -> LoopbackTransport | None:
    """The loopback world's transport of this thread, if it is a rank of one."""
    return getattr(_local, "transport", None)


def bind(transport: LoopbackTransport | None) -> None:
    """Make this thread a rank of ``transport``'s world (None: of none)."""
    _local.transport = transport


@dataclass
class _Slot:
    """One collective's meeting point: each rank's contribution, then the result every rank reads."""

    key: tuple[str, int]
    values: dict[int, Any] = field(default_factory=dict)
    result: Any = None
    done: bool = False
    readers: int = 0


class Hub:
    """What the threads of one in-process world share."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.sent: dict[tuple[str, int, int], list[tuple[torch.Tensor, ...] | None]] = defaultdict(list)
        self.slots: dict[tuple[str, int], _Slot] = {}
        self.failure: tuple[int, str] | None = None  # (world rank, what it raised)
        self.turn = 0  # ranks below it have started: each runs alone until it first waits on another (or ends)
        self.once: dict[Any, Any] = {}  # computed_once's results, and the lock of the rank computing each
        self.once_lock = threading.Lock()

    def pass_turn(self, rank: int) -> None:
        """Rank ``rank`` waits on another rank (or has ended): the next rank may start. Holding cond."""
        if self.turn == rank:
            self.turn += 1
            self.cond.notify_all()

    def fail(self, rank: int, error: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = (rank, f"{type(error).__name__}: {error}")
            self.cond.notify_all()

    def await_(self, ready: Callable[[], bool], me: int, timeout: float, why: Callable[[], str]) -> None:
        """Wait (holding cond) until ``ready()``; raise if another rank failed or the timeout passes."""
        deadline = time.monotonic() + timeout
        if not ready():
            self.pass_turn(me)
        while not ready():
            if self.failure is not None and self.failure[0] != me:
                who = "the launch" if self.failure[0] == INTERRUPTED else f"rank {self.failure[0]}"
                raise PeerError(f"{who} failed: {self.failure[1]}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{why()} within timeout={timeout:g} s")
            self.cond.wait(min(remaining, 1.0))


class LoopbackTransport(Transport):
    backend = BACKENDS["loopback"]
    shared_clock = True

    def __init__(self, hub: Hub, gid: str, ranks: tuple[int, ...], rank: int, timeout: float) -> None:
        self.hub, self.gid, self.ranks, self.rank = hub, gid, ranks, rank
        self.size, self.device, self.timeout = len(ranks), torch.device("cpu"), timeout
        self._collectives = 0  # how many collectives this rank has entered on this group
        self._splits = 0
        self._posted: dict[int, int] = defaultdict(int)  # peer -> recvs posted from it

    def computed_once(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The ranks share one result: the first computes it while the others wait for it (under the GIL they would
        take turns computing it anyway)."""
        with self.hub.once_lock:
            entry = self.hub.once.setdefault((self.gid, key), [threading.Lock(), None, False])
        with entry[0]:
            if not entry[2]:
                entry[1], entry[2] = compute(), True
        return entry[1]  # type: ignore[no-any-return]

    def post(self, transfers: Sequence[Transfer]) -> None:
        with self.hub.cond:
            for transfer in transfers:
                if transfer.send:
                    message = tuple(t.detach().clone() for t in transfer.tensors)
                    self.hub.sent[(self.gid, self.rank, transfer.peer)].append(message)
                else:
                    transfer.handles = [self._posted[transfer.peer]]
                    self._posted[transfer.peer] += 1
            self.hub.cond.notify_all()

    def done(self, transfer: Transfer) -> bool:
        if transfer.send:
            return True  # buffered: a send is copied when posted
        index: int = transfer.handles[0]
        with self.hub.cond:
            return index < len(self.hub.sent[(self.gid, transfer.peer, self.rank)])

    def wait(self, transfer: Transfer) -> None:
        if transfer.send or not transfer.handles:
            return
        index, channel = transfer.handles[0], (self.gid, transfer.peer, self.rank)
        me = self.ranks[self.rank]
        with self.hub.cond:
            self.hub.await_(
                lambda: index < len(self.hub.sent[channel]),
                me,
                self.timeout,
                lambda: f"no message {index} from rank {transfer.peer}",
            )
            message, self.hub.sent[channel][index] = self.hub.sent[channel][index], None
        if message is None:
            raise RuntimeError(f"{transfer.what}: message {index} from rank {transfer.peer} was taken twice")
        if [(t.shape, t.dtype) for t in message] != [(t.shape, t.dtype) for t in transfer.tensors]:

            def specs(tensors: tuple[torch.Tensor, ...]) -> str:
                return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)

            raise ValueError(
                f"{transfer.what} received ({specs(message)}) where its buffers are ({specs(transfer.tensors)})"
            )
        for buffer, value in zip(transfer.tensors, message, strict=True):
            buffer.copy_(value)
        transfer.handles = []

    # ---- collectives: each rank's n-th collective on a group meets the others' n-th

    def _enter(self, value: Any) -> _Slot:
        key = (self.gid, self._collectives)
        self._collectives += 1
        with self.hub.cond:
            slot = self.hub.slots.setdefault(key, _Slot(key))
            slot.values[self.rank] = value
            self.hub.cond.notify_all()
        return slot

    def _result(self, slot: _Slot, combine: Callable[[list[Any]], Any], what: str, began: float) -> Any:
        me = self.ranks[self.rank]
        with self.hub.cond:
            try:
                self.hub.await_(
                    lambda: len(slot.values) == self.size,
                    me,
                    self.timeout,
                    lambda: (
                        f"ranks {[r for r in range(self.size) if r not in slot.values]} of the group did not arrive"
                    ),
                )
            except Exception as error:
                raise self.failed(what, began, error) from error
            if not slot.done:
                slot.result, slot.done = combine([slot.values[r] for r in range(self.size)]), True
            slot.readers += 1
            if slot.readers == self.size:  # the last reader clears the meeting point
                del self.hub.slots[slot.key]
            return slot.result

    def _collect(self, value: Any, combine: Callable[[list[Any]], Any], what: str) -> Any:
        began = time.monotonic()
        return self._result(self._enter(value), combine, what, began)

    def all_gather(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        values = self._collect(tensor.detach().clone(), list, what)
        return [value.clone() for value in values]

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        tensor.copy_(self._collect(tensor.detach().clone(), lambda values: values[src], what))

    def all_reduce(self, tensor: torch.Tensor, what: str, op: str = "sum") -> None:
        tensor.copy_(self._collect(tensor.detach().clone(), _REDUCE[op], what))

    def start_all_reduce(self, tensor: torch.Tensor, what: str) -> Pending:
        return _Started(self, self._enter(tensor.detach().clone()), tensor, what, time.monotonic())

    def all_gather_object(self, value: object, what: str) -> list[Any]:
        return copy.deepcopy(self._collect(pickle.loads(pickle.dumps(value)), list, what))

    def subgroup(self, ranks: Sequence[int]) -> Transport | None:
        self._splits += 1  # every rank counts its subgroups alike: the n-th is one group on every rank
        if self.rank not in ranks:
            return None
        world = tuple(self.ranks[r] for r in ranks)
        return LoopbackTransport(
            self.hub, f"{self.gid}.{self._splits}", world, list(ranks).index(self.rank), self.timeout
        )


def _stack_sum(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0].clone()
    for value in values[1:]:
        total += value
    return total


def _stack_max(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(values).amax(dim=0)


_REDUCE = {"sum": _stack_sum, "max": _stack_max}


@dataclass
class _Started(Pending):
    transport: LoopbackTransport
    slot: _Slot
    tensor: torch.Tensor
    what: str
    began: float

    def wait(self) -> None:
        self.tensor.copy_(self.transport._result(self.slot, _stack_sum, self.what, self.began))
