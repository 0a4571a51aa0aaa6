"""A layer's cost on a target GPU, priced from its shapes on this machine: no run on the target, no allocation.

A cluster plan prices a layer on hardware it cannot reach, for models too large to hold here. So the layer
runs on the meta device (``with torch.device("meta")``: shapes and dtypes, no storage) under a dispatch mode
that records every aten op its forward, and its backward, would run (``trace``). Each op gets:

* FLOPs from ``torch.utils.flop_counter``'s registry, called as ``FlopCounterMode`` calls it (the op's args
  and output; an op outside the registry is decomposed first, as there). The formulas are PyTorch's, not
  copied here, so a layer's FLOPs are ``FlopCounterMode``'s by construction (the tests hold it to that).
  Ops outside the registry (element-wise, norms, softmax) count no FLOPs, as there.
* Bytes: its tensor inputs read once and its outputs written once (a broadcast dimension, stride 0, read once),
  the traffic a roofline charges. Views and metadata ops (``_FREE``) move nothing and are not recorded.
* A kind: ``matmul`` (mm, addmm, bmm, baddbmm, scaled mm, convolutions), ``attention`` (the fused
  scaled-dot-product kernels and their backwards) or ``other``.

On the meta device ``F.scaled_dot_product_attention`` falls back to the math path (two bmm and a softmax over
an S x S matrix), which is not what a GPU runs; ``fused_attention`` routes it to the fused kernel a GPU would
pick (flash without a mask, memory-efficient with one), whose meta kernels give the output, and whose flop
formulas are in the registry.

A layer's time is a roofline per op (``roofline.LayerCost.time``): each op takes the longer of its compute at the
device's peak times its efficiency (tensor cores for matmul and attention; the vector units for the rest) and
its bytes at the memory bandwidth, and a phase's time is the sum over its ops. Ops are summed, not overlapped:
a kernel runs at a time on a stream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from pipeengine.planner.cluster.attention import fused_attention
from pipeengine.step.backward import made_in_i

__all__ = ["KINDS", "PHASES", "Kind", "Op", "Phase", "fused_attention", "trace"]


Kind = Literal["matmul", "attention", "other"]
Phase = Literal["forward", "backward"]
KINDS: tuple[Kind, ...] = ("matmul", "attention", "other")
PHASES: tuple[Phase, ...] = ("forward", "backward")

aten = torch.ops.aten


def _packets(namespace: Any, *names: str) -> frozenset[Any]:
    """The ops of these names this torch has (older ones lack some)."""
    return frozenset(getattr(namespace, name) for name in names if hasattr(namespace, name))


# Views, metadata and allocation without a write: no kernel reads or writes memory for them.
_FREE = _packets(
    aten,
    "view",
    "_unsafe_view",
    "reshape",
    "_reshape_alias",
    "view_as",
    "transpose",
    "t",
    "permute",
    "expand",
    "expand_as",
    "slice",
    "select",
    "narrow",
    "unsqueeze",
    "squeeze",
    "flatten",
    "unflatten",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "diagonal",
    "movedim",
    "unfold",
    "as_strided",
    "alias",
    "detach",
    "lift_fresh",
    "view_as_real",
    "view_as_complex",
    "_neg_view",
    "_conj",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "size",
    "sym_size",
    "stride",
    "sym_stride",
    "storage_offset",
    "sym_storage_offset",
    "numel",
    "sym_numel",
    "dim",
    "is_contiguous",
    "sym_is_contiguous",
    "is_strides_like_format",
    "is_non_overlapping_and_dense",
) | _packets(torch.ops.prim, "layout", "device")

_MATMUL = _packets(
    aten,
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "convolution",
    "_convolution",
    "cudnn_convolution",
    "convolution_overrideable",
    "_slow_conv2d_forward",
    "convolution_backward",
)

_ATTENTION = _packets(
    aten,
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_fused_attention_overrideable_backward",
    "_flash_attention_forward",
    "_flash_attention_backward",
    "_efficient_attention_forward",
    "_efficient_attention_backward",
)

# The attention kernels whose tensors are (batch, sequence, heads, head dim); the others' are (batch, heads, ...)
_HEADS_THIRD = _packets(
    aten,
    "_flash_attention_forward",
    "_flash_attention_backward",
    "_efficient_attention_forward",
    "_efficient_attention_backward",
)

# Ops that write their first argument without reading it: it is counted once, as the output.
_WRITE_ONLY = _packets(aten, "copy_", "fill_", "zero_")


@dataclass(frozen=True)
class Op:
    """One aten op a layer runs: its FLOPs (PyTorch's formula, 0 outside the registry) and the bytes it moves."""

    name: str
    kind: Kind
    phase: Phase
    flops: int
    bytes: int
    shapes: tuple[tuple[int, ...], ...] = ()  # its tensor inputs' shapes: an efficiency measured at a shape
    dtype: str = ""  # its first tensor input's dtype, e.g. "torch.bfloat16"
    weight: bool = False  # a backward op only the weights' gradients need (W of a split backward; the rest is I)


def _kind(packet: Any) -> Kind:
    if packet in _MATMUL:
        return "matmul"
    if packet in _ATTENTION:
        return "attention"
    return "other"


def _footprint(tensor: torch.Tensor) -> int:
    """The bytes a kernel touches reading (or writing) ``tensor`` once: a broadcast (stride-0) dimension once."""
    if tensor.numel() == 0:
        return 0
    if tensor.layout != torch.strided:
        return tensor.numel() * tensor.element_size()
    count = 1
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride != 0:
            count *= size
    return count * tensor.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The distinct tensors in ``tree`` (one tensor passed twice is read once)."""
    seen: dict[int, torch.Tensor] = {}
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            seen.setdefault(id(leaf), leaf)
    return list(seen.values())


class _Recorder(TorchDispatchMode):
    """Records each aten op run under it as an ``Op`` of the current phase."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.phase: Phase = "forward"

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        packet = func._overloadpacket
        if packet in _FREE:
            return func(*args, **kwargs)
        if packet not in flop_registry:
            # As FlopCounterMode: an op without a formula is decomposed where it can be, its parts counted.
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        flops = _flops(packet, args, kwargs, out)
        inputs = _tensors((args, kwargs))
        outputs = _tensors(out)
        if packet in _WRITE_ONLY and args and isinstance(args[0], torch.Tensor):
            inputs = [t for t in inputs if t is not args[0]]
        moved = sum(_footprint(t) for t in inputs) + sum(_footprint(t) for t in outputs)
        self.ops.append(
            Op(
                name=str(func),
                kind=_kind(packet),
                phase=self.phase,
                flops=flops,
                bytes=moved,
                shapes=tuple(tuple(int(s) for s in t.shape) for t in inputs),
                dtype=str(inputs[0].dtype) if inputs else "",
            )
        )
        return out


def _flops(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """The registry's formula for the op, as FlopCounterMode calls it. Grouped-query attention (fewer key/value heads
    than query heads) is counted as torch 2.13's formulas count it, the key/value heads repeated to the query's:
    torch 2.11's formulas refuse such shapes (an AssertionError, seen on a lent GPU's torch 2.11), so there they are
    called again with the heads repeated."""
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except AssertionError:
        if packet not in _ATTENTION:
            raise
        return int(formula(*_heads_repeated(packet, args), **kwargs, out_val=out))


def _heads_repeated(packet: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with each 4-d tensor of fewer heads than the most (grouped keys and values, their gradients) given
    that many: the shapes a formula reads, in empty tensors on the same device (free on the meta device)."""
    dim = 2 if packet in _HEADS_THIRD else 1
    fours = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    most = max((t.shape[dim] for t in fours), default=0)

    def whole(arg: Any) -> Any:
        if not isinstance(arg, torch.Tensor) or arg.dim() != 4 or arg.shape[dim] in (0, most) or most % arg.shape[dim]:
            return arg
        shape = list(arg.shape)
        shape[dim] = most
        return arg.new_empty(shape)

    return tuple(whole(arg) for arg in args)


def _check_meta(module: torch.nn.Module, inputs: Any) -> None:
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.device.type != "meta":
            raise ValueError(
                f"trace needs a module on the meta device: {name} is on {tensor.device}; "
                'build it under `with torch.device("meta"):` (nothing is allocated there)'
            )
    for tensor in _tensors(inputs):
        if tensor.device.type != "meta":
            raise ValueError(
                f"trace needs meta inputs: a tensor of shape {tuple(tensor.shape)} is on {tensor.device}; "
                'make it under `with torch.device("meta"):`'
            )


def trace(
    module: torch.nn.Module,
    *example_inputs: Any,
    backward: bool = True,
    example_kwargs: Mapping[str, Any] | None = None,
    fused: bool = True,
) -> list[Op]:
    """The aten ops ``module(*example_inputs, **example_kwargs)`` runs, then its backward, on the meta device.

    The module and the inputs must be on the meta device (a ValueError says which is not): nothing is allocated.
    The backward starts from a gradient of ones on each floating output that requires grad and reaches the
    parameters and inputs that require grad (returned, not left in ``.grad``); ops it runs are of phase
    "backward", those only the weights' gradients need marked ``weight`` (a split backward's W; the others are
    its I, what a backward to the inputs alone runs). ``fused`` routes scaled-dot-product attention to the GPU's
    fused kernels (``fused_attention``); without it, the meta device's math path (bmm, softmax) is recorded.
    """
    kwargs = dict(example_kwargs or {})
    _check_meta(module, (example_inputs, kwargs))
    recorder = _Recorder()
    with ExitStack() as stack:
        stack.enter_context(torch.device("meta"))
        if fused:
            stack.enter_context(fused_attention())
        with recorder:
            out = module(*example_inputs, **kwargs)
        roots = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
        leaves = [t for t in [*module.parameters(), *_tensors((example_inputs, kwargs))] if t.requires_grad]
        if backward and roots and leaves:
            seeds = [torch.ones_like(t) for t in roots]
            recorder.phase = "backward"
            with recorder:
                # the gradients are returned, not accumulated into .grad: a second trace records the same ops
                torch.autograd.grad(roots, leaves, seeds, allow_unused=True, retain_graph=True)
            inputs = [t for t in _tensors((example_inputs, kwargs)) if t.requires_grad]
            _mark_weights(recorder, roots, inputs, seeds, [p for p in module.parameters() if p.requires_grad])
    return recorder.ops


def _mark_weights(
    recorder: _Recorder,
    roots: list[torch.Tensor],
    inputs: list[torch.Tensor],
    seeds: list[torch.Tensor],
    params: list[torch.nn.Parameter],
) -> None:
    """Mark the backward ops only W needs: those the whole backward runs beyond what the split backward's I runs, a
    backward to the inputs and to the weights I makes (an element-wise node's, a compiled region's:
    pipeengine.step.backward.made_in_i; autograd runs only what the gradients asked for need), matched by name and
    shapes."""
    backward = [index for index, op in enumerate(recorder.ops) if op.phase == "backward"]
    needed: dict[tuple[str, tuple[tuple[int, ...], ...]], int] = {}
    if inputs:
        made = made_in_i(roots, inputs, params)
        alone = _Recorder()
        alone.phase = "backward"
        with alone:
            torch.autograd.grad(roots, [*inputs, *made], seeds, allow_unused=True)
        for op in alone.ops:
            needed[op.name, op.shapes] = needed.get((op.name, op.shapes), 0) + 1
    for index in backward:
        op = recorder.ops[index]
        if needed.get((op.name, op.shapes), 0):
            needed[op.name, op.shapes] -= 1
        else:
            recorder.ops[index] = replace(op, weight=True)
