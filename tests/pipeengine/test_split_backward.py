"""Split backward (pipeengine.step.backward): I to the stage's input now, W for its weights later. I makes the
gradients of weights an element-wise node holds (a LayerNorm's, an RMSNorm's scale); W computes a Linear's from what
its autograd node saved and the gradient I kept (no autograd re-entry), and re-enters autograd for anything else;
either way every gradient equals one autograd backward's (one process), in float32's tolerance."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pipeengine.step import backward
from tests.pipeengine.parity import OneProcess, close


class Scale(nn.Module):
    """An RMSNorm's learned scale (weight * x, or x * weight)."""

    def __init__(self, width: int, weight_first: bool) -> None:
        super().__init__()
        self.weight, self.weight_first = nn.Parameter(torch.randn(width)), weight_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x if self.weight_first else x * self.weight


class Shift(nn.Module):
    """A learned shift added in (x + bias)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


def stages() -> dict[str, tuple[nn.Module, int, int]]:
    """Stages, W's roots and the autograd calls W takes (its other roots are formulas of what the nodes saved)."""
    return {
        "linears": (nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8, bias=False)), 2, 0),
        "norms": (nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), Scale(8, True), Scale(8, False), Shift(8)), 1, 0),
        "conv": (nn.Sequential(nn.Conv1d(5, 5, 3, padding=1), nn.Tanh()), 1, 1),  # re-entered: no formula for it
    }


def split(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """I then W on ``module``: the input's gradient, W's roots and its autograd calls. After I, the weights of
    element-wise nodes (a norm, a scale, a shift) hold their gradient, and no other does."""
    xi = x.detach().requires_grad_()
    out = module(xi)
    (input_grad,), weight_pass = backward.backward_input((out,), (grad,), (xi,), list(module.parameters()))
    for name, param in module.named_parameters():
        in_i = isinstance(module.get_submodule(name.rpartition(".")[0]), (nn.LayerNorm, Scale, Shift))
        assert (param.grad is not None) == in_i, f"{name}: made in I {param.grad is not None}, expected {in_i}"
    roots = len(weight_pass.roots)
    return input_grad, roots, weight_pass.run()


@pytest.mark.parametrize("name", sorted(stages()))
def test_w_computes_what_it_can_from_the_saved_tensors_and_every_gradient_equals_one_process(name: str) -> None:
    torch.manual_seed(0)
    module, expected_roots, calls = stages()[name]
    one = OneProcess(module)
    x = torch.randn(3, 5, 8)
    grad = torch.randn(3, 5, 8)
    input_grad, roots, made = split(module, x, grad)
    assert roots == expected_roots and made == calls
    close(input_grad, one.input_gradient(x.requires_grad_(), grad), "the input gradient")  # type: ignore[arg-type]
    for (label, mine), theirs in zip(module.named_parameters(), one.parameters(), strict=True):
        close(mine.grad, theirs.grad, f"{label}'s gradient")  # type: ignore[arg-type]


def test_w_re_enters_autograd_for_a_weight_autocast_casts_or_one_with_a_gradient_hook() -> None:
    """A bf16-autocast Linear's weight reaches its matmul through a cast; a hooked weight's hook must run: both are
    left to autograd."""
    torch.manual_seed(0)
    hooked = nn.Linear(8, 8)
    calls: list[int] = []
    hooked.weight.register_hook(lambda g: calls.append(1))  # type: ignore[arg-type, return-value]
    for module, cast in ((nn.Linear(8, 8), True), (hooked, False)):
        x, grad = torch.randn(4, 8), torch.randn(4, 8)
        with torch.autocast("cpu", torch.bfloat16, enabled=cast):
            _, roots, made = split(module, x, grad)
        assert roots == made == 1
    assert calls  # the hook ran in W


def test_a_weight_with_a_gradient_hook_is_left_to_w_which_runs_the_hook() -> None:
    """An element-wise node's weight is made in I unless autograd must accumulate it (a gradient hook to run): then
    W re-enters autograd for it, the hook runs there, and the gradient equals one process's."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    one = OneProcess(module)
    seen: list[torch.Tensor] = []
    module[1].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))  # type: ignore[union-attr]
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    xi = x.detach().requires_grad_()
    _, weight_pass = backward.backward_input((module(xi),), (grad,), (xi,), list(module.parameters()))
    assert module[1].weight.grad is None and module[1].bias.grad is None  # the node's weights wait for W together
    assert not seen and weight_pass.run() == 1 and len(seen) == 1
    one.input_gradient(x.requires_grad_(), grad)
    for (label, mine), theirs in zip(module.named_parameters(), one.parameters(), strict=True):
        close(mine.grad, theirs.grad, f"{label}'s gradient")  # type: ignore[arg-type]
    # a first stage's W (no input wants a gradient) is one autograd call from the output: the hook runs there too
    _, weight_pass = backward.backward_input((module(x),), (grad,), (x.detach(),), list(module.parameters()))
    assert weight_pass.fallback is not None and weight_pass.run() == 1 and len(seen) == 2


def test_w_adds_a_linear_weights_gradient_into_the_grad_held_by_the_matmul_itself() -> None:
    """A later micro-batch's W: a Linear's weight gradient goes into the .grad already there by the matmul (addmm_),
    making no weight-sized tensor to add, and equals two whole backwards' sum; a .grad that is not a plain
    contiguous tensor (here held transposed) gets the product made and added, as before."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    one = OneProcess(module)
    batches = [(torch.randn(3, 5, 8), torch.randn(3, 5, 8)) for _ in range(3)]
    split(module, *batches[0])
    weights = {(16, 8), (8, 16)}
    assert later(module, *batches[1]) == set()  # no weight-sized tensor made: each added into its .grad
    last = module[2].weight
    last.grad = last.grad.t().contiguous().t()  # type: ignore[union-attr]  # held transposed: not addmm_'s
    assert later(module, *batches[2]) & weights == {(8, 16)}  # that one made, then added
    for x, grad in batches:
        one.input_gradient(x.requires_grad_(), grad)
    for (label, mine), theirs in zip(module.named_parameters(), one.parameters(), strict=True):
        close(mine.grad, theirs.grad, f"{label}'s gradient over three micro-batches")  # type: ignore[arg-type]


class Made(TorchDispatchMode):
    """The shapes of the tensors ops make under it: an op's output on storage of its own (not an input, nor a view
    of one)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        made = [
            t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given
        ]
        self.shapes |= {tuple(t.shape) for t in made if t.dim() == 2}
        return out


def later(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> set[tuple[int, ...]]:
    """I, then W under ``Made``, on ``module`` whose weights hold a .grad (a later micro-batch): the shapes of the
    2-d tensors W made (its formulas alone: no autograd call)."""
    xi = x.detach().requires_grad_()
    _, weight_pass = backward.backward_input((module(xi),), (grad,), (xi,), list(module.parameters()))
    with Made() as made:
        assert weight_pass.run() == 0
    return made.shapes


def test_a_gradient_autograd_hands_on_untouched_is_copied_before_grad_takes_it() -> None:
    """``x + bias`` with a bias of x's shape: autograd gives the bias the incoming gradient itself, which is also x's
    and here expanded (stride 0, as a loss's backward can give it). I makes the bias's gradient (an element-wise
    node's): .grad gets a copy laid out as the bias, so the next micro-batch adds into it (an expanded .grad refused
    the add) and the input gradient already sent upstream is left as it was."""
    bias = nn.Parameter(torch.zeros(3, 8))
    input_grads = []
    for _ in range(2):
        x = torch.randn(3, 8, requires_grad=True)
        grad = torch.ones(1, 1).expand(3, 8)
        (input_grad,), weight_pass = backward.backward_input((x + bias,), (grad,), (x,), [bias])
        assert weight_pass.run() == 0 and bias.grad is not None
        assert bias.grad.stride() == bias.stride() and bias.grad.data_ptr() != input_grad.data_ptr()
        input_grads.append(input_grad)
    assert torch.equal(bias.grad, torch.full((3, 8), 2.0))  # type: ignore[arg-type]
    assert all(torch.equal(g, torch.ones(3, 8)) for g in input_grads)
