"""launch: run a function on N local ranks with torch.distributed initialised, or join torchrun's group.

    parent ── TCPStore(port 0) ──spawn──► rank 0 .. N-1: init_process_group(store) → fn(*args)
       ▲                                      │ success, or (exception, traceback, time)
       └──────────────── queue ◄──────────────┘
A failing rank exits at once, so its peers' pending transfers fail within a second
(gloo: "connection closed"); ranks that hang are stopped after a grace period. The
parent then re-raises the first failure, naming its rank and what each other rank saw.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import datetime
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue as queue_module
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeengine.engine import DEFAULT_TIMEOUT
from pipeengine.errors import LaunchError, PeerError

__all__ = ["launch"]

GRACE = 10.0  # seconds the other ranks get to stop by themselves after a failure


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    device: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    threads: int | None = None,
    reuse_memory: bool = True,
) -> None:
    """Run ``fn(*args)`` on ``nprocs`` local ranks, each with the default process group initialised.

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set) it joins that group and runs ``fn``
    in this process instead. ``device``: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank);
    default CUDA when there is a GPU for every rank. ``threads``: torch threads per CPU rank
    (default: the cores shared out). ``reuse_memory``: CPU ranks keep freed memory for reuse
    (see keep_freed_memory). Re-raises the failing rank's exception, with a note naming the rank
    and what every other rank was doing.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    device = device or ("cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < nprocs:
        raise ValueError(
            f"{nprocs} CUDA ranks need {nprocs} GPUs, this machine has {torch.cuda.device_count()}: "
            "NCCL cannot run two ranks on one GPU; use fewer ranks or device='cpu'"
        )
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        if device == "cpu" and reuse_memory:
            keep_freed_memory()
        _join_torchrun(fn, nprocs, args, device, timeout)
        return
    threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
    context = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, nprocs + 1, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    reports: multiprocessing.Queue[_Report] = context.Queue()
    children = [
        context.Process(
            target=_child,
            args=(rank, nprocs, store.port, fn, tuple(args), device, timeout, threads, reuse_memory, reports),
            name=f"pipeengine-rank-{rank}",
        )
        for rank in range(nprocs)
    ]
    started: list[multiprocessing.process.BaseProcess] = []
    try:
        for child in children:
            child.start()  # spawn fails here if the caller's script lacks `if __name__ == "__main__":`
            started.append(child)
        outcome = _supervise(children, reports)
    finally:
        _stop(started)
    _raise_failure(outcome, nprocs)


def _join_torchrun(fn: Callable[..., Any], nprocs: int, args: Sequence[Any], device: str, timeout: float) -> None:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", nprocs))
    if local_world != nprocs:
        raise ValueError(
            f"launch(nprocs={nprocs}) runs under torchrun with {local_world} processes per node; "
            "make them agree (torchrun --nproc-per-node N)"
        )
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        # once per process: a second init against torchrun's store could read the first one's stale
        # addresses and hang, so the group stays for later launch() calls and goes at exit
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        atexit.register(_destroy_group)
    fn(*args)


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory in the process instead of returning it to the OS.

    By default glibc serves blocks of 128 KiB and more (a micro-batch's activation, a weight's
    gradient) from fresh mmap pages and gives them back when freed, so every step pays page
    faults to touch them again. With no mmap below 1 GiB and no trimming, freed blocks are
    reused, as PyTorch's CUDA caching allocator does on the GPU (and torch.backends.xeon's
    launcher does by preloading tcmalloc). Measured here: about 20% off a CPU pipeline step.
    The cost: a rank keeps its peak memory. Returns False where there is no glibc.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, (1 << 31) - 1))


@dataclass
class _Report:
    rank: int
    when: float
    error: bytes | None = None  # the pickled exception, if it pickles
    summary: str = ""  # "ValueError: ..."
    trace: str = ""  # formatted traceback
    ok: bool = False
    waiting: bool = False  # it failed waiting on another rank (a PeerError): a consequence, not a cause


def _child(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    device: str,
    timeout: float,
    threads: int,
    reuse_memory: bool,
    reports: multiprocessing.Queue[_Report],
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        if device == "cpu":
            torch.set_num_threads(threads)
            if reuse_memory:
                keep_freed_memory()
        else:
            torch.cuda.set_device(rank)
        wait = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=wait)  # type: ignore[attr-defined]
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=world, timeout=wait
        )
        fn(*args)
        dist.destroy_process_group()
        reports.put(_Report(rank, time.time(), ok=True))
    except BaseException as error:  # noqa: BLE001  (report everything, then exit at once)
        try:
            payload: bytes | None = pickle.dumps(error)
        except Exception:  # noqa: BLE001  (an exception that does not pickle is reported as text)
            payload = None
        summary = f"{type(error).__name__}: {error}"
        waiting = isinstance(error, PeerError)
        reports.put(_Report(rank, time.time(), payload, summary, traceback.format_exc(), waiting=waiting))
        reports.close()
        reports.join_thread()
        os._exit(1)  # at once: the peers' transfers fail fast instead of waiting out their timeout


def _supervise(
    children: Sequence[multiprocessing.process.BaseProcess], reports: multiprocessing.Queue[_Report]
) -> dict[int, _Report | str]:
    """Wait for every child; after the first failure give the others GRACE seconds, then stop them."""
    outcome: dict[int, _Report | str] = {}
    failed_at: float | None = None
    while True:
        if not _drain(reports, outcome) and failed_at is None:
            failed_at = time.monotonic()
        alive = [c for c in children if c.is_alive()]
        for rank, child in enumerate(children):
            if not child.is_alive() and rank not in outcome and child.exitcode not in (0, None):
                failed_at = failed_at or time.monotonic()
        if not alive or (failed_at is not None and time.monotonic() - failed_at > GRACE):
            break
        multiprocessing.connection.wait([c.sentinel for c in alive], timeout=0.2)
    time.sleep(0.1)  # let the queue deliver reports sent just before exit
    _drain(reports, outcome)
    for rank, child in enumerate(children):
        if rank in outcome:
            continue
        if child.is_alive():
            outcome[rank] = f"was still running {GRACE:.0f} s after the first failure and was stopped"
        elif child.exitcode is not None and child.exitcode < 0:
            outcome[rank] = f"died from signal {signal.Signals(-child.exitcode).name}"
        elif child.exitcode:
            outcome[rank] = f"exited with code {child.exitcode} without a report"
    return outcome


def _drain(reports: multiprocessing.Queue[_Report], outcome: dict[int, _Report | str]) -> bool:
    """Move the reports that have arrived into ``outcome``; False if one of them is a failure."""
    ok = True
    try:
        while True:
            report = reports.get_nowait()
            outcome[report.rank] = report
            ok = ok and report.ok
    except queue_module.Empty:
        return ok


def _stop(children: Sequence[multiprocessing.process.BaseProcess]) -> None:
    for child in children:
        if child.is_alive():
            child.terminate()
    deadline = time.monotonic() + 5
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join()


def _raise_failure(outcome: dict[int, _Report | str], nprocs: int) -> None:
    failures = {r: o for r, o in outcome.items() if not (isinstance(o, _Report) and o.ok)}
    if not failures:
        return

    def blame(item: tuple[int, _Report | str]) -> tuple[int, float]:
        """Most likely cause first: a death, then an error of its own, then a hang, then a failed wait."""
        rank, fate = item
        if isinstance(fate, str):
            return (0 if fate.startswith("died") else 2, 0.0)
        return (3 if fate.waiting else 1, fate.when)

    root, cause = min(failures.items(), key=blame)
    others = [
        f"  rank {r}: {o.summary if isinstance(o, _Report) else o}" for r, o in sorted(failures.items()) if r != root
    ]
    context = f"pipeengine.launch: rank {root} of {nprocs} is the cause"
    context += ("; what the other ranks saw:\n" + "\n".join(others)) if others else ""
    if isinstance(cause, str):
        raise LaunchError(f"rank {root} {cause}\n{context}")
    error: BaseException | None = None
    if cause.error is not None:
        try:
            error = pickle.loads(cause.error)
        except Exception:  # noqa: BLE001
            error = None
    if error is None:
        raise LaunchError(f"rank {root} raised {cause.summary}\n{cause.trace}\n{context}")
    error.add_note(f"{context}\n\ntraceback on rank {root}:\n{cause.trace}")
    raise error
