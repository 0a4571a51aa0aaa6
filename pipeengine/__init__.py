"""pipeengine: pipeline-parallel training of an nn.Sequential, executing `schedules` across ranks."""

from pipeengine.engine import DEFAULT_TIMEOUT, PipelineEngine
from pipeengine.errors import LaunchError, PeerError, PipelineError
from pipeengine.launch import launch
from pipeengine.partition import uniform_partition

__all__ = [
    "DEFAULT_TIMEOUT",
    "LaunchError",
    "PeerError",
    "PipelineEngine",
    "PipelineError",
    "launch",
    "uniform_partition",
]
