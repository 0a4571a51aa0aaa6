"""Split backward for zero-bubble schedules: input gradients now (I), weight gradients later (W).

Nothing is recomputed. Let P be the autograd nodes that lead to a stage input: I runs
autograd to the inputs only, so each P node computes only its input-side gradients,
while a prehook keeps the gradient arriving at every P node that also has weights
beneath it. W computes the weights directly beneath each such node from its kept gradient:
for a Linear, a LayerNorm and a weight's element-wise product, from what the node saved, as
its backward would (``_direct_weights``: no autograd re-entry, which costs a graph task and a
walk of the graph below the node each time); for any other node, by re-entering it with its
kept gradient and asking for those weights alone, so that it computes only its weight-side
outputs::

    output ─► [P] Addmm ─► [P] ... ─► input          I: dY flows down P, dX comes out
                 └─► weight (not in P)               W: restart at Addmm with its dY, ask for weight

When one weight lies beneath several P nodes (a weight used twice in the stage), per-node
calls would count it twice; then W falls back to one autograd call from the outputs,
which repeats the input-side gradient work but stays exact.

A torch.compile'd region is one autograd node (CompiledFunctionBackward) whose backward makes
its input and weight gradients together: re-entering it in W would run it twice. Its weights
are asked for in I, which then holds their whole gradient, and W leaves them alone::

    output ─► [P] CompiledFunction ─► input       I: dX, and d(weights beneath it), in one call
                 └─► weights                       W: nothing for them

W re-enters the graph I kept (retain_graph): AOTAutograd's donated buffers, which free saved
tensors during a compiled backward, forbid that, so a split backward turns them off
(``keep_compiled_graphs``) before the first compiled call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node

from pipeengine.core.dtensors import is_dtensor
from pipeengine.core.specs import Tensors

__all__: list[str] = []


def _node(tensor: torch.Tensor) -> Node | None:
    """A tensor's autograd node: its grad_fn, or for a leaf its gradient accumulator."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if tensor.requires_grad:
        return tensor.view_as(tensor).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    return None


class Root(NamedTuple):
    """A node W restarts at: the gradients I kept arriving at it, and the weights directly beneath it (with their
    gradient accumulators, in the same order)."""

    node: Node
    kept: list[torch.Tensor | None]
    params: list[nn.Parameter]
    owners: list[Node]


@dataclass
class WeightPass:
    """What W needs: restart points with their kept gradients, and the weights beneath each."""

    roots: list[Root] = field(default_factory=list)
    fallback: tuple[Tensors, Tensors, list[nn.Parameter]] | None = None  # (outputs, grads, params)

    def run(self) -> int:
        """Accumulate every weight gradient into .grad, then drop the graph; the autograd calls it took (the others
        were formulas of what their nodes saved: ``_direct_weights``)."""
        calls = int(self.fallback is not None)
        if self.fallback is not None:
            outputs, grads, params = self.fallback
            self._accumulate(params, torch.autograd.grad(outputs, params, grads, allow_unused=True))
        for index, (node, kept, params, owners) in enumerate(self.roots):
            if _direct_weights(node, kept, params, owners):  # a formula of what the node saved: no autograd re-entry
                continue
            calls += 1
            edges = [GradientEdge(node, i) for i, g in enumerate(kept) if g is not None]
            values = [g for g in kept if g is not None]
            targets = [GradientEdge(owner, 0) for owner in owners]
            last = index == len(self.roots) - 1
            # not bound to a name: the next root's gradients must not be made while these are still held
            self._accumulate(
                params, torch.autograd.grad(edges, targets, values, retain_graph=not last, allow_unused=True)
            )
        self.roots, self.fallback = [], None
        return calls

    @staticmethod
    def _accumulate(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
        """Into .grad, in place as autograd's AccumulateGrad does (``param.grad + grad`` would hold a third copy)."""
        for param, grad in zip(params, grads, strict=True):
            if grad is not None:
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)


def _direct_weights(
    node: Node, kept: list[torch.Tensor | None], params: list[nn.Parameter], owners: list[Node]
) -> bool:
    """W of a node whose weight gradients are a formula of what it saved and the gradient I kept: a Linear's
    (``addmm(bias, x, weight.t())`` or ``mm(x, weight.t())``, as F.linear records it), a LayerNorm's, a weight's
    element-wise product (an RMSNorm's scale): computed as its backward computes them, without re-entering autograd
    (each re-entry sets up a graph task and walks the graph below its node: about 0.1 ms on a CPU, where these
    formulas take tens of microseconds; docs/benchmarks.md). False (W re-enters) for anything else: another node, a
    weight not beneath it as a leaf (autocast's cast, a computed weight), a DTensor's (tensor parallel, FSDP's
    shards), a weight with gradient hooks, mixed dtypes, a scaled addmm."""
    handler = _DIRECT.get(type(node).__name__)
    if handler is None or len(kept) != 1 or kept[0] is None or len(params) > 2:
        return False
    grad = kept[0]
    if any(
        is_dtensor(p) or p.dtype != grad.dtype or p._backward_hooks or p._post_accumulate_grad_hooks is not None
        for p in params
    ):
        return False
    made = handler(node, grad, owners)
    if made is None:
        return False
    pairs = zip(params, made, strict=True)
    WeightPass._accumulate(params, [_add_product(p, v) if isinstance(v, _Product) else v for p, v in pairs])
    return True


class _Product(NamedTuple):
    """A weight's gradient as the matrix product ``left @ right`` (a Linear's), not yet made."""

    left: torch.Tensor
    right: torch.Tensor


def _add_product(param: nn.Parameter, product: _Product) -> torch.Tensor | None:
    """Into an existing .grad by the GEMM itself (addmm_: no gradient tensor made, and no pass over .grad to add it,
    which B's AccumulateGrad pays for every micro-batch after a step's first); else the product, for .grad to take.
    None: added."""
    left, right = product
    grad = param.grad
    with torch.no_grad():
        if grad is None or grad.layout != torch.strided or grad.dtype != left.dtype or not grad.is_contiguous():
            return left.mm(right)
        grad.addmm_(left, right)
    return None


def _edge(node: Node, index: int) -> Node | None:
    return node.next_functions[index][0]


def _leaves(owners: Sequence[Node | None], *edges: Node | None) -> bool:
    """The weights beneath the node are exactly these leaves (None: an edge without a gradient)."""
    return set(owners) == {e for e in edges if e is not None} and all(
        type(e).__name__ == "AccumulateGrad" for e in owners
    )


def _addmm(node: Node, grad: torch.Tensor, owners: Sequence[Node | None]) -> list[torch.Tensor | _Product] | None:
    if node._saved_alpha != 1 or node._saved_beta != 1:  # type: ignore[attr-defined]
        return None
    return _linear(node, grad, owners, _edge(node, 0), _edge(node, 2), node._saved_mat1)  # type: ignore[attr-defined]


def _mm(node: Node, grad: torch.Tensor, owners: Sequence[Node | None]) -> list[torch.Tensor | _Product] | None:
    return _linear(node, grad, owners, None, _edge(node, 1), node._saved_self)  # type: ignore[attr-defined]


def _linear(
    node: Node,
    grad: torch.Tensor,
    owners: Sequence[Node | None],
    bias: Node | None,
    transposed: Node | None,
    x: torch.Tensor,
) -> list[torch.Tensor | _Product] | None:
    if transposed is None or type(transposed).__name__ != "TBackward0" or x.dtype != grad.dtype:
        return None
    weight = _edge(transposed, 0)
    if not _leaves(owners, weight, bias):
        return None
    with torch.no_grad():  # the saved input is an activation: nothing here is recorded
        return [_Product(grad.t(), x) if owner is weight else grad.sum(0) for owner in owners]


def _layer_norm(node: Node, grad: torch.Tensor, owners: Sequence[Node | None]) -> list[torch.Tensor] | None:
    """The kernel its backward runs, asked for the weight's and the bias's gradients alone."""
    weight, bias = _edge(node, 1), _edge(node, 2)
    x = node._saved_input  # type: ignore[attr-defined]
    if not _leaves(owners, weight, bias) or x.dtype != grad.dtype:
        return None
    with torch.no_grad():
        _, weight_grad, bias_grad = torch.ops.aten.native_layer_norm_backward(
            grad,
            x,
            node._saved_normalized_shape,  # type: ignore[attr-defined]
            node._saved_result1,  # type: ignore[attr-defined]
            node._saved_result2,  # type: ignore[attr-defined]
            node._saved_weight,  # type: ignore[attr-defined]
            node._saved_bias,  # type: ignore[attr-defined]
            [False, weight is not None, bias is not None],
        )
    return [weight_grad if owner is weight else bias_grad for owner in owners]


def _mul(node: Node, grad: torch.Tensor, owners: Sequence[Node | None]) -> list[torch.Tensor] | None:
    """A weight times an activation (either side): its gradient the other side's, times the gradient, summed to
    the weight's shape."""
    if len(owners) != 1:
        return None
    side = next((i for i in (0, 1) if _edge(node, i) is owners[0]), None)
    if side is None or not _leaves(owners, owners[0]):
        return None
    other = node._saved_other if side == 0 else node._saved_self  # type: ignore[attr-defined]
    if other is None or other.dtype != grad.dtype:
        return None
    shape = owners[0].variable.shape  # type: ignore[union-attr]
    with torch.no_grad():
        return [(grad * other).sum_to_size(shape)]


_DIRECT = {"AddmmBackward0": _addmm, "MmBackward0": _mm, "NativeLayerNormBackward0": _layer_norm, "MulBackward0": _mul}


def backward_input(
    outputs: Tensors, grads: Tensors, inputs: Tensors, params: Sequence[nn.Parameter], one_pass: bool = False
) -> tuple[Tensors, WeightPass]:
    """The gradient of every input that requires one, and what the weight pass will need.

    ``one_pass``: W as one autograd call from the outputs, for stages under activation
    checkpointing, whose forward each separate W call would recompute.
    """
    wanted = [x for x in inputs if x.requires_grad]
    trainable = [p for p in params if p.requires_grad]
    if not outputs:  # nothing needs a gradient downstream (a frozen or detached stage): zeros go upstream
        return tuple(torch.zeros_like(x) for x in wanted), WeightPass()
    if not wanted:  # nothing flows upstream (the first stage): the whole backward is the weight pass
        return (), WeightPass(fallback=(outputs, grads, trainable) if trainable else None)
    input_nodes = {n for n in map(_node, wanted) if n is not None}
    roots = [n for n in map(_node, outputs) if n is not None]
    below, reached = _analyse(roots, input_nodes, {id(p): p for p in trainable})
    now = {w for node, ws in below.items() if _compiled(node) for w in ws}  # their whole gradient in I
    weight_nodes = reached
    if now:  # W's analysis without them: autograd gives I their every path's share
        below = {
            node: rest
            for node, ws in below.items()
            if not _compiled(node) and (rest := [w for w in ws if w not in now])
        }
        weight_nodes = {node: p for node, p in reached.items() if node not in now}
    owner: dict[Node, int] = {}
    for ws in below.values():
        for weight in ws:
            owner[weight] = owner.get(weight, 0) + 1
    weight_pass = WeightPass()
    kept: dict[Node, list[torch.Tensor | None]] = {}
    handles: list[torch.utils.hooks.RemovableHandle] = []
    if not weight_nodes:  # no trainable weight beneath (or all in I): nothing for W to do
        pass
    elif one_pass or any(count > 1 for count in owner.values()) or owner.keys() != weight_nodes.keys():
        # a weight beneath several input-path nodes, or beneath none (off the input path): one plain W call
        weight_pass.fallback = (outputs, grads, list(weight_nodes.values()))
    else:

        def keeper(node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
            def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
                kept[node] = list(grad_outputs)

            return hook

        handles = [node.register_prehook(keeper(node)) for node in below]
    whole = [reached[node] for node in now]
    try:  # the graph is kept only for a W to come
        made = torch.autograd.grad(
            outputs, [*wanted, *whole], grads, retain_graph=bool(weight_nodes), allow_unused=True
        )
    except RuntimeError as error:
        if "donated buffers" not in str(error):
            raise
        raise RuntimeError(
            "a torch.compile'd region of this stage was compiled with donated buffers (it ran before the engine was "
            "built), and a split backward keeps its graph for W, which they forbid: build the PipelineEngine before "
            "the compiled model's first call, or set torch._functorch.config.donated_buffer = False before it"
        ) from error
    finally:
        for handle in handles:
            handle.remove()
    input_grads = made[: len(wanted)]
    WeightPass._accumulate(whole, made[len(wanted) :])
    if weight_pass.fallback is None:
        weight_pass.roots = [
            Root(node, kept[node], [weight_nodes[w] for w in below[node]], below[node]) for node in kept
        ]
    result = tuple(g if g is not None else torch.zeros_like(x) for g, x in zip(input_grads, wanted, strict=True))
    return result, weight_pass


def keep_compiled_graphs() -> None:
    """Compile regions whose backward may run while the graph is kept (torch._functorch.config.donated_buffer off:
    a process-wide setting, read when a region is first compiled)."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False


def _compiled(node: Node) -> bool:
    """A torch.compile'd region: its backward makes its input and weight gradients in one call."""
    return type(node).__name__ == "CompiledFunctionBackward"


def _analyse(
    roots: list[Node], inputs: set[Node], params: dict[int, nn.Parameter]
) -> tuple[dict[Node, list[Node]], dict[Node, nn.Parameter]]:
    """Each node on a path to an input that has weights directly beneath it (in graph order: children first), with
    those weights; and every weight reached (the gradient accumulator of one of ``params``, by id), with its
    parameter: read off the accumulator (``AccumulateGrad.variable``), where asking a parameter for its accumulator
    makes a view of it (some microseconds each, a stage's every parameter at each micro-batch).

    "Directly beneath" means reachable through children that are not on an input path.
    """
    order: list[Node] = []  # every node reachable from the roots, children before parents
    kids: dict[Node, list[Node]] = {}  # each node's children: next_functions makes its tuples anew at each read
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
        elif node not in kids:
            children = kids[node] = [child for child, _ in node.next_functions if child is not None]
            stack.append((node, True))
            stack += [(child, False) for child in children if child not in kids]
    none: frozenset[Node] = frozenset()  # most nodes have no weight beneath them: one empty set for them all
    leads_in: dict[Node, bool] = {}
    under: dict[Node, frozenset[Node] | set[Node]] = {}  # weights reachable through non-input-path nodes only
    reached: dict[Node, nn.Parameter] = {}
    for node in order:
        if not kids[node] and type(node).__name__ == "AccumulateGrad":
            param = params.get(id(node.variable))  # type: ignore[attr-defined]
            if param is not None:
                reached[node] = param
        leads, found = node in inputs, ({node} if node in reached else none)
        for child in kids[node]:
            if leads_in[child]:
                leads = True
            elif under[child]:
                found = found | under[child]
        leads_in[node], under[node] = leads, found
    below = {n: sorted(under[n], key=id) for n in order if leads_in[n] and n not in inputs and under[n]}
    return below, reached
