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


def cause(outcomes: dict[int, Outcome]) -> tuple[int, Outcome] | None:
    """The causing rank and its outcome (see the module), or None if every rank ended well."""
    failures = {rank: o for rank, o in outcomes.items() if not o.ok}
    if not failures:
        return None

    def blame(item: tuple[int, Outcome]) -> tuple[int, float]:
        _, outcome = item
        if outcome.died:
            return (0, outcome.when)
        if outcome.fate:  # still running: it hung
            return (2, outcome.when)
        return (3 if outcome.waiting else 1, outcome.when)

    return min(failures.items(), key=blame)


def describe(root: int, outcome: Outcome) -> str:
    """One line: the causing rank (``cause``'s) and what it did."""
    return f"rank {root} {outcome.fate or (outcome.summary if outcome.died else 'raised ' + outcome.summary)}"


def raise_cause(outcomes: dict[int, Outcome], nprocs: int, restarts: int = 0) -> None:
    """Re-raise the causing rank's error, with a note naming it and what every other rank saw; None if all ok.
    ``restarts``: how many times the ranks were started again before this run (said in the note)."""
    found = cause(outcomes)
    if found is None:
        return
    root, cause_ = found
    failures = {rank: o for rank, o in outcomes.items() if not o.ok}
    others = [f"  rank {r}: {o.summary or o.fate}" for r, o in sorted(failures.items()) if r != root]
    context = f"pipeengine.launcher.launch: rank {root} of {nprocs} is the cause"
    if restarts:
        context += f", in the last of {restarts + 1} runs (max_restarts={restarts} spent)"
    context += ("; what the other ranks saw:\n" + "\n".join(others)) if others else ""
    if cause_.fate or cause_.died:
        raise LaunchError(f"rank {root} {cause_.fate or cause_.summary}\n{context}")
    if cause_.error is None:
        raise LaunchError(f"rank {root} raised {cause_.summary}\n{cause_.trace}\n{context}")
    cause_.error.add_note(f"{context}\n\ntraceback on rank {root}:\n{cause_.trace}")
    raise cause_.error
