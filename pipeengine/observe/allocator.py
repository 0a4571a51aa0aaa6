"""The allocator's view: every byte torch allocates over a block, not only what the ledger counts.

    with AllocatorWatch(device) as watch:      # CUDA: the caching allocator's peak statistics
        ...                                    # CPU: torch.profiler's memory events, every allocation and free
    watch.peak, watch.end                      # bytes above the level at the block's start: the most, and at its end

    with AllocatorWatches(device) as watches:  # several blocks in one session (the planner's computes of a layer)
        with watches.block("F"): ...
    watches.peak["F"], watches.end["F"]

On CPU, a block that frees memory allocated before the watch began makes torch's allocator log
"Memory block of unknown size was allocated before the profiling started" (C++, to fd 2, at the
first such free of the process and every 1000th after); ``AllocatorWatch(device, quiet=True)``
drops that line from what the block writes to fd 2 and passes the rest on when the block ends
(the planner's watches: one layer's compute each).

On CPU, a collective launched in the block and still running when it ends is waited for before the
profiler stops: gloo runs a collective on its own thread, which reports to the profiler that was on
when it was launched, and one that reports after the profiler stopped corrupts memory (a crash, at
random).

On CPU the profiler sees one process: in-process (loopback) ranks share one, so there it cannot
tell ranks apart (``AllocatorWatch.available`` says where it works).

On CPU torch sizes a free by its record of the block last allocated at that address while a profiler ran; a block
freed while none ran leaves its record, so a lone watch that frees memory allocated outside any watch counts it at
the size of whatever block once held its address (a stale size), or at nothing: what it measures hangs on what the
process watched before. ``AllocatorWatches`` runs one profiler through a session of blocks and counts a block's free
only where a block of the session allocated the memory (its own, or an earlier block's still held), never memory
allocated outside every block: the same measurement whatever the process watched before. ``live_bytes`` is what a set
of tensors holds (each storage once): the level a watch's deltas sit on.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

import torch

from pipeengine.core.dtensors import local

__all__ = ["AllocatorWatch", "AllocatorWatches", "live_bytes", "optimizer_step_peak", "training_bytes"]


@contextlib.contextmanager
def _stderr_to(sink: int) -> Iterator[None]:
    """The process's fd 2 (what C++ writes too) goes to file descriptor ``sink`` for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(sink, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Starting and stopping the profiler, kineto writes a line to the process's stderr (fd 2) each time, which no
    setting silences: send fd 2 to /dev/null for those two calls only."""
    with open(os.devnull, "w") as null, _stderr_to(null.fileno()):
        yield


UNKNOWN_FREE = b"Memory block of unknown size was allocated before the profiling started"


@contextlib.contextmanager
def _dropping(noise: bytes) -> Iterator[None]:
    """fd 2 into a temporary file for the block; then what was written there goes on to fd 2, less the lines that
    hold ``noise``."""
    with tempfile.TemporaryFile() as caught:
        try:
            with _stderr_to(caught.fileno()):
                yield
        finally:
            caught.seek(0)
            kept = b"".join(line for line in caught.read().splitlines(keepends=True) if noise not in line)
            while kept:
                kept = kept[os.write(2, kept) :]


def _unwaited() -> int:
    """Functional collectives (DTensor's) launched and not yet waited on: c10d's work registry; 0 before any exists."""
    count = getattr(torch._C, "_distributed_c10d", None)
    if "torch.distributed._functional_collectives" not in sys.modules or count is None:
        return 0
    return int(count._get_work_registry_size())


def _wait_every_unwaited() -> None:
    """Wait for every asynchronous collective's tensor alive in the process and not yet waited on, found by the
    garbage collector (slow: only where a watched block left one running). The computes the engine watches settle
    what they make (pipeengine.core.dtensors.settle); what torch keeps beyond them is found here: a checkpointed
    stage's input-gradient pass stops its recompute early, keeping a RowwiseParallel output for the weight pass."""
    module = sys.modules["torch.distributed._functional_collectives"]
    for found in gc.get_objects():  # type(), not isinstance: some objects warn when asked their __class__
        if issubclass(type(found), module.AsyncCollectiveTensor) and not found.completed:
            found.trigger_wait()


def live_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind these tensors (None and empty ones skipped)."""
    sizes: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None and tensor.numel():
            storage = local(tensor, wait=False).untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


class AllocatorWatch:
    """The peak and the end level of what torch allocates in a block, above the level at its start (bytes)."""

    def __init__(self, device: torch.device, *, quiet: bool = False) -> None:
        self.device = device
        self.quiet = quiet  # CPU: drop the allocator's line on a free it cannot size (the module docstring)
        self.peak = 0
        self.end = 0
        self._profile: torch.profiler.profile | None = None
        self._start = 0
        self._unwaited = 0
        self._filter = contextlib.ExitStack()

    @staticmethod
    def available(device: torch.device, shared_process: bool) -> bool:
        """Whether a watch sees this rank's allocations alone (not on ranks that are threads of one process)."""
        return device.type == "cuda" or (device.type == "cpu" and not shared_process)

    def __enter__(self) -> AllocatorWatch:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._unwaited = _unwaited()
            self._profile = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            if self.quiet:
                self._filter.enter_context(_dropping(UNKNOWN_FREE))
            try:
                with _quiet():
                    self._profile.__enter__()
            except BaseException:
                self._filter.close()
                raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: object, trace: TracebackType | None) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
            self.end = torch.cuda.memory_allocated(self.device) - self._start
            return
        if self._profile is None:
            raise RuntimeError("AllocatorWatch exited without being entered")
        if _unwaited() > self._unwaited:  # launched in the block and still running: wait before the profiler stops
            _wait_every_unwaited()
        with self._filter, _quiet():
            self._profile.__exit__(kind, value, trace)
        if kind is not None:
            return
        events = [e for e in self._profile.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
        events.sort(key=lambda e: e.start_ns())
        level = peak = 0
        for event in events:
            if str(event.device_type()).endswith("CPU"):
                level += event.nbytes()  # type: ignore[union-attr]  # memory events carry it
                peak = max(peak, level)
        self.peak, self.end = peak, level


class AllocatorWatches:
    """Blocks watched in one session (the module docstring): ``with watches.block(name):`` around each, then, after
    the session, ``peak[name]`` and ``end[name]``, bytes above the level at the block's start, as AllocatorWatch's
    (a name's last block, where several had it)."""

    def __init__(self, device: torch.device, *, quiet: bool = False) -> None:
        self.device = device
        self.peak: dict[str, int] = {}
        self.end: dict[str, int] = {}
        self._session = AllocatorWatch(device, quiet=quiet) if device.type != "cuda" else None
        self._blocks: list[str] = []  # each block's name, in order: the profiler's label for it is its index

    def __enter__(self) -> AllocatorWatches:
        if self._session is not None:
            self._session.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: object, trace: TracebackType | None) -> None:
        if self._session is None:
            return
        self._session.__exit__(kind, value, trace)
        if kind is None:
            self._count(self._session._profile.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]

    @contextlib.contextmanager
    def block(self, name: str) -> Iterator[None]:
        if self._session is None:  # CUDA: the caching allocator's statistics, block by block
            with AllocatorWatch(self.device) as watch:
                yield
            self.peak[name], self.end[name] = watch.peak, watch.end
            return
        self._blocks.append(name)
        with torch.profiler.record_function(f"{_BLOCK}{len(self._blocks) - 1}"):
            yield

    def _count(self, roots: list[Any]) -> None:
        """Each block's peak and end from the session's allocations: a free counts where a block allocated it."""
        events, spans, todo = [], [(0, 0)] * len(self._blocks), list(roots)
        while todo:
            event = todo.pop()
            todo += event.children
            if event.name.startswith(_BLOCK):
                spans[int(event.name.removeprefix(_BLOCK))] = (event.start_time_ns, event.end_time_ns)
                continue
            fields = event.extra_fields
            if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
                events.append((event.start_time_ns, fields.ptr, fields.alloc_size))
        events.sort(key=lambda e: e[0])
        held: dict[int, int | None] = {}  # address -> the block that allocated what is there (None: none did)
        peak, end = [0] * len(spans), [0] * len(spans)
        for time, address, size in events:
            inside = next((block for block, (start, stop) in enumerate(spans) if start <= time <= stop), None)
            if size > 0:
                held[address] = inside
            elif held.pop(address, None) is None:
                continue  # memory no block allocated: not counted
            if inside is not None:
                end[inside] += size
                peak[inside] = max(peak[inside], end[inside])
        for block, name in enumerate(self._blocks):
            self.peak[name], self.end[name] = peak[block], end[block]


_BLOCK = "pipeengine.allocator.block."


def training_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> int:
    """What training holds of these parameters now: them, their gradients and the optimizer's state for them."""
    params = list(params)
    state = optimizer.state if optimizer is not None else {}
    held = [v for p in params for v in state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return live_bytes([*params, *(p.grad for p in params), *held])


def optimizer_step_peak(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> float:
    """Run ``optimizer.step()`` watched: what it holds at its peak (its parameters, their gradients and its state
    live at its start, plus the most it allocates), the figure to set beside a step's ``allocated_peak``."""
    params = list(params)
    live = training_bytes(params, optimizer)
    with AllocatorWatch(local(params[0]).device if params else torch.device("cpu")) as watch:
        optimizer.step()
    return float(live + watch.peak)
