"""What each transport runs, without torch: the program it makes of a lowered schedule and the semantics it is
proved under. The transports (gloo, nccl, loopback) and the planner (pipeengine.planner.search) both read these.

    backend    program                      semantics    a compute waits            posting
    gloo       receives_first(lowered)      buffered     host, work.wait(timeout)   downward messages on a 2nd group
    nccl       as lowered                   rendezvous   comm stream -> compute     on a CUDA stream of its own
    loopback   as lowered                   buffered     host (threads)             in memory
    fake       as lowered                   rendezvous   nothing (a dry run)        nowhere: torch's fake group
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from schedules import Schedule, Semantics, receives_first

__all__ = ["BACKENDS", "Backend", "backend"]


def _as_lowered(schedule: Schedule) -> Schedule:
    return schedule


@dataclass(frozen=True)
class Backend:
    name: str
    program: Callable[[Schedule], Schedule]  # the streams it runs for a lowered schedule
    semantics: Semantics  # BUFFERED: a send is done once posted; RENDEZVOUS: once its recv is posted too


BACKENDS: dict[str, Backend] = {
    "gloo": Backend("gloo", receives_first, Semantics.BUFFERED),  # posting never blocks: every recv first
    "nccl": Backend("nccl", _as_lowered, Semantics.RENDEZVOUS),
    "loopback": Backend("loopback", _as_lowered, Semantics.BUFFERED),  # in-process ranks, messages copied
    "fake": Backend("fake", _as_lowered, Semantics.RENDEZVOUS),  # a dry run's rank, proved as NCCL runs it
}


def backend(name: str) -> Backend:
    """A backend by name; an unknown name is a ValueError listing the valid ones."""
    found = BACKENDS.get(name)
    if found is None:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return found
