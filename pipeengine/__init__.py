"""pipeengine: pipeline-parallel training of an nn.Sequential, executing `schedules` across ranks.

The package in layers, each importing only from those below it (tests/test_layout.py holds it to this):

    engine.py      the facade, PipelineEngine
    hf/            Hugging Face causal LMs in and out (beside train/: it uses an engine, never imports one)
    train/         a step, the loss, parameters, checkpoints (and resuming: extras, writing, data), traced steps
    construction/  what one rank runs: grid, schedule, partition, ties, stages (and their transform), workers
    planner/       the layer profiler, the partitioner, the planner (tune)
    runtime/       the executor, its mailbox, stage workers, split backward, the program cache
    parallel/      data parallel, FSDP, tensor parallel, tied weights: each a gradient sync of one protocol
    observe/       tracing and the memory ledger
    launcher/      ranks as processes (or torchrun's) or as threads, and who caused a failure
    comm/          transports (gloo, NCCL, in-process), the call header, consensus, the topology
    core/          the config, the grid, boundary specs, stage bounds, tied weights, what a rank finishes last
"""

from pipeengine.core.config import DEFAULT_TIMEOUT, EngineConfig
from pipeengine.engine import PipelineEngine
from pipeengine.errors import LaunchError, PeerError, PipelineError
from pipeengine.launcher.launch import launch
from pipeengine.planner.costmodel import LayerCosts
from pipeengine.planner.measure import measure
from pipeengine.planner.partition import METHODS, Partition, plan, solve
from pipeengine.train.checkpoint import consolidate
from pipeengine.train.data import ReplicaLoader
from pipeengine.train.files import latest_checkpoint

__all__ = [
    "DEFAULT_TIMEOUT",
    "EngineConfig",
    "LaunchError",
    "PeerError",
    "PipelineEngine",
    "PipelineError",
    "ReplicaLoader",
    "LayerCosts",
    "METHODS",
    "Partition",
    "consolidate",
    "latest_checkpoint",
    "launch",
    "measure",
    "plan",
    "solve",
]
