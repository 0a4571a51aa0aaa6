"""Joining torchrun's group: launch(fn, n) under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set) runs fn in this process.

torchrun --max-restarts starts every rank again after a failure; its agent's store keeps the keys of the last
attempt's group (gloo's addresses, now dead), so an attempt after the first joins on keys of its own. On several
machines a node restarted by another node's failure does not count the restart (TORCHELASTIC_RESTART_COUNT):
there the attempts cannot be told apart (docs/guides/checkpoints.md: Restarts).

A rank torchrun started dies with its agent, however that is killed, as launch's ranks die with their launcher,
and what the rank starts dies with it (pipeengine.launcher.lifetime); the agent's own stop kills the rank's group.
"""

from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeengine.core import pending
from pipeengine.launcher.lifetime import children_end_with_me, die_with_parent

__all__ = ["join"]


def join(fn: Callable[..., Any], nprocs: int, args: Sequence[Any], device: str, timeout: float) -> None:
    """Run ``fn(*args)`` in this process as a rank of torchrun's group (joined once per process), then finish what it
    left pending."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", nprocs))
    if local_world != nprocs:
        raise ValueError(
            f"launch(nprocs={nprocs}) runs under torchrun with {local_world} processes per node; "
            "make them agree (torchrun --nproc-per-node N)"
        )
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun's agent, our parent (another launcher that sets
        # RANK, ... may mean its ranks to outlive their parent). An agent gone before this line (while this process
        # imported) is not seen: the rank then cannot reach the agent's store, and its timeout stops it
        die_with_parent()
        children_end_with_me()
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        # once per process: a second init against torchrun's store could read the first one's stale
        # addresses and hang, so the group stays for later launch() calls and goes at exit
        wait = datetime.timedelta(seconds=timeout)
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart:  # torchrun started the ranks again (--max-restarts): its agent's store still holds the keys of the
            # last attempt's group, whose addresses are gone; gloo would connect to them ("Connection refused")
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,  # type: ignore[attr-defined]
                                   is_master=not agent and rank == 0, timeout=wait, multi_tenant=True)  # fmt: skip
            store = dist.PrefixStore(f"pipeengine/attempt-{restart}", client)  # type: ignore[attr-defined]
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=wait)
        else:
            dist.init_process_group(backend, timeout=wait)
        atexit.register(_destroy_group)
    fn(*args)
    pending.finish()  # a background checkpoint's write, before torchrun's group goes


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
