"""What crosses a stage boundary: tensor specs, inferred on the meta device before the first send."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__: list[str] = []

Tensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def __str__(self) -> str:
        grad = ", requires grad" if self.requires_grad else ""
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}{grad}"

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.requires_grad)


@dataclass(frozen=True, slots=True)
class Boundary:
    """The value passed between two layers: one tensor, or a tuple of tensors (nn.Sequential passes it whole)."""

    specs: tuple[TensorSpec, ...]
    is_tuple: bool

    def __str__(self) -> str:
        inner = ", ".join(str(s) for s in self.specs)
        return f"({inner})" if self.is_tuple else inner

    @property
    def grad_specs(self) -> tuple[TensorSpec, ...]:
        """The tensors whose gradient travels back across this boundary."""
        return tuple(s for s in self.specs if s.requires_grad)

    @classmethod
    def of(cls, value: object, what: str) -> Boundary:
        if isinstance(value, torch.Tensor):
            return cls((TensorSpec.of(value),), False)
        if isinstance(value, tuple) and value and all(isinstance(t, torch.Tensor) for t in value):
            return cls(tuple(TensorSpec.of(t) for t in value), True)
        kind = type(value).__name__ if not isinstance(value, tuple) else "a tuple holding non-tensors or nothing"
        raise TypeError(f"{what} is {kind}; a stage boundary carries a tensor or a non-empty tuple of tensors")

    def in_dtype(self, dtype: torch.dtype) -> Boundary:
        """The same boundary with its floating tensors in ``dtype`` (mixed precision)."""
        specs = tuple(
            TensorSpec(s.shape, dtype, s.requires_grad) if s.dtype.is_floating_point else s for s in self.specs
        )
        return Boundary(specs, self.is_tuple)

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | Tensors:
        """The value a layer receives: the tensor itself, or the tuple."""
        return pack(tensors, self.is_tuple)

    def meta_leaves(self) -> torch.Tensor | Tensors:
        """Fresh meta tensors of these specs, as the next stage receives them (shapes only, no memory)."""
        return self.pack(
            [torch.empty(s.shape, dtype=s.dtype, device="meta", requires_grad=s.requires_grad) for s in self.specs]
        )


def unpack(value: torch.Tensor | Tensors) -> Tensors:
    return value if isinstance(value, tuple) else (value,)


def pack(tensors: Sequence[torch.Tensor], is_tuple: bool) -> torch.Tensor | Tensors:
    """The value a layer receives: the tuple, or the one tensor (unpack's inverse)."""
    return tuple(tensors) if is_tuple else tensors[0]


def map_tensors(value: torch.Tensor | Tensors, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | Tensors:
    """``fn`` applied to each tensor of a value, keeping its form (a tensor, or a tuple)."""
    return pack([fn(t) for t in unpack(value)], isinstance(value, tuple))


def meta_copy(layer: nn.Module) -> nn.Module:
    """A copy of a layer whose parameters and buffers live on the meta device (no memory, no copy of data)."""
    memo: dict[int, object] = {}
    for param in layer.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in layer.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(layer, memo)


def infer_boundaries(
    meta_layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]], inputs: Boundary
) -> list[Boundary]:
    """The output boundary of every stage for one micro-batch whose input is ``inputs``.

    Runs the layers on meta tensors (shapes only, no compute), with autograd on, so each
    spec also says whether a gradient flows back through it.
    """
    outputs = []
    value = inputs.meta_leaves()
    with torch.enable_grad():
        for stage, (start, end) in enumerate(bounds):
            for index in range(start, end):
                try:
                    value = meta_layers[index](value)
                except Exception as error:
                    raise RuntimeError(
                        f"could not infer the shapes leaving layer {index} (stage {stage}) on the meta device: "
                        f"{type(error).__name__}: {str(error).rstrip('.')}. Every layer's output shape must follow "
                        "from its input shape (no data-dependent shapes, no .item())"
                    ) from error
            boundary = Boundary.of(value, f"the output of stage {stage} (layers {start}..{end - 1})")
            outputs.append(boundary)
            value = boundary.meta_leaves()  # the next stage receives leaves
    return outputs
