"""Parallelisms other than the pipeline's own, one home each: applying it to a stage, what it refuses, its gradient
reduction (a GradientSync: pipeengine.parallel.gradsync), its memory and its checkpoint form.

    data.py      replicated data parallelism: ReplicaMean (AR), share_buffers
    fsdp.py      FSDP2 over the replicas: shard_stage, refusals, ShardedReduce (AR), gather/reshard, pricing
    tensor.py    tensor parallelism: the device mesh, the tp_plan applied, tied weights re-tied, TensorSum
    styles.py    tp_plan styles of pipeengine's own: ReplicatedGradSum (per-head norms), HeadRows (per-head weights)
    ties.py      weights tied across pipeline ranks: TieSum (TR)
    gradsync.py  the protocol they share, and Syncs: this rank's syncs, in their order

``gradient_syncs`` makes a rank's Syncs.
"""

from __future__ import annotations

from torch import nn

from pipeengine.comm.topology import Topology
from pipeengine.core.ties import Ties
from pipeengine.parallel.data import ReplicaMean
from pipeengine.parallel.fsdp import ShardedReduce
from pipeengine.parallel.gradsync import GradientSync, Syncs
from pipeengine.parallel.tensor import tensor_sum
from pipeengine.parallel.ties import TieSum, tie_groups
from schedules import Schedule

__all__ = ["gradient_syncs"]


def gradient_syncs(ties: Ties, schedule: Schedule, topology: Topology, stages: dict[int, nn.Module],
                   fsdp: bool = False, reshard_after_forward: bool = False) -> Syncs:  # fmt: skip
    """What this rank's AR and TR instructions start: the replicas' mean (FSDP2's reduce-scatter with fsdp), and the
    tied weights' sum (after the reduce-scatter with fsdp: it adds reduced shards); and at the step's end, after
    them, the sum over the tensor-parallel ranks of the gradients each computes only its part of (TensorSum)."""
    syncs: list[GradientSync] = []
    if topology.data is not None and fsdp:
        on_gloo = topology.world.device.type != "cuda"
        syncs.append(ShardedReduce(stages, topology.data.size, sum_only=on_gloo, late_buffers=on_gloo,
                                   reshard_after_forward=reshard_after_forward))  # fmt: skip
    elif topology.data is not None:
        syncs.append(ReplicaMean(topology.data, stages))
    groups = tie_groups(ties, schedule, topology, stages, fsdp)
    if groups:
        syncs.append(TieSum(groups, after_shards=fsdp))
    summed = tensor_sum(topology, stages)
    if summed is not None:
        syncs.append(summed)
    return Syncs(syncs)
