"""This rank's parameters as an optimizer, a checkpoint and clipping see them.

Names are the model's own (``"6.weight"``); a weight tied across stages is listed once, under
the model's first name for it. A weight tied across ranks is held by each of them, but one rank
owns it (the first stage that holds it): the others neither write it to a checkpoint nor count it
in the gradient norm. Decided once, here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from pipeengine.comm.base import Transport
from pipeengine.core import dtensors
from pipeengine.core.dtensors import whole
from pipeengine.core.ties import Ties

__all__: list[str] = []


class Parameters:
    def __init__(
        self, stages: Mapping[int, nn.Module], ties: Ties, placement: tuple[int, ...], rank: int, pipeline: Transport
    ) -> None:
        self.stages, self.ties, self.pipeline = stages, ties, pipeline
        self.elsewhere = ties.shared_elsewhere(placement, rank)  # first names of tied weights another rank owns

    def named(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's names; a tied weight once, under the model's first name."""
        seen: set[int] = set()
        for module in self.stages.values():
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield self.ties.names[id(param)], param

    def state_dict(self, gather: bool = True) -> dict[str, torch.Tensor]:
        """This rank's state under the model's names; a tied weight once, under its first name; whole tensors (a
        DTensor gathered over its mesh: every rank of the mesh calls this), or as they are (``gather=False``)."""
        state: dict[str, torch.Tensor] = {}
        for module in self.stages.values():
            for key, value in module.state_dict(keep_vars=True).items():
                name = self.ties.names.get(id(value), key) if isinstance(value, nn.Parameter) else key
                if name not in state:
                    state[name] = whole(value.detach()) if gather else value.detach()
        return state

    def owned_state(self, gather: bool = True) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
        """What this rank writes to a checkpoint: its state and the names of its parameters, without the tied
        weights another rank owns."""
        names = {id(param): name for name, param in self.named() if name not in self.elsewhere}
        return {k: v for k, v in self.state_dict(gather).items() if k not in self.elsewhere}, names

    def full_state(self, keys: list[str], writer: bool, world_rank: int) -> dict[str, torch.Tensor] | None:
        """The whole model's state on world rank 0, under every one of the model's ``keys`` (a tied weight under each
        of its names), whole tensors on the CPU; None elsewhere. Every rank calls it (a DTensor is gathered over its
        mesh); ``writer``: this rank's pipeline is the one that holds world rank 0's (the first replica, tensor
        index 0), whose stages send theirs to it."""
        state = {name: value.cpu() for name, value in self.state_dict().items()}
        if not writer:
            return None
        pieces = self.pipeline.all_gather_object(state, "the stages' state for full_state_dict")
        if world_rank != 0:
            return None
        merged = {name: value for piece in pieces for name, value in piece.items()}
        return {key: merged[self.ties.aliases.get(key, key)] for key in keys}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for module in self.stages.values():
            module.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """Clip every gradient of the model by its total norm (torch.nn.utils.clip_grad_norm_'s), reduced over the
        pipeline's stages; each weight counted once. The data-parallel replicas hold the same gradients."""
        norm_type = float(norm_type)
        named = [(name, p.grad) for name, p in self.named() if p.grad is not None]
        counted = [grad for name, grad in named if name not in self.elsewhere]
        local = torch.zeros((), dtype=torch.float32, device=self.pipeline.device)
        if counted:  # a DTensor's norm is reduced over its mesh (whole)
            norms = torch.stack([whole(torch.linalg.vector_norm(g, norm_type)).float() for g in counted])
            local = norms.max() if norm_type == math.inf else (norms**norm_type).sum()
        reduce = "max" if norm_type == math.inf else "sum"
        self.pipeline.all_reduce(local, "the gradient norms of the other stages", op=reduce)
        total = local if norm_type == math.inf else local ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it cannot "
                "be clipped; pass error_if_nonfinite=False to clip anyway"
            )
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for _, grad in named:
            dtensors.local(grad).mul_(scale.to(grad.dtype))  # a DTensor's shard, in place
        return total
