"""launch: run a function on N local ranks with torch.distributed initialised, or join torchrun's group.

    parent ── TCPStore(127.0.0.1) ──spawn──► rank 0 .. N-1: init_process_group(store) → fn(*args)
       ▲                                         │ success, or (exception, traceback, time)
       └─────────────────── queue ◄──────────────┘
A failing rank exits at once, so its peers' pending transfers fail within a second
(gloo: "connection closed"); ranks that hang are stopped after a grace period. The
parent then re-raises the cause (see pipeengine.launcher.outcome), naming its rank and what each
other rank saw. Each rank dies with its launcher, however that dies, and what a rank starts dies with the rank
(pipeengine.launcher.lifetime).
With ``in_process=True`` the ranks are threads of this process instead (pipeengine.comm.loopback).
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
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeengine.core import pending
from pipeengine.core.config import DEFAULT_TIMEOUT
from pipeengine.errors import PeerError
from pipeengine.launcher.lifetime import children_end_with_me, die_with_parent
from pipeengine.launcher.outcome import Outcome, cause, describe, raise_cause
from pipeengine.launcher.torchrun import join

__all__ = ["launch"]

GRACE = 10.0  # seconds the other ranks get to stop by themselves after a failure
# what the fork server imports once for every rank it forks: torch, and the parts a rank would otherwise import for
# seconds of CPU each (DTensor for tensor parallel and FSDP; dynamo, which meta-device shape inference and
# torch.compile load), then this package
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.tensor", "pipeengine"]


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    device: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    threads: int | None = None,
    reuse_memory: bool = True,
    in_process: bool = False,
    grace: float = GRACE,
    max_restarts: int = 0,
) -> None:
    """Run ``fn(*args)`` on ``nprocs`` local ranks, each with the default process group initialised.

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set) it joins that group and runs ``fn``
    in this process instead. ``device``: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank);
    default CUDA when there is a GPU for every rank. ``threads``: torch threads per CPU rank
    (default: the cores shared out). ``reuse_memory``: CPU ranks keep freed memory for reuse
    (see keep_freed_memory). Re-raises the failing rank's exception, with a note naming the rank
    and what every other rank was doing; the others get ``grace`` seconds to stop by themselves.
    ``max_restarts``: after a failure (a rank raised, died or hung), report the cause on stderr,
    stop every rank and start them all again as fresh processes, at most this many times; ``fn``
    resumes from its last checkpoint (docs/guides/checkpoints.md). Under torchrun, its own
    --max-restarts does this. A checkpoint still being written in the background is finished
    before a rank ends (pipeengine.core.pending).
    A rank whose ``fn`` returned exits without tearing down its interpreter: close the files it
    writes (see _exit).

    With PIPEENGINE_DRY_RUN_WORLD=N in the environment (and PIPEENGINE_DRY_RUN_RANKS=0,7,...), ``launch`` runs
    no rank: it prints a dry run of those ranks of a world of N, ``nprocs`` a node (pipeengine.launcher.dry).

    ``in_process=True`` runs the ranks as threads of this process, over an in-memory transport
    (CPU only; no torch.distributed): for tests and debugging, see pipeengine.comm.loopback. They share
    torch's thread pool, of ``threads`` threads while they run.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    if max_restarts and in_process:
        raise ValueError(
            "in-process ranks are threads of this process and cannot start afresh: max_restarts needs "
            "processes (in_process=False)"
        )
    if os.environ.get("PIPEENGINE_DRY_RUN_WORLD") and os.environ.get("PIPEENGINE_DRY_RUN") != "1":
        from pipeengine.launcher.dry import from_environment  # a dry run of the job, asked by its environment

        print(from_environment(fn, nprocs, args), flush=True)
        return
    if in_process:
        if device not in (None, "cpu"):
            raise ValueError(f"in-process ranks compute on the CPU, got device={device!r}")
        from pipeengine.launcher.threads import run

        run(fn, nprocs, args, timeout, grace, threads or max(1, (os.cpu_count() or 1) // nprocs))
        return
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
        join(fn, nprocs, args, device, timeout)
        return
    threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
    for attempt in range(max_restarts + 1):
        outcomes = _run_once(fn, nprocs, tuple(args), device, timeout, threads, reuse_memory, grace)
        found = cause(outcomes)
        if found is None or attempt == max_restarts:
            raise_cause(outcomes, nprocs, restarts=attempt)
            return
        trace = f"\n{found[1].trace.rstrip()}" if found[1].trace else ""
        print(
            f"pipeengine.launcher.launch: {describe(*found)}; every rank stopped, starting all {nprocs} again "
            f"(restart {attempt + 1} of max_restarts={max_restarts}){trace}",
            file=sys.stderr,
            flush=True,
        )


def _run_once(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...],
    device: str,
    timeout: float,
    threads: int,
    reuse_memory: bool,
    grace: float,
) -> dict[int, Outcome]:
    """Start the ranks as fresh processes, wait for them all (stopping the others after a failure): their ends."""
    context = _context()
    store = _local_store(nprocs + 1)
    reports: multiprocessing.Queue[Outcome] = context.Queue()
    children = [
        context.Process(
            target=_child,
            args=(rank, nprocs, store.port, fn, args, device, timeout, threads, reuse_memory, reports, os.getpid()),
            name=f"pipeengine-rank-{rank}",
        )
        for rank in range(nprocs)
    ]
    started: list[multiprocessing.process.BaseProcess] = []
    try:
        for child in children:
            child.start()  # spawn fails here if the caller's script lacks `if __name__ == "__main__":`
            started.append(child)
        return _supervise(children, reports, grace)
    finally:
        _stop(started)


def _local_store(world: int) -> dist.TCPStore:  # type: ignore[name-defined]
    """The ranks' rendezvous store, listening on the loopback interface only: every rank is on this machine.

    TCPStore binds every interface whatever its host name says (anyone on the network could join the group or
    write its keys), so it is given a socket already bound to 127.0.0.1 (master_listen_fd), which it then owns.
    """
    listener = socket.create_server(("127.0.0.1", 0), backlog=world)
    port = listener.getsockname()[1]
    # the store closes the socket: a socket object still holding it would close its number again, maybe another file
    # by then (should the store fail to start, it is left open rather than risk that)
    fd = listener.detach()
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        port,
        world,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=fd,
    )


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory in the process instead of returning it to the OS.

    By default glibc serves blocks of 128 KiB and more (a micro-batch's activation, a weight's
    gradient) from fresh mmap pages and gives them back when freed, so every step pays page
    faults to touch them again. With no mmap below 1 GiB and no trimming, freed blocks are
    reused, as PyTorch's CUDA caching allocator does on the GPU (and torch.backends.xeon's
    launcher does by preloading tcmalloc): it takes about a fifth off a CPU pipeline step
    (docs/benchmarks.md).
    The cost: a rank keeps its peak memory. Returns False where there is no glibc.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, (1 << 31) - 1))


def _context() -> multiprocessing.context.SpawnContext | multiprocessing.context.ForkServerContext:
    """How ranks start: from a fork server that imported torch once (each rank would otherwise spend about a second
    of CPU importing it), where there is one (Linux, macOS); else spawned. Either way a rank starts as a fresh
    interpreter would: it imports the caller's main module (guard it with `if __name__ == "__main__":`)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    multiprocessing.set_forkserver_preload(PRELOAD + _callers_models())
    return multiprocessing.get_context("forkserver")


def _callers_models() -> list[str]:
    """Hugging Face modelling modules the caller has imported (about 1.5 s of CPU each rank would spend importing
    them again): the fork server imports them too. The fork server starts at the first launch of a process, so what
    the caller imports after that, each rank imports itself."""
    if "transformers" not in sys.modules:
        return []
    models = sorted(name for name in sys.modules if name.startswith("transformers.models.") and ".modeling_" in name)
    return ["transformers", "transformers.masking_utils", *models]


def _release_fork_server() -> None:
    """Close this rank's copy of the launcher's keep-alive pipe to the fork server.

    multiprocessing hands every process the fork server starts the write end of that pipe (so that it
    may start processes of its own); the fork server exits when every write end is closed. Ranks
    holding one would keep it alive after the launcher dies, and their parent-death signal, which
    follows the fork server, would never fire. Without it a rank that starts processes from a fork
    server gets one of its own.
    """
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


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
    reports: multiprocessing.Queue[Outcome],
    parent: int,
) -> None:
    _release_fork_server()
    die_with_parent(parent)
    children_end_with_me()  # DataLoader workers, their fork server, any subprocess: killed as this rank ends
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
        if device == "cpu":  # every rank's gloo mesh connected before any rank may finish: a rank whose fn returns at
            dist.barrier()  # once would otherwise exit while a peer's connectFullMesh still waits on it (it failed so)
        fn(*args)
        pending.finish()  # a checkpoint written in the background completes (or fails: the rank's failure)
        dist.destroy_process_group()
        reports.put(Outcome(rank, time.time(), ok=True))
        _exit(0)
    except BaseException as error:  # noqa: BLE001  (report everything, then exit at once)
        try:
            pickle.dumps(error)
            sent: BaseException | None = error
        except Exception:  # noqa: BLE001  (an exception that does not pickle is reported as text)
            sent = None
        summary = f"{type(error).__name__}: {error}"
        waiting = isinstance(error, PeerError)
        reports.put(
            Outcome(rank, time.time(), error=sent, summary=summary, trace=traceback.format_exc(), waiting=waiting)
        )
        reports.close()
        reports.join_thread()
        os._exit(1)  # at once: the peers' transfers fail fast instead of waiting out their timeout


def _exit(code: int) -> None:
    """End a rank whose ``fn`` returned as a forked multiprocessing child ends.

    Its other threads are waited for, the atexit handlers run (logging, weakref finalizers,
    multiprocessing's queues: the report arrives), the standard streams are flushed, then
    os._exit. The interpreter is not torn down (with torch loaded, about a second of CPU per
    rank): an object still alive is not finalized, so a file that ``fn`` left open is not
    flushed. Close what you write (a ``with`` block).
    """
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize does first; multiprocessing calls it
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(code)


def _supervise(
    children: Sequence[multiprocessing.process.BaseProcess], reports: multiprocessing.Queue[Outcome], grace: float
) -> dict[int, Outcome]:
    """Wait for every child; after the first failure give the others ``grace`` seconds, then stop them.

    A child that exits without a report, with any code (0 too, e.g. os._exit(0) mid-run) or
    signal, failed: it died, and it is the cause ahead of every survivor's error.
    """
    outcomes: dict[int, Outcome] = {}
    failed_at: float | None = None
    while True:
        if not _drain(reports, outcomes) and failed_at is None:
            failed_at = time.monotonic()
        alive = [c for c in children if c.is_alive()]
        if failed_at is None and any(not c.is_alive() and r not in outcomes for r, c in enumerate(children)):
            time.sleep(0.1)  # a report sent just before exit may still be in the pipe
            _drain(reports, outcomes)
            if any(not c.is_alive() and r not in outcomes for r, c in enumerate(children)):
                failed_at = time.monotonic()
        if not alive or (failed_at is not None and time.monotonic() - failed_at > grace):
            break
        multiprocessing.connection.wait([c.sentinel for c in alive], timeout=0.2)
    if len(outcomes) < len(children):  # a report sent just before exit may still be in the pipe: give it a moment
        time.sleep(0.1)
        _drain(reports, outcomes)
    now = time.time()
    for rank, child in enumerate(children):
        if rank in outcomes:
            continue
        if child.is_alive():
            outcomes[rank] = Outcome(
                rank, now, fate=f"was still running {grace:.0f} s after the first failure and was stopped"
            )
        elif child.exitcode is not None and child.exitcode < 0:
            name = signal.Signals(-child.exitcode).name
            outcomes[rank] = Outcome(rank, now, summary=f"died from signal {name}", died=True)
        else:
            outcomes[rank] = Outcome(
                rank, now, summary=f"exited with code {child.exitcode} without a report", died=True
            )
    return outcomes


def _drain(reports: multiprocessing.Queue[Outcome], outcomes: dict[int, Outcome]) -> bool:
    """Move the reports that have arrived into ``outcomes``; False if one of them is a failure."""
    ok = True
    try:
        while True:
            report = reports.get_nowait()
            outcomes[report.rank] = report
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
