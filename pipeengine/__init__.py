"""pipeengine: pipeline-parallel training of an nn.Sequential, executing `schedules` across ranks."""

from pipeengine.checkpoint import consolidate
from pipeengine.config import DEFAULT_TIMEOUT, EngineConfig
from pipeengine.engine import PipelineEngine
from pipeengine.errors import LaunchError, PeerError, PipelineError
from pipeengine.launch import launch
from pipeengine.partition import METHODS, Partition, plan, solve
from pipeengine.profile import LayerCosts, measure

__all__ = [
    "DEFAULT_TIMEOUT",
    "EngineConfig",
    "LaunchError",
    "PeerError",
    "PipelineEngine",
    "PipelineError",
    "LayerCosts",
    "METHODS",
    "Partition",
    "consolidate",
    "launch",
    "measure",
    "plan",
    "solve",
]
