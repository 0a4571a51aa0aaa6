"""Joining torchrun's group: launch(fn, n) under torchrun (RANK, WORLD_SIZE, MASTER_ADDR set) runs fn in this process.

torchrun --max-restarts starts every rank again after a failure; its agent's store keeps the keys of the last
attempt's group (gloo's addresses, now dead: torch's own env:// joins on them, "Connection refused"), so each attempt
joins on keys of its own, under a prefix naming the attempt. Which attempt: on several machines a node restarted
by another node's failure does not count the restart (its TORCHELASTIC_RESTART_COUNT stays 0 while the failed
node's is 1), so the ranks read the attempt from the rendezvous instead, the round every agent joined (``attempt``):
with torchrun's c10d rendezvous, its state in the rendezvous store (its --rdzv-endpoint, read from the agent's
command line: the agent does not pass it on). Elsewhere (one machine's --standalone, or another rendezvous backend)
the restart count, right where there is one agent.

A rank torchrun started dies with its agent, however that is killed, as launch's ranks die with their launcher,
and what the rank starts dies with it (pipeengine.launcher.lifetime); the agent's own stop kills the rank's group.
"""

from __future__ import annotations

import atexit
import base64
import datetime
import io
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeengine.core import pending
from pipeengine.launcher.lifetime import children_end_with_me, die_with_parent

__all__ = ["attempt", "join", "rendezvous_round"]


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
        number, _ = attempt()
        if number or "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun's agent, whose store keeps every attempt's
            # keys: those of an earlier attempt's group name addresses that are gone ("Connection refused")
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            client = dist.TCPStore(  # type: ignore[attr-defined]
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world,
                is_master=not agent and rank == 0,
                timeout=wait,
                multi_tenant=True,
            )
            store = dist.PrefixStore(f"pipeengine/attempt-{number}", client)  # type: ignore[attr-defined]
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=wait)
        else:
            dist.init_process_group(backend, timeout=wait)
        atexit.register(_destroy_group)
    fn(*args)
    pending.finish()  # a background checkpoint's write, before torchrun's group goes


def attempt() -> tuple[int, str]:
    """Which of torchrun's attempts started this rank, the same on every node, and where it was read: the c10d
    rendezvous's round where there is one, else TORCHELASTIC_RESTART_COUNT (the module's docstring)."""
    found = rendezvous_round()
    if found is not None:
        return found, "the rendezvous round"
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "TORCHELASTIC_RESTART_COUNT"


def rendezvous_round(argv: Sequence[str] | None = None, timeout: float = 30.0) -> int | None:
    """The round of torchrun's c10d rendezvous this rank's agent joined (``argv``: the agent's command line, read
    from /proc where not given), or None where the agent runs no c10d rendezvous with an endpoint."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    if argv is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as cmdline:
                argv = [part.decode() for part in cmdline.read().split(b"\0") if part]
        except OSError:
            return None
    options = _options(argv)
    endpoint = options.get("rdzv_endpoint", "")
    if options.get("rdzv_backend") != "c10d" or not endpoint:
        return None
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "29400")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))  # type: ignore[attr-defined]
    state = _State(io.BytesIO(base64.b64decode(store.get(f"torch.rendezvous.{run_id}")))).load()
    return int(state.round)


def _options(argv: Sequence[str]) -> dict[str, str]:
    """torchrun's options in a command line, "--rdzv-endpoint H:P" and "--rdzv_endpoint=H:P" alike, by snake name."""
    found: dict[str, str] = {}
    for i, part in enumerate(argv):
        if part.startswith("--"):
            name, equals, value = part[2:].partition("=")
            if not equals and i + 1 < len(argv):
                value = argv[i + 1]
            found.setdefault(name.replace("-", "_"), value)
    return found


class _State(pickle.Unpickler):
    """The rendezvous state as torch's agents keep it (pickled): only its own classes, dates and sets are loaded
    (what a store holds is never run)."""

    RENDEZVOUS = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
    ALLOWED = {
        (RENDEZVOUS, "_RendezvousState"),
        (RENDEZVOUS, "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timedelta"),
        ("datetime", "timezone"),
        ("builtins", "set"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"the rendezvous state names {module}.{name}, which it never holds")
        return super().find_class(module, name)


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
