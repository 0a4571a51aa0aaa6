"""Transport: the one place that knows gloo from NCCL from the in-process loopback.

A Transport is one group of ranks as the engine uses it: the program a backend runs for a
lowered schedule and the semantics ``schedules.validate`` proves it under, how it posts
point-to-point messages, tests them and waits for them, and the few collectives the engine
needs (the step header, the loss, gradient all-reduces, checkpoints). Every wait, on every
backend, is bounded by the engine's timeout and fails as a PeerError saying what it waited for.

    backend    program                      semantics    a compute waits            posting
    gloo       receives_first(lowered)      buffered     host, work.wait(timeout)   downward messages on a 2nd group
    nccl       as lowered                   rendezvous   comm stream -> compute     on a CUDA stream of its own
    loopback   as lowered                   buffered     host (threads)             in memory (pipeengine.loopback)

``connect(group, device, timeout)`` reads the backend once and returns the transport.
"""

from __future__ import annotations

import abc
import datetime
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeengine.errors import PeerError
from pipeengine.streams import Streams
from schedules import Instruction, Schedule, Semantics, receives_first

__all__: list[str] = []

Tensors = tuple[torch.Tensor, ...]


@dataclass
class Transfer:
    """One posted send or recv: its instruction, its tensors, the peer's rank and the backend's handles."""

    op: Instruction
    tensors: Tensors
    peer: int
    handles: list[Any] = field(default_factory=list)


class Pending(abc.ABC):
    """An asynchronous collective (a gradient all-reduce): wait() blocks, within the timeout."""

    @abc.abstractmethod
    def wait(self) -> None: ...


class Transport(abc.ABC):
    """One group of ranks as the engine uses it. Every rank of the group calls each collective, in order."""

    name: str
    rank: int  # in this group
    size: int
    ranks: tuple[int, ...]  # the world ranks of the group, for messages
    device: torch.device
    timeout: float
    semantics: Semantics
    shared_clock: bool = False  # every rank reads one clock (threads of one process)
    group: dist.ProcessGroup | None = None  # the torch.distributed group, where there is one

    # ---- point to point, in the schedule's order

    @staticmethod
    @abc.abstractmethod
    def program(schedule: Schedule) -> Schedule:
        """The streams this transport runs for a lowered schedule (validated under ``semantics``)."""

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

    def barrier(self, what: str) -> None:
        self.all_reduce(torch.zeros(1, device=self.device), what)

    @abc.abstractmethod
    def subgroup(self, ranks: Sequence[int]) -> Transport | None:
        """A group of some of this group's ranks; every rank calls it (in the same order): None outside it."""

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


def connect(group: dist.ProcessGroup | None, device: torch.device | None, timeout: float) -> Transport:
    """The transport of a torch.distributed group (None: the default group), or of this thread's loopback world.

    ``device``: where the rank computes (default: the current CUDA device on NCCL, else the CPU).
    """
    from pipeengine.loopback import current

    local = current()
    if local is not None:
        if device is not None and device.type != "cpu":
            raise ValueError(f"in-process (loopback) ranks compute on the CPU, got device={device}")
        local.timeout = timeout
        return local
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: start the ranks with pipeengine.launch(fn, nprocs=N) "
            "or torchrun (and call torch.distributed.init_process_group)"
        )
    backend = dist.get_backend(group)
    if backend == "nccl":
        if device is not None and device.type != "cuda":
            raise ValueError(f"the process group uses NCCL, which moves CUDA tensors only; got device={device}")
        return NcclTransport(group, device or torch.device("cuda", torch.cuda.current_device()), timeout)
    if backend == "gloo":
        return GlooTransport(group, device or torch.device("cpu"), timeout)
    raise ValueError(f"pipeengine runs on gloo (CPU) or NCCL (CUDA) process groups, got backend {backend!r}")


class _Distributed(Transport):
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
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(self.device)
        sizes = self.all_gather(torch.tensor([data.numel()], device=self.device), what)
        longest = int(max(size.item() for size in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[: data.numel()] = data
        gathered = self.all_gather(padded, what)
        return [pickle.loads(g[: int(n.item())].cpu().numpy().tobytes()) for g, n in zip(gathered, sizes, strict=True)]

    def subgroup(self, ranks: Sequence[int]) -> Transport | None:
        made = dist.new_group([self.ranks[r] for r in ranks])
        return type(self)(made, self.device, self.timeout) if self.rank in ranks else None


@dataclass
class _Work(Pending):
    transport: _Distributed
    work: dist.Work
    what: str
    began: float

    def wait(self) -> None:
        self.transport.settle(self.work, self.what, self.began)


class GlooTransport(_Distributed):
    """CPU ranks on gloo: posting never blocks, so each step's recvs are all posted first.

    Messages to a lower rank travel on a second gloo group over the same ranks, so that each
    connection carries data one way. gloo's connection to a peer is one socket whose lock is
    shared by the thread that posts (a send writes inline) and gloo's I/O thread (which reads
    what arrives): when both ranks send to each other at once, as in 1F1B's steady state,
    posting waits for the reads. Measured with benchmarks/vs_torch.py --width 256: 1F1B 21.7 /
    22.7 ms a step on one group, 15.6 / 18.4 ms on two. A recv posted early costs only its
    buffer, while one posted mid-step contends with the I/O thread: on 2 CPU ranks posting took
    8-15 ms of a 170 ms GPipe step as lowered, 2.5-3.5 ms with the recvs first.
    """

    name = "gloo"
    semantics = Semantics.BUFFERED

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, timeout: float) -> None:
        super().__init__(group, device, timeout)
        self._wait_for = datetime.timedelta(seconds=timeout)
        self._down: dist.ProcessGroup | None = None

    @staticmethod
    def program(schedule: Schedule) -> Schedule:
        return receives_first(schedule)

    def open_channels(self) -> None:
        """The second group, for messages to a lower rank (without it, they share the first)."""
        if self._down is None and self.size > 1:
            self._down = second_group(self.ranks, self._wait_for)

    def post(self, transfers: Sequence[Transfer]) -> None:
        by_group: dict[int, tuple[dist.ProcessGroup | None, list[dist.P2POp], list[Transfer]]] = {}
        for transfer in transfers:
            is_send = transfer.op.kind.is_send
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


class NcclTransport(_Distributed):
    """CUDA ranks on NCCL: the lowered program as is; communication on a stream of its own.

    A wait before a compute is stream-ordered (the compute stream waits for the comm stream; the
    host goes on), so the host learns of a hung peer only at the end of the step: complete()
    polls every transfer of the step until the timeout, then raises, as every collective does.
    """

    name = "nccl"
    semantics = Semantics.RENDEZVOUS

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, timeout: float) -> None:
        super().__init__(group, device, timeout)
        self.streams = Streams(device)
        self._outstanding: list[tuple[dist.Work, float]] = []  # waited on the stream, not yet seen complete

    @staticmethod
    def program(schedule: Schedule) -> Schedule:
        return schedule

    def post(self, transfers: Sequence[Transfer]) -> None:
        ops = [
            dist.P2POp(dist.isend if t.op.kind.is_send else dist.irecv, tensor, group=self.group, group_peer=t.peer)
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
