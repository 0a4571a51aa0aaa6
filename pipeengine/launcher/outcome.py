"""How each rank of a run ended, and which rank caused a failure: shared by launch and the in-process loopback.

The cause is, in this order: a rank that died without a report (any exit code, any signal),
a rank that raised an error of its own, a rank that hung (still running after the others
stopped), and only then a rank that failed waiting on another (a PeerError: a consequence).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeengine.errors import LaunchError

__all__: list[str] = []


@dataclass
class Outcome:
    """One rank's end. ``error`` is the exception itself where it could be had (pickled across processes)."""

    rank: int
    when: float
    ok: bool = False
    error: BaseException | None = None
    summary: str = ""  # "ValueError: ..."
    trace: str = ""  # the formatted traceback
    waiting: bool = False  # it failed waiting on another rank (a PeerError): a consequence, not a cause
    fate: str = ""  # for a rank without a report: "died from signal SIGKILL", "was still running ..."
    died: bool = False  # it exited (by any code or signal) without a report


def raise_cause(outcomes: dict[int, Outcome], nprocs: int) -> None:
    """Re-raise the causing rank's error, with a note naming it and what every other rank saw; None if all ok."""
    failures = {rank: o for rank, o in outcomes.items() if not o.ok}
    if not failures:
        return

    def blame(item: tuple[int, Outcome]) -> tuple[int, float]:
        _, outcome = item
        if outcome.died:
            return (0, outcome.when)
        if outcome.fate:  # still running: it hung
            return (2, outcome.when)
        return (3 if outcome.waiting else 1, outcome.when)

    root, cause = min(failures.items(), key=blame)
    others = [f"  rank {r}: {o.summary or o.fate}" for r, o in sorted(failures.items()) if r != root]
    context = f"pipeengine.launcher.launch: rank {root} of {nprocs} is the cause"
    context += ("; what the other ranks saw:\n" + "\n".join(others)) if others else ""
    if cause.fate or cause.died:
        raise LaunchError(f"rank {root} {cause.fate or cause.summary}\n{context}")
    if cause.error is None:
        raise LaunchError(f"rank {root} raised {cause.summary}\n{cause.trace}\n{context}")
    cause.error.add_note(f"{context}\n\ntraceback on rank {root}:\n{cause.trace}")
    raise cause.error
