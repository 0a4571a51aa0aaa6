"""Parallelisms other than the pipeline's own, one home each: applying it to a stage, what it refuses, its gradient
reduction (a GradientSync: pipeengine.parallel.gradsync), its memory and its checkpoint form.

    data.py      replicated data parallelism: ReplicaMean (AR), share_buffers
    fsdp.py      FSDP2 over the replicas: shard_stage, refusals, ShardedReduce (AR), gather/reshard, pricing
    tensor.py    tensor parallelism: the device mesh, the tp_plan applied, tied weights re-tied, TensorSum
    styles.py    tp_plan styles of pipeengine's own: ReplicatedGradSum (per-head norms), HeadRows (per-head weights)
    leftout.py   what a tp_plan leaves out, refused: at build (a weight with a row per head), at the first step (a whole
                 parameter whose gradient differs over the tensor-parallel ranks; TensorSum runs it)
    ties.py      weights tied across pipeline ranks: TieSum (TR)
    gradsync.py  the protocol they share, and Syncs: this rank's syncs, in their order

``gradient_syncs`` makes a rank's Syncs; ``checked_ties`` is what a cut of the model must meet to be built, for the
engine's construction and the planner alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pipeengine.comm.topology import Topology
from pipeengine.core.ties import Ties, find_ties
from pipeengine.parallel.data import ReplicaMean
from pipeengine.parallel.fsdp import ShardedReduce, check_shardable, refuse_shared_units
from pipeengine.parallel.gradsync import GradientSync, Syncs
from pipeengine.parallel.tensor import tensor_sum
from pipeengine.parallel.ties import TieSum, tie_groups
from schedules import Schedule

__all__ = ["checked_ties", "gradient_syncs"]


def checked_ties(
    model: nn.Sequential, bounds: Sequence[tuple[int, int]], placement: Sequence[int], fsdp: bool = False
) -> Ties:
    """The ties of ``model`` cut at ``bounds`` onto pipeline ranks (``placement``: stage -> rank), or the ValueError
    a build raises there: a buffer or memory two ranks would share (core.ties.find_ties), and with ``fsdp`` a layer
    FSDP cannot shard or a weight two stages of one rank share (pipeengine.parallel.fsdp). The engine builds through
    it, and the planner asks it of each candidate before pricing it: one rule, so tune offers no row the engine
    refuses."""
    ties = find_ties(model, bounds, placement)
    if fsdp:
        check_shardable(model)
        refuse_shared_units(ties, placement)
    return ties


def gradient_syncs(
    ties: Ties,
    schedule: Schedule,
    topology: Topology,
    stages: dict[int, nn.Module],
    fsdp: bool = False,
    reshard_after_forward: bool = False,
) -> Syncs:
    """What this rank's AR and TR instructions start: the replicas' mean (FSDP2's reduce-scatter with fsdp), and the
    tied weights' sum (after the reduce-scatter with fsdp: it adds reduced shards); and at the step's end, after
    them, the sum over the tensor-parallel ranks of the gradients each computes only its part of (TensorSum: with
    tensor parallelism always, for the first step's check of the whole parameters' gradients)."""
    syncs: list[GradientSync] = []
    if topology.data is not None and fsdp:
        on_gloo = topology.world.device.type != "cuda"
        syncs.append(
            ShardedReduce(
                stages,
                topology.data.size,
                sum_only=on_gloo,
                late_buffers=on_gloo,
                reshard_after_forward=reshard_after_forward,
            )
        )
    elif topology.data is not None:
        syncs.append(ReplicaMean(topology.data, stages))
    groups = tie_groups(ties, schedule, topology, stages, fsdp)
    if groups:
        syncs.append(TieSum(groups, after_shards=fsdp))
    summed = tensor_sum(topology, stages)
    if summed is not None:
        syncs.append(summed)
    return Syncs(syncs)
