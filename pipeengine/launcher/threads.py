"""In-process ranks: ``launch(fn, n, in_process=True)`` runs fn on n threads of this process, each a rank of one
loopback world (pipeengine.comm.loopback); the cause of a failure is re-raised as for processes."""

from __future__ import annotations

import ctypes
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipeengine.comm.loopback import INTERRUPTED, Hub, LoopbackTransport, bind
from pipeengine.core import pending
from pipeengine.errors import PeerError
from pipeengine.launcher.outcome import Outcome, raise_cause

__all__ = ["run"]


def run(fn: Callable[..., Any], nprocs: int, args: Sequence[Any], timeout: float, grace: float, threads: int) -> None:
    """Run ``fn(*args)`` on ``nprocs`` threads, each a rank of one loopback world; re-raise the cause of a failure.

    torch's intra-op pool has ``threads`` threads meanwhile (it is the process's, shared by the ranks).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _run(fn, nprocs, args, timeout, grace)
    finally:
        torch.set_num_threads(previous)


def _run(fn: Callable[..., Any], nprocs: int, args: Sequence[Any], timeout: float, grace: float) -> None:
    hub = Hub()
    outcomes: dict[int, Outcome] = {}

    def body(rank: int) -> None:
        bind(LoopbackTransport(hub, "world", tuple(range(nprocs)), rank, timeout))
        try:
            with hub.cond:  # one rank at a time until each first waits (see pipeengine.comm.loopback)
                hub.cond.wait_for(lambda: hub.turn >= rank)
            fn(*args)
            pending.finish()  # this rank's background checkpoint
            outcomes[rank] = Outcome(rank, time.time(), ok=True)
        except BaseException as error:  # noqa: BLE001  (report everything; the others are told at once)
            outcomes[rank] = Outcome(
                rank,
                time.time(),
                error=error,
                summary=f"{type(error).__name__}: {error}",
                trace=traceback.format_exc(),
                waiting=isinstance(error, PeerError),
            )
            hub.fail(rank, error)
        finally:
            bind(None)
            with hub.cond:
                hub.pass_turn(rank)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"pipeengine-rank-{r}", daemon=True) for r in range(nprocs)
    ]
    for thread in threads:
        thread.start()
    failed_at: float | None = None
    try:
        while any(thread.is_alive() for thread in threads):
            for thread in threads:
                thread.join(0.05)
            if failed_at is None and hub.failure is not None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace:
                break
    except KeyboardInterrupt:  # Ctrl-C: stop every rank, then re-raise here (never leave them training behind)
        stop(hub, threads, grace)
        raise
    for rank, thread in enumerate(threads):
        if thread.is_alive():  # a thread cannot be stopped: it is left behind as a daemon
            outcomes[rank] = Outcome(rank, time.time(), fate=f"was still running {grace:.0f} s after the first failure")
    raise_cause(outcomes, nprocs)


def stop(hub: Hub, threads: list[threading.Thread], grace: float) -> None:
    """Stop the rank threads: every wait on another rank fails at once, and each thread gets a KeyboardInterrupt
    at its next Python instruction (a kernel in flight finishes first); wait up to ``grace`` seconds for them."""
    hub.fail(INTERRUPTED, KeyboardInterrupt("interrupted (Ctrl-C)"))
    for thread in threads:
        if thread.is_alive() and thread.ident is not None:
            interrupt = ctypes.py_object(KeyboardInterrupt)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), interrupt)
    deadline = time.monotonic() + grace
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
