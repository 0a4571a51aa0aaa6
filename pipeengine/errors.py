"""Errors of the runtime: each names the rank, the instruction and what it was waiting on."""

from __future__ import annotations

__all__ = ["PipelineError", "PeerError", "LaunchError", "PlanError"]


class PipelineError(RuntimeError):
    """A step failed on this rank: the message names the rank, the step and the instruction."""


class PeerError(PipelineError):
    """Waiting on another rank failed (it died, raised, or did not answer within the timeout)."""


class PlanError(ValueError):
    """A parallelism plan found wrong by what a step computed (every rank finds it alike, and raises it): a
    ValueError, as a plan refused when the engine is built is; the step's context comes first in its message."""


class LaunchError(RuntimeError):
    """A launched rank failed (or died) and the others were stopped: the message names each rank's fate."""
