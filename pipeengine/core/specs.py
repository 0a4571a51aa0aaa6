"""What crosses a stage boundary: tensor specs, inferred on the meta device before the first send."""

from __future__ import annotations

import copy
import math
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

    @property
    def nbytes(self) -> int:
        """Bytes of a tensor of this spec."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Boundary:
    """The value passed between two layers: one tensor, or a tuple of tensors (nn.Sequential passes it whole).

    ``needs_gradient``: whether any gradient comes back across it (see infer_boundaries); when
    not, none is sent even for tensors that require grad.
    """

    specs: tuple[TensorSpec, ...]
    is_tuple: bool
    needs_gradient: bool = True

    def __str__(self) -> str:
        inner = ", ".join(str(s) for s in self.specs)
        return f"({inner})" if self.is_tuple else inner

    @property
    def grad_specs(self) -> tuple[TensorSpec, ...]:
        """The tensors whose gradient travels back across this boundary."""
        return tuple(s for s in self.specs if s.requires_grad) if self.needs_gradient else ()

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
        return Boundary(specs, self.is_tuple, self.needs_gradient)

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
    """A copy of a layer whose parameters and buffers live on the meta device (no memory, no copy of data), and
    which runs eagerly: a torch.compile'd layer (or part) runs its original module, since a compiler need not take
    meta tensors and the shapes are the same."""
    memo: dict[int, object] = {}
    for param in layer.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in layer.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return _eager(copy.deepcopy(layer, memo))


def _eager(module: nn.Module) -> nn.Module:
    """The module with every compiled part uncompiled: OptimizedModule (torch.compile(module)) replaced by the module
    it wraps, nn.Module.compile()'s compiled call dropped."""
    module = getattr(module, "_orig_mod", module) if type(module).__name__ == "OptimizedModule" else module
    for parent in module.modules():
        parent._compiled_call_impl = None
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "OptimizedModule":
                setattr(parent, name, _eager(child._orig_mod))
    return module


def infer_boundaries(
    meta_layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]], inputs: Boundary
) -> list[Boundary]:
    """The output boundary of every stage for one micro-batch whose input is ``inputs``.

    Runs the layers on meta tensors (shapes only, no compute), with autograd on, so each
    spec also says whether it requires grad, and each boundary whether a gradient comes back
    across it: its tensors require grad, the next stage's outputs depend on them through
    autograd, and a gradient comes back to that stage (it computes the loss, or its own output
    boundary needs one). Behind a frozen stage or a detached output, none does. A stage whose
    layers cannot run on the meta device (a kernel with no meta form for its dtypes, such as
    grouped_mm's in a mixture of experts) runs for real instead, on the CPU with copies of its
    layers, twice (zeros, then ones): its shapes must not follow the values. The copies are freed.
    """
    outputs: list[Boundary] = []
    reaches: list[bool] = []  # per stage: whether its outputs depend on its inputs through autograd
    received = inputs
    with torch.enable_grad():
        for stage, (start, end) in enumerate(bounds):
            layers = meta_layers[start:end]
            leaves = unpack(received.meta_leaves())
            try:
                value = _run(layers, pack(leaves, received.is_tuple))
            except _LayerFailed as on_meta:
                value, leaves = _run_for_real(layers, received, on_meta, stage, start)
            boundary = Boundary.of(value, f"the output of stage {stage} (layers {start}..{end - 1})")
            reaches.append(_depends(unpack(value), leaves))  # type: ignore[arg-type]  # Boundary.of checked it
            outputs.append(boundary)
            received = boundary  # the next stage receives leaves of these specs
            del value, leaves  # this stage's graph goes before the next one is made
    needed = True  # behind the last stage: the loss, whose gradient is 1
    for b in range(len(outputs) - 2, -1, -1):
        needed = bool(outputs[b].grad_specs) and reaches[b + 1] and needed
        outputs[b] = Boundary(outputs[b].specs, outputs[b].is_tuple, needed)
    return outputs


class _LayerFailed(Exception):
    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index, error)
        self.index, self.text = index, f"{type(error).__name__}: {str(error).rstrip('.')}"


def _run(layers: Sequence[nn.Module], value: object) -> object:
    for index, layer in enumerate(layers):
        try:
            value = layer(value)
        except Exception as error:
            raise _LayerFailed(index, error) from error
    return value


def _run_for_real(
    layers: Sequence[nn.Module], received: Boundary, on_meta: _LayerFailed, stage: int, start: int
) -> tuple[object, Tensors]:
    """A stage that cannot run on the meta device, run on the CPU: once with every parameter, buffer and input zero,
    once with them all 0.01 (integers 1). Its output shapes must be the same both times: a shape that follows the
    values (``x[x > 0]``) is refused."""
    results = []
    for fill in (0, 1):
        leaves = tuple(
            torch.full(s.shape, _value(s.dtype, fill), dtype=s.dtype).requires_grad_(s.requires_grad)
            for s in received.specs
        )
        try:
            value = _run([_filled(layer, fill) for layer in layers], pack(leaves, received.is_tuple))
        except _LayerFailed as for_real:
            raise RuntimeError(
                f"could not infer the shapes leaving layer {start + on_meta.index} (stage {stage}) on the meta device "
                f"({on_meta.text}), nor by running the stage once on the CPU, where layer {start + for_real.index} "
                f"raised {for_real.text}. Every layer's output shape must follow from its input shape (no "
                "data-dependent shapes, no .item())"
            ) from for_real.__cause__
        results.append((value, leaves))
    (first, leaves), (second, _) = results
    shapes = [Boundary.of(v, f"the output of stage {stage}").specs for v in (first, second)]
    if shapes[0] != shapes[1]:
        raise RuntimeError(
            f"could not infer the shapes leaving layer {start + on_meta.index} (stage {stage}) on the meta device "
            f"({on_meta.text}), and run on the CPU the stage's output shapes follow its values "
            f"({', '.join(map(str, shapes[0]))} on zeros, {', '.join(map(str, shapes[1]))} on ones). Every "
            "layer's output shape must follow from its input shape (no data-dependent shapes, no .item())"
        )
    return first, leaves


def _value(dtype: torch.dtype, fill: int) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return 0.01 * fill
    return bool(fill) if dtype == torch.bool else fill


def _filled(layer: nn.Module, fill: int) -> nn.Module:
    """A CPU copy of a meta layer, every parameter and buffer ``fill`` (held until the copy is freed)."""
    real = copy.deepcopy(layer).to_empty(device="cpu")
    with torch.no_grad():
        for tensor in (*real.parameters(), *real.buffers()):
            tensor.fill_(_value(tensor.dtype, fill))
    return real


def _depends(outputs: Tensors, inputs: Tensors) -> bool:
    """Whether autograd leads from any of ``outputs`` back to any of the leaf ``inputs``."""
    targets = {id(t) for t in inputs if t.requires_grad}
    if not targets:
        return False
    stack = []
    for output in outputs:
        if id(output) in targets:
            return True
        if output.grad_fn is not None:
            stack.append(output.grad_fn)
    seen: set[object] = set()  # the nodes themselves: torch may free a node's Python object and reuse its id
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it feeds
        if variable is not None and id(variable) in targets:
            return True
        stack += [child for child, _ in node.next_functions if child is not None]
    return False
