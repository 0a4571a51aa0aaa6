"""What a tensor-parallel plan leaves out, refused. torch's styles shard the projections; a module beside them that
works per head (a norm over each head after a column-wise q_proj) needs a style of pipeengine's own
(pipeengine.parallel.styles), which pipeengine.hf.tp_plan gives and a plan written by hand may lack. Such a module's
parameter stays a plain tensor, whole on every tensor-parallel rank, and each rank computes only its heads' part of
its gradient: the copies drift apart, silently.

    refuse_headwise(model, plan)   at build, from the shapes: a module beside a column-wise projection, with no style
                                   of its own, whose weight has a row per head of the projection's output (Cohere's
                                   q_norm (heads, head_dim)): each rank would apply every row to its own heads
    check_replicated(...)          at the end of the first training step (TensorSum, in the gradient-sync protocol,
                                   after every reduction): each parameter a tensor-parallel rank holds whole has its
                                   gradient compared over the stage's tensor-parallel ranks, a few numbers each in one
                                   all-gather; one that differs (Qwen3's q_norm (head_dim,) left out) is refused on
                                   every rank of the world, before an optimizer could step on it
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from pipeengine.comm.base import Transport
from pipeengine.core.dtensors import is_dtensor, local
from pipeengine.errors import PlanError

__all__ = ["check_replicated", "refuse_headwise", "whole_parameters"]

FIX = (
    "mark it in tp_plan with pipeengine.parallel.styles.ReplicatedGradSum() (its gradient is summed over the "
    "tensor-parallel ranks) or HeadRows(...) (a weight with a row per head: each rank holds its heads' rows), or "
    "use pipeengine.hf.tp_plan(model) for a Hugging Face model"
)
# A plan that covers every module gives each rank's copy of a whole parameter the same gradient, bit for bit: each
# rank runs the same computation on the same whole tensors, and a collective (DTensor's all-reduce, the replicas')
# leaves the same bits on every rank. A kernel that sums in an order of its own (atomic adds on a GPU) may leave a few
# ulps of difference, about 1e-7 of the gradient's size in float32; a left-out parameter's gradient is each rank's
# part, differing by a good fraction of its size (one half of the heads against the other). 1e-6 (or 4 ulps of a
# coarser dtype) of the gradient's size sits between, ten times above the one and 1e5 below the other.
RTOL = 1e-6
SAMPLES = 1024  # the strided sample whose position-weighted sum shows gradients equal in sum and norm but permuted
STATS = 4  # sum, L1 norm, L2 norm, the sample's weighted sum


def refuse_headwise(model: nn.Module, plan: Mapping[str, object]) -> None:
    """Refuse a module beside a column-wise projection (a ColwiseParallel leaving its output sharded: each rank its
    heads) that has no style and a weight of more than one row whose size is the projection's output (a row per
    head): each tensor-parallel rank would apply all its rows to its own heads. Read from shapes before any stage is
    cut, alike on every rank; a per-head weight without a row per head (Qwen3's q_norm (head_dim,)) is caught at the
    first step (check_replicated)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    found: dict[str, tuple[str, str]] = {}  # each weight: (where it sits, what it is beside that projection)
    for name, style in plan.items():
        projection = model.get_submodule(name)
        layouts = getattr(style, "output_layouts", ())  # a tuple of one (torch 2.x), or the placement
        sharded = any(isinstance(p, Shard) for p in (layouts if isinstance(layouts, tuple) else (layouts,)))
        if not (isinstance(style, ColwiseParallel) and isinstance(projection, nn.Linear) and sharded):
            continue
        parent, _, own = name.rpartition(".")
        for child, module in model.get_submodule(parent).named_children():
            full = f"{parent}.{child}" if parent else child
            styled = any(key == full or key.startswith(full + ".") for key in plan)
            if styled or hasattr(module, "in_features") or hasattr(module, "num_embeddings"):  # its own input
                continue
            for key, param in module.named_parameters():
                if param.dim() >= 2 and param.shape[0] > 1 and param.numel() == projection.out_features:
                    what = f"{child}.{key} {tuple(param.shape)} beside {own} (out_features {projection.out_features})"
                    found.setdefault(f"{full}.{key}", (parent, what))
    if found:
        where: dict[str, list[str]] = {}  # alike in every layer: said once, with the modules it sits in
        for parent, what in found.values():
            where.setdefault(what, []).append(parent or "the model")
        shown = "; ".join(
            f"{what} in {', '.join(parents[:3])}" + (f" and {len(parents) - 3} more" if len(parents) > 3 else "")
            for what, parents in where.items()
        )
        raise ValueError(
            f"tp_plan splits a projection by columns (ColwiseParallel: each tensor-parallel rank computes its heads of "
            f"the output) and says nothing of a weight beside it with a row per head of that output: {shown}. Each "
            "rank would apply every row to its own heads. Mark each in tp_plan with "
            "pipeengine.parallel.styles.HeadRows() (each rank holds its heads' rows), or use "
            "pipeengine.hf.tp_plan(model) for a Hugging Face model"
        )


def whole_parameters(stages: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters of these stages that each tensor-parallel rank holds whole, under the model's names:
    plain tensors, and FSDP's shards over the replicas alone (a DTensor whose mesh has no "tp" dim: each
    tensor-parallel rank holds the same rows). A DTensor sharded or replicated over "tp" is DTensor's to reduce."""
    found: dict[int, tuple[str, nn.Parameter]] = {}
    for module in stages:
        for name, param in module.named_parameters():
            mesh = getattr(param, "device_mesh", None) if is_dtensor(param) else None
            if param.requires_grad and (mesh is None or "tp" not in (mesh.mesh_dim_names or ())):
                found.setdefault(id(param), (name, param))
    return list(found.values())


def check_replicated(params: Sequence[tuple[str, nn.Parameter]], tensor: Transport, world: Transport) -> bool:
    """After a training step's every reduction: each of ``params`` (whole_parameters) has the same gradient on every
    rank of ``tensor`` (the stage's tensor-parallel ranks), or every rank of ``world`` raises PlanError naming each
    that differs and by how much. Every rank of the world calls it at the same step: a sum, two norms and a sample's
    weighted sum per parameter, gathered over ``tensor`` in one collective; two ints summed over ``world``. Only where
    some rank finds a difference, the differing gradients themselves are gathered, and the findings. False where a
    gradient was not finite anywhere (fp16's overflow, its step skipped): nothing told, every rank checks again at the
    next training step. A dry run's rank (``world.alone``) has no values to compare: True."""
    if world.alone:
        return True
    rows = [_summary(param) for _, param in params]
    rows.append(torch.zeros(STATS, dtype=torch.float64, device=tensor.device))  # no parameter: still one row
    tables = tensor.all_gather(torch.stack(rows).to(tensor.device), "the whole parameters' gradient summaries")
    table = torch.stack(tables)[:, :-1].cpu()  # (tensor-parallel ranks, parameters, STATS): alike on every rank
    spread = (table - table[:1]).abs().amax(0)  # each parameter's largest difference from tensor-parallel rank 0's
    scale = table.abs().amax(0)[:, [1, 1, 2, 1]].clamp_min(torch.finfo(torch.float64).tiny)  # sums against the L1
    relative = (spread / scale).amax(1)
    differ = [i for i, (_, param) in enumerate(params) if relative[i] > _rtol(param)]
    nonfinite = int(not torch.isfinite(table).all())
    count = torch.tensor([len(differ), nonfinite], dtype=torch.int64, device=world.device)
    world.all_reduce(count, "the number of whole parameters whose gradients differ over tensor-parallel ranks")
    if not count[0].item():
        return not count[1].item()
    findings = _differences([params[i] for i in differ], tensor) if differ else {}
    merged: dict[str, tuple[float, float]] = {}
    for theirs in world.all_gather_object(findings, "the whole parameters whose gradients differ"):
        for name, (diff, largest) in theirs.items():  # each replica finds its own: the largest
            old = merged.get(name, (0.0, 0.0))
            merged[name] = (max(old[0], diff), max(old[1], largest))
    listed = ", ".join(
        f"{name} (by up to {diff:.2e}; its largest gradient {largest:.2e})"
        for name, (diff, largest) in list(merged.items())[:6]
    )
    if len(merged) > 6:
        listed += f" and {len(merged) - 6} more ({', '.join(list(merged)[6:])})"
    raise PlanError(
        f"tensor_parallel={tensor.size}: after the first training step, parameters that every tensor-parallel rank "
        f"holds whole (no style of tp_plan shards them) have gradients that differ across the tensor-parallel ranks "
        f"of their stage: {listed}. The plan left them out: each rank computed only its part of their gradient (a "
        f"norm applied per head after a column-wise projection sees that rank's heads alone), and the copies would "
        f"drift apart. For each, {FIX}. (The tensor-parallel ranks of a stage must also be given the same batch.) "
        f"train_step raised before any optimizer step on these gradients"
    )


def _summary(param: nn.Parameter) -> torch.Tensor:
    """A few numbers of this rank's gradient of ``param`` (zeros where it has none), in float64: its sum, L1 and L2
    norms (reduced in its own dtype, float32 at least: no float64 copy of a large gradient), and a position-weighted
    sum of an evenly strided sample of at most SAMPLES elements."""
    if param.grad is None:
        return torch.zeros(STATS, dtype=torch.float64, device=param.device)
    grad = local(param.grad).detach().reshape(-1)
    accumulate = torch.promote_types(grad.dtype, torch.float32)
    sample = grad[:: max(1, grad.numel() // SAMPLES)][:SAMPLES].double()
    weights = torch.arange(sample.numel(), dtype=torch.float64, device=sample.device).remainder_(7).add_(1)
    return torch.stack(
        [
            grad.sum(dtype=accumulate).double(),
            torch.linalg.vector_norm(grad, 1, dtype=accumulate).double(),
            torch.linalg.vector_norm(grad, 2, dtype=accumulate).double(),
            (sample * weights).sum(),
        ]
    )


def _rtol(param: nn.Parameter) -> float:
    """RTOL, or 4 ulps of a coarser gradient (bfloat16, float16), relative to the gradient's size."""
    dtype = param.dtype  # its gradient's, alike on every rank (whether it has one or not)
    return max(RTOL, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else RTOL


def _differences(params: Sequence[tuple[str, nn.Parameter]], tensor: Transport) -> dict[str, tuple[float, float]]:
    """Each parameter's largest elementwise difference of its gradient over the tensor-parallel ranks, and its largest
    gradient: the gradients gathered whole (every rank of ``tensor`` finds the same parameters, and calls it)."""
    flats = [
        torch.zeros(local(p).numel()) if p.grad is None else local(p.grad).detach().reshape(-1).float().cpu()
        for _, p in params
    ]
    gathered = tensor.all_gather(torch.cat(flats).to(tensor.device), "the differing gradients")
    every = torch.stack([g.cpu() for g in gathered])
    found, offset = {}, 0
    for (name, _), flat in zip(params, flats, strict=True):
        part = every[:, offset : offset + flat.numel()]
        offset += flat.numel()
        found[name] = (float((part - part[:1]).abs().max()), float(part.abs().max()))
    return found
