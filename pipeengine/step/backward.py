"""Split backward for zero-bubble schedules: input gradients now (I), weight gradients later (W).

Nothing is recomputed. Let P be the autograd nodes that lead to a stage input: I runs autograd to the inputs only,
so each P node computes only its input-side gradients, while a prehook keeps the gradient arriving at every P node
that also has weights beneath it. W computes those weights from the kept gradient: a Linear's from what its node
saved, as its backward would (``_direct_weights``: the gradient's transpose times the saved input, added into .grad
by the GEMM itself; no autograd re-entry, which costs a graph task and a walk of the graph below the node each
time); any other node's by re-entering it with its kept gradient and asking for those weights alone, so that it
computes only its weight-side outputs::

    output ─► [P] Addmm ─► [P] ... ─► input          I: dY flows down P, dX comes out
                 └─► weight (not in P)               W: restart at Addmm with its dY, ask for weight

W is the weight GEMMs, which is what zero-bubble puts off (Qi et al. 2024). An element-wise node's weights (a
norm's scale and shift, a weight multiplied or added in) cost a pass over the activation: I asks for them too,
while the node's gradient is there, rather than keep that gradient for W to read again later (``_in_i``).

When one weight lies beneath several P nodes (a weight used twice in the stage), per-node calls would count it
twice; then W falls back to one autograd call from the outputs, which repeats the input-side gradient work but
stays exact. Where W calls autograd, autograd accumulates into .grad, as B does: the weights' hooks run.

A torch.compile'd region is one autograd node (CompiledFunctionBackward) whose backward makes its input and weight
gradients together: re-entering it in W would run it twice. Its weights are asked for in I, which then holds their
whole gradient, and W leaves them alone::

    output ─► [P] CompiledFunction ─► input       I: dX, and d(weights beneath it), in one call
                 └─► weights                       W: nothing for them

W re-enters the graph I kept (retain_graph): AOTAutograd's donated buffers, which free saved tensors during a
compiled backward, forbid that, so a split backward turns them off (``keep_compiled_graphs``) before the first
compiled call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
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
        if self.fallback is not None:  # autograd accumulates, as in B: the weights' hooks run
            outputs, grads, params = self.fallback
            torch.autograd.backward(outputs, grads, inputs=params)
        with torch.no_grad():  # the formulas read activations the graph saved: nothing of theirs is recorded
            again = [root for root in self.roots if not _direct_weights(*root)]
        for index, (node, kept, params, _) in enumerate(again):  # no formula: autograd from the node
            edges = [GradientEdge(node, i) for i, g in enumerate(kept) if g is not None]
            values = [g for g in kept if g is not None]
            torch.autograd.backward(edges, values, inputs=params, retain_graph=index < len(again) - 1)
        self.roots, self.fallback = [], None
        return calls + len(again)

    @staticmethod
    def _accumulate(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
        """Into .grad, in place as autograd's AccumulateGrad does (``param.grad + grad`` would hold a third copy), and
        then each parameter's post-accumulate hooks, which AccumulateGrad would run (autograd.grad returned these
        gradients: a compiled region's weights, made in I, whatever hooks they have)."""
        for param, grad in zip(params, grads, strict=True):
            if grad is not None:
                _add(param, grad)
                for hook in (param._post_accumulate_grad_hooks or {}).values():
                    hook(param)


def _own(param: nn.Parameter, grad: torch.Tensor | None, shared: Counter[int]) -> torch.Tensor | None:
    """A gradient autograd returned, as .grad may take it (autograd's AccumulateGrad rule): itself where it is laid
    out as the parameter and holds its memory alone, else a copy. Autograd hands one tensor on untouched where it can:
    ``x + bias`` with a bias of x's shape gives the bias the incoming gradient itself, which is also x's (and may be
    expanded, stride 0); .grad must not be either, since a later micro-batch adds into it."""
    if type(grad) is not torch.Tensor or grad.layout != torch.strided:  # None, a DTensor's: as autograd gave it
        return grad
    alone = shared[grad.untyped_storage().data_ptr()] == 1 and grad.storage_offset() == 0
    if (
        alone
        and grad.stride() == param.stride()
        and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
    ):
        return grad
    return torch.empty_like(param, memory_format=torch.preserve_format).copy_(grad)


def _add(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _direct_weights(
    node: Node, kept: list[torch.Tensor | None], params: list[nn.Parameter], owners: list[Node]
) -> bool:
    """W of a node whose weight gradients are a formula of what it saved and the gradient I kept: a Linear's
    (``addmm(bias, x, weight.t())`` or ``mm(x, weight.t())``, as F.linear records it), computed as its backward
    computes them, without re-entering autograd (each re-entry sets up a graph task and walks the graph below its
    node: about 0.1 ms on a CPU, where the formula's Python takes microseconds), and added into .grad. False, and
    nothing added, for anything else (W re-enters): another node, a weight not beneath it as a leaf (autocast's
    cast, a computed weight), a DTensor's (tensor parallel, FSDP's shards), a weight with gradient hooks, mixed
    dtypes, a scaled addmm. Under no_grad (``WeightPass.run``)."""
    handler = _DIRECT.get(type(node).__name__)
    if handler is None or len(kept) != 1 or len(params) > 2:
        return False
    grad = kept[0]
    if grad is None:
        return False
    if not all(p.dtype == grad.dtype and _plain(p) for p in params):
        return False
    return handler(node, grad, params, owners)


def _plain(param: nn.Parameter) -> bool:
    """A parameter whose gradient may be handed to its .grad by us: no gradient hooks to run, not a DTensor (tensor
    parallel's, FSDP's shards)."""
    return not (param._backward_hooks or param._post_accumulate_grad_hooks or is_dtensor(param))


def _edge(node: Node, index: int) -> Node | None:
    return node.next_functions[index][0]


def _leaves(owners: Sequence[Node | None], *edges: Node | None) -> bool:
    """The weights beneath the node are exactly these leaves (None: an edge without a gradient)."""
    return set(owners) == {e for e in edges if e is not None} and all(
        type(e).__name__ == "AccumulateGrad" for e in owners
    )


def _addmm(node: Node, grad: torch.Tensor, params: list[nn.Parameter], owners: list[Node]) -> bool:
    if node._saved_alpha != 1 or node._saved_beta != 1:  # type: ignore[attr-defined]
        return False
    x = node._saved_mat1  # type: ignore[attr-defined]
    return _linear(node, grad, params, owners, _edge(node, 0), _edge(node, 2), x)


def _mm(node: Node, grad: torch.Tensor, params: list[nn.Parameter], owners: list[Node]) -> bool:
    return _linear(node, grad, params, owners, None, _edge(node, 1), node._saved_self)  # type: ignore[attr-defined]


def _linear(
    node: Node,
    grad: torch.Tensor,
    params: list[nn.Parameter],
    owners: list[Node],
    bias: Node | None,
    transposed: Node | None,
    x: torch.Tensor,
) -> bool:
    """The weight's gradient ``grad.t() @ x``: by the GEMM itself into an existing .grad (addmm_: no gradient tensor
    made, and no pass over .grad to add it, which B's AccumulateGrad pays for every micro-batch after a step's
    first); the bias's, ``grad`` summed over rows."""
    if transposed is None or type(transposed).__name__ != "TBackward0" or x.dtype != grad.dtype:
        return False
    weight = _edge(transposed, 0)
    if not _leaves(owners, weight, bias):
        return False
    # the bias's sum first, reading the kept gradient in order, then the GEMM: in ZB-V on 4 gloo ranks (the benchmark
    # MLP, a Linear(1024) a stage), a later W's addmm_ took 1.17 ms as W's first op and 0.77 ms after the sum
    for param, owner in sorted(zip(params, owners, strict=True), key=lambda pair: pair[1] is weight):
        if owner is not weight:
            _add(param, grad.sum(0))
            continue
        held = param.grad
        if held is None or held.layout != torch.strided or held.dtype != grad.dtype or not held.is_contiguous():
            _add(param, grad.t().mm(x))
        else:
            held.addmm_(grad.t(), x)
    return True


_DIRECT: dict[str, Callable[[Node, torch.Tensor, list[nn.Parameter], list[Node]], bool]] = {
    "AddmmBackward0": _addmm,
    "MmBackward0": _mm,
}


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
    below, reached, now = _plan(outputs, wanted, trainable)
    weight_nodes = reached
    if now:  # W's analysis without them: autograd gives I their every path's share
        below = {node: rest for node, ws in below.items() if (rest := [w for w in ws if w not in now])}
        weight_nodes = {node: p for node, p in reached.items() if node not in now}
    owner: dict[Node, int] = {}
    for ws in below.values():
        for weight in ws:
            owner[weight] = owner.get(weight, 0) + 1
    weight_pass = WeightPass()
    hooked = list(below)
    if not weight_nodes:  # no trainable weight beneath (or all in I): nothing for W to do
        hooked = []
    elif one_pass or any(count > 1 for count in owner.values()) or owner.keys() != weight_nodes.keys():
        # a weight beneath several input-path nodes, or beneath none (off the input path): one plain W call
        weight_pass.fallback = (outputs, grads, list(weight_nodes.values()))
        hooked = []
    kept: list[tuple[torch.Tensor | None, ...] | None] = [None] * len(hooked)  # each hooked node's, if it ran
    for index, node in enumerate(hooked):
        # left on the node, which this micro-batch's graph alone holds: removing each would cost more than the
        # hook does (it keeps nothing that refers back to the graph)
        node.register_prehook(partial(kept.__setitem__, index))
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
    input_grads = made[: len(wanted)]
    if whole:  # the memory each gradient here is on, to tell one handed on untouched (_own)
        shared = Counter(t.untyped_storage().data_ptr() for t in (*made, *grads) if type(t) is torch.Tensor)
        WeightPass._accumulate(whole, [_own(p, g, shared) for p, g in zip(whole, made[len(wanted) :], strict=True)])
    weight_pass.roots = [
        Root(node, list(arrived), [weight_nodes[w] for w in below[node]], below[node])
        for node, arrived in zip(hooked, kept, strict=True)
        if arrived is not None
    ]
    result = tuple(g if g is not None else torch.zeros_like(x) for g, x in zip(input_grads, wanted, strict=True))
    return result, weight_pass


def made_in_i(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], params: Sequence[nn.Parameter]
) -> list[nn.Parameter]:
    """The weights whose gradients ``backward_input`` makes in I (``_in_i``: a compiled region's, an element-wise
    node's), for a cost model to count their ops in I: none where no input needs a gradient (W is the whole
    backward then)."""
    wanted = [x for x in inputs if x.requires_grad]
    if not outputs or not wanted:
        return []
    _, reached, now = _plan(outputs, wanted, [p for p in params if p.requires_grad])
    return [reached[w] for w in now]


def _plan(
    outputs: Sequence[torch.Tensor], wanted: Sequence[torch.Tensor], trainable: Sequence[nn.Parameter]
) -> tuple[dict[Node, list[Node]], dict[Node, nn.Parameter], set[Node]]:
    """``_analyse`` from the outputs to the inputs that want a gradient, and the weights of those whose gradient I
    makes (their whole gradient: autograd gives I their every path's share)."""
    input_nodes = {n for n in map(_node, wanted) if n is not None}
    roots = [n for n in map(_node, outputs) if n is not None]
    below, reached = _analyse(roots, input_nodes, {id(p): p for p in trainable})
    return below, reached, {w for node, ws in below.items() if _in_i(node, ws, reached) for w in ws}


def keep_compiled_graphs() -> None:
    """Compile regions whose backward may run while the graph is kept (torch._functorch.config.donated_buffer off:
    a process-wide setting, read when a region is first compiled)."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False


_ELEMENT_WISE = frozenset(
    {"MulBackward0", "AddBackward0", "NativeLayerNormBackward0", "NativeGroupNormBackward0", "NativeBatchNormBackward0"}
)


def _in_i(node: Node, weights: list[Node], reached: dict[Node, nn.Parameter]) -> bool:
    """Whether the weights beneath the node have their gradient made in I. A torch.compile'd region's: its backward
    makes its input and weight gradients in one call. An element-wise node's (a norm's scale and shift, a weight
    multiplied or added in): a pass over the activation, made by I's autograd call while the node's gradient is
    there, where W would keep that gradient (its node's hook) and read it and the activation again later; W is
    left the weight GEMMs, which is what zero-bubble puts off (Qi et al. 2024; their Megatron patch's
    WeightGradStore holds the Linear layers' weight GEMMs alone). Not for a weight with gradient hooks or a
    DTensor's (those stay in W, which runs autograd's accumulation for them), nor one beneath it through other nodes
    (autocast's cast, a weight computed from others)."""
    name = type(node).__name__
    if name == "CompiledFunctionBackward":
        return True
    if name not in _ELEMENT_WISE:
        return False
    children = {child for child, _ in node.next_functions}
    return all(w in children and _plain(reached[w]) for w in weights)  # beneath it as leaves: not a cast, a GEMM


def _analyse(
    roots: list[Node], inputs: set[Node], params: dict[int, nn.Parameter]
) -> tuple[dict[Node, list[Node]], dict[Node, nn.Parameter]]:
    """Each node on a path to an input that has weights directly beneath it (children first), with those weights;
    and every weight reached (the gradient accumulator of one of ``params``, by id), with its parameter: read off the
    accumulator (``AccumulateGrad.variable``), where asking a parameter for its accumulator makes a view of it (some
    microseconds each, a stage's every parameter at each micro-batch).

    "Directly beneath" means reachable through children that are not on an input path. This runs at every I over
    every node of the stage's graph, so it does per node only what it must: one walk that puts the nodes in order,
    one pass over that order for the input paths; the few nodes off them are walked again for their weights.
    """
    kids: dict[Node, list[Node]] = {}  # each node's children: next_functions makes its tuples anew at each read
    order: list[Node] = []  # children before parents
    stack: list[Node | None] = list(roots)  # None: the node beneath it has its children in order
    pop, push = stack.pop, stack.append
    while stack:
        node = pop()
        if node is None:
            order.append(pop())  # type: ignore[arg-type]
        elif node not in kids:
            kids[node] = children = [child for child, _ in node.next_functions if child is not None]
            push(node)
            push(None)
            stack += children
    leads_in: dict[Node, bool] = {}
    off_path: list[tuple[Node, list[Node]]] = []  # input-path nodes with children off every input path
    reached: dict[Node, nn.Parameter] = {}
    for node in order:
        children = kids[node]
        if not children:
            leads_in[node] = node in inputs
            if type(node).__name__ == "AccumulateGrad":
                param = params.get(id(node.variable))  # type: ignore[attr-defined]
                if param is not None:
                    reached[node] = param
            continue
        leads, others = node in inputs, None
        for child in children:
            if leads_in[child]:
                leads = True
            elif others is None:
                others = [child]
            else:
                others.append(child)
        leads_in[node] = leads
        if leads and others and node not in inputs:
            off_path.append((node, others))
    below: dict[Node, list[Node]] = {}
    for node, others in off_path:  # the weights in the few nodes beneath them (a Linear's transpose, a cast)
        found: list[Node] = []
        seen: set[Node] = set()
        while others:
            child = others.pop()
            if child not in seen:
                seen.add(child)
                if child in reached:
                    found.append(child)
                else:
                    others += kids[child]
        if found:
            below[node] = found
    return below, reached
