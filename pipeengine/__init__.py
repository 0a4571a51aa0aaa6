"""pipeengine: pipeline-parallel training of an nn.Sequential, executing `schedules` across ranks.

The package in layers, each importing only from those below it (tests/test_layout.py holds it to this):

    engine.py      the facade, PipelineEngine (auto.py: schedule="auto" asks the planner; tune.py its command)
    planner/       the planner (tune): its layer profile, search, pricing, calibration, the CPU host model; imported
                   by the top alone, and `import pipeengine` loads none of it
    hf/            Hugging Face causal LMs in and out (beside train/: it uses an engine, never imports one)
    train/         a step, the loss, parameters, checkpoints (and resuming: extras, writing, data), traced steps
    construction/  what one rank runs: grid, schedule, partition (the lean layer measurement, LayerCosts, the
                   solve), ties, stages (and their transform), workers
    runtime/       the executor, its mailbox, stage workers, split backward, the program cache
    parallel/      data parallel, FSDP, tensor parallel, tied weights: each a gradient sync of one protocol
    observe/       tracing and the memory ledger
    launcher/      ranks as processes (or torchrun's) or as threads, and who caused a failure
    comm/          transports (gloo, NCCL, in-process), the call header, consensus, the topology
    core/          the config, the grid, boundary specs, stage bounds, tied weights, what a rank finishes last
"""

from pipeengine.construction.layercosts import LayerCosts
from pipeengine.construction.measure import measure
from pipeengine.construction.partition import METHODS, Partition, plan, solve
from pipeengine.core.config import DEFAULT_TIMEOUT, EngineConfig
from pipeengine.engine import PipelineEngine
from pipeengine.errors import LaunchError, PeerError, PipelineError
from pipeengine.launcher.dry import DryRun, dry_run
from pipeengine.launcher.launch import launch
from pipeengine.train.checkpoint import consolidate
from pipeengine.train.data import ReplicaLoader
from pipeengine.train.files import latest_checkpoint

__all__ = [
    "DEFAULT_TIMEOUT",
    "DryRun",
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
    "dry_run",
    "latest_checkpoint",
    "launch",
    "measure",
    "plan",
    "solve",
]
