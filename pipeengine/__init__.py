"""pipeengine: pipeline-parallel training of an nn.Sequential, executing `schedules` across ranks.

The package in layers, each importing only from those below it (tests/test_layout.py holds it to this):

    engine.py      the facade, PipelineEngine
    hf/            Hugging Face causal LMs in and out (beside train/: it uses an engine, never imports one)
    train/         a step, the loss, parameters, checkpoints, traced steps
    build/         what one rank runs: grid, schedule, partition, ties, stages (and their transform), workers
    planner/       the layer profiler, the partitioner, the planner (tune)
    runtime/       the executor, its mailbox, stage workers, split backward, gradient synchronisation
    observe/       tracing and the memory ledger
    launcher/      ranks as processes (or torchrun's) or as threads, and who caused a failure
    comm/          transports (gloo, NCCL, in-process), the call header, consensus, the topology
    core/          the config, the grid, boundary specs, stage bounds, tied weights
"""

from pipeengine.core.config import DEFAULT_TIMEOUT, EngineConfig
from pipeengine.engine import PipelineEngine
from pipeengine.errors import LaunchError, PeerError, PipelineError
from pipeengine.launcher.launch import launch
from pipeengine.planner.partition import METHODS, Partition, plan, solve
from pipeengine.planner.profiler import LayerCosts, measure
from pipeengine.train.checkpoint import consolidate

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
