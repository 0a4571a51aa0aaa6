"""tp_plan styles of pipeengine's own, for the modules inside attention that a column-wise q_proj splits by heads
without being a projection (torch's styles shard the projections; these say what a norm after them needs). Imported
on its own (``from pipeengine.parallel.styles import ...``): it imports torch.distributed.tensor, seconds of CPU.

    ReplicatedGradSum   a per-head norm's weight (head_dim,), whole on every rank (Qwen3's and Gemma 3's q_norm,
                        k_norm; transformers' "replicated_with_grad_allreduce"): each rank's gradient is its heads'
                        part, summed over the stage's tensor-parallel ranks at the step's end (parallel.tensor's
                        TensorSum, in the gradient-sync protocol: after the replicas' AR)
    HeadRows            a per-head weight, heads first ((heads, head_dim): Cohere's q_norm, k_norm with
                        use_qk_norm): each rank holds its heads' rows (a DTensor, Shard(0)), and its whole gradient
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from pipeengine.parallel.tensor import SUMMED

__all__ = ["HeadRows", "ReplicatedGradSum"]


class ReplicatedGradSum(ParallelStyle):
    """The module's own parameters stay whole (plain tensors) on every tensor-parallel rank, and its forward runs
    unchanged on this rank's heads; the engine sums their gradients over the stage's tensor-parallel ranks once per
    training step (TensorSum). For a norm applied per head after a column-wise projection: each rank's gradient of its
    weight comes from its own heads alone, and the true gradient is the sum over the ranks."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        setattr(module, SUMMED, True)
        return module

    def __repr__(self) -> str:
        return "ReplicatedGradSum()"


class HeadRows(ParallelStyle):
    """The module's own parameters, heads first ((heads, ...): Cohere's per-head norm weights), split by rows over the
    tensor-parallel ranks as a column-wise projection before it splits the heads: each rank holds its heads' rows
    (a DTensor, Shard(0)); its input, this rank's heads along dim ``heads_dim`` ((..., heads, head_dim): -2), goes
    in as that shard, and its output comes out as this rank's tensor. Each rank's gradient of its rows is whole: no
    reduction."""

    def __init__(self, heads_dim: int = -2) -> None:
        super().__init__()
        self.heads_dim = heads_dim

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        heads_dim = self.heads_dim

        def partition(name: str, inner: nn.Module, mesh: Any) -> None:
            for key, param in list(inner.named_parameters(recurse=False)):
                rows = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=self.src_data_rank)
                inner.register_parameter(key, nn.Parameter(rows, requires_grad=param.requires_grad))

        def inputs(inner: nn.Module, args: Any, mesh: Any) -> Any:
            return tuple(_heads_shard(a, mesh, heads_dim) for a in args)

        def outputs(inner: nn.Module, output: Any, mesh: Any) -> Any:
            return output.to_local() if isinstance(output, DTensor) else output

        distribute_module(module, device_mesh, partition, inputs, outputs)
        return module

    def __repr__(self) -> str:
        return f"HeadRows(heads_dim={self.heads_dim})"


def _heads_shard(value: object, mesh: Any, heads_dim: int) -> object:
    """This rank's heads (a plain tensor) as its shard of the whole along ``heads_dim``; anything else as it is."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Shard(heads_dim % value.dim())], run_check=False)
    return value
