"""Issue 59: a layer's FLOPs and bytes from its shapes on the meta device, priced as a roofline per op.

The FLOPs ``trace`` records are FlopCounterMode's for every layer kind (its formulas are reused, so this checks
the reuse: the same ops reached, decomposed the same way, each counted once, forward and backward told apart);
bytes are checked by hand; a 70B-shaped Llama is planned here without allocating it.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from pipeengine.planner.cluster.costs import Op, fused_attention, trace
from pipeengine.planner.cluster.roofline import LayerCost
from tests.pipeengine.parity import backward_from_ones

transformers = pytest.importorskip("transformers")

FLOAT = 4  # bytes of a float32
VIEWS = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "slice", "select", "unsqueeze"}
VIEWS |= {"squeeze", "detach", "alias", "as_strided", "split", "unbind", "empty", "empty_like", "new_empty_strided"}


def counted(
    module: nn.Module, *inputs: Any, kwargs: Mapping[str, Any] | None = None, fused: bool = True
) -> tuple[int, int]:
    """FlopCounterMode's totals for the forward and for the backward (a gradient of ones on each output)."""
    with ExitStack() as stack:
        if fused:
            stack.enter_context(fused_attention())
        with FlopCounterMode(display=False) as counter:
            out = module(*inputs, **(kwargs or {}))
        forward = counter.get_total_flops()
        roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        with FlopCounterMode(display=False) as counter:
            backward_from_ones(roots)
    return forward, counter.get_total_flops()


class Attention(nn.Module):
    """A small self-attention through F.scaled_dot_product_attention, grouped key/value heads."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))  # type: ignore[no-any-return]


def tiny_llama_config(**overrides: Any) -> Any:
    settings: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return transformers.LlamaConfig(**{**settings, **overrides})


def llama_layer_inputs(model: Any, batch: int, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, Any]]:
    """A decoder layer's inputs as LlamaModel.forward passes them (no padding: a causal mask of None)."""
    hidden = torch.randn(batch, seq, model.config.hidden_size, dtype=dtype, requires_grad=True)
    positions = torch.arange(seq)[None]
    return hidden, {"attention_mask": None, "position_embeddings": model.rotary_emb(hidden, positions)}


def cases() -> dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]]:
    def x(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, requires_grad=True)

    def llama_layer() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        model = transformers.LlamaModel(tiny_llama_config())
        hidden, kwargs = llama_layer_inputs(model, 2, 8, torch.float32)
        return model.layers[0], (hidden,), kwargs

    return {
        "linear": lambda: (nn.Linear(16, 24), (x(3, 5, 16),), {}),
        "embedding": lambda: (nn.Embedding(50, 16), (torch.randint(0, 50, (3, 7)),), {}),
        "layernorm": lambda: (nn.LayerNorm(16), (x(3, 5, 16),), {}),
        "rmsnorm": lambda: (nn.RMSNorm(16), (x(3, 5, 16),), {}),
        "gelu": lambda: (nn.GELU(), (x(3, 5, 16),), {}),
        "sdpa": lambda: (Attention(), (x(2, 8, 32),), {}),
        "sdpa_mask": lambda: (Attention(), (x(2, 8, 32), torch.ones(8, 8, dtype=torch.bool).tril()), {}),
        "encoder_layer": lambda: (
            nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True),
            (x(2, 8, 32),),
            {},
        ),
        "llama_layer": llama_layer,
        "llama_model": lambda: (
            transformers.LlamaModel(tiny_llama_config()),
            (torch.randint(0, 64, (2, 8)),),
            {},
        ),
    }


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "math"])
@pytest.mark.parametrize("name", list(cases()))
def test_flops_equal_flop_counter_mode(name: str, fused: bool) -> None:
    with torch.device("meta"):
        module, inputs, kwargs = cases()[name]()
    cost = LayerCost.of(module, *inputs, example_kwargs=kwargs, fused=fused)
    try:
        forward, backward = counted(module, *inputs, kwargs=kwargs, fused=fused)
    except AssertionError as refused:  # torch 2.11's formulas (seen on a lent GPU); 2.13's count grouped heads
        pytest.skip(f"this torch's FlopCounterMode cannot count grouped-query attention: {refused}")
    assert (cost.flops("forward"), cost.flops("backward")) == (forward, backward)
    assert not {op.name.split(".")[1] for op in cost.ops} & VIEWS  # views move nothing: not recorded
    assert {op.kind for op in cost.ops if op.flops} <= {"matmul", "attention"}
    attention = [op.name for op in cost.ops if op.kind == "attention"]
    if fused and name in ("sdpa", "sdpa_mask", "encoder_layer", "llama_layer", "llama_model"):
        kernel = "efficient" if name == "sdpa_mask" else "flash"
        assert {op.phase for op in cost.ops if op.kind == "attention"} == {"forward", "backward"}
        assert all(kernel in op for op in attention), attention
        assert cost.flops(kind="attention") > 0
    else:
        assert attention == []
    if name in ("linear", "sdpa", "encoder_layer", "llama_layer", "llama_model"):
        assert forward > 0 and backward > 0


@pytest.mark.parametrize("name", ["linear", "embedding", "layernorm", "rmsnorm", "gelu"])
def test_meta_flops_equal_a_real_cpu_run(name: str) -> None:
    with torch.device("meta"):
        module, inputs, kwargs = cases()[name]()
    torch.manual_seed(0)
    real, real_inputs, _ = cases()[name]()
    cost = LayerCost.of(module, *inputs)
    assert (cost.flops("forward"), cost.flops("backward")) == counted(real, *real_inputs, fused=False)


def test_fused_attention_matches_sdpa_shape_and_grads() -> None:
    with torch.device("meta"):
        q = torch.randn(2, 4, 8, 16, requires_grad=True)
        k = torch.randn(2, 2, 8, 16, requires_grad=True)
        mask = torch.ones(8, 8, dtype=torch.bool).tril()
        for attn_mask in (None, mask):
            with fused_attention():
                out = F.scaled_dot_product_attention(q, k, k, attn_mask=attn_mask, enable_gqa=True)
            assert out.shape == q.shape
            q.grad = k.grad = None
            backward_from_ones([out])
            assert q.grad is not None and k.grad is not None and q.grad.shape == q.shape and k.grad.shape == k.shape


def test_linear_bytes_by_hand() -> None:
    with torch.device("meta"):
        linear = nn.Linear(16, 24)
        x = torch.randn(10, 16, requires_grad=True)
    ops = trace(linear, x)
    forward = [op for op in ops if op.phase == "forward"]
    assert [(op.name, op.kind) for op in forward] == [("aten.addmm.default", "matmul")]
    assert forward[0].bytes == (10 * 16 + 16 * 24 + 24 + 10 * 24) * FLOAT  # input, weight, bias, output
    assert forward[0].flops == 2 * 10 * 16 * 24
    backward = sorted((op.name, op.bytes) for op in ops if op.phase == "backward")
    assert backward == sorted(
        [
            ("aten.mm.default", (10 * 24 + 24 * 16 + 10 * 16) * FLOAT),  # grad input = grad @ weight
            ("aten.mm.default", (24 * 10 + 10 * 16 + 24 * 16) * FLOAT),  # grad weight = grad.T @ input
            ("aten.sum.dim_IntList", (10 * 24 + 24) * FLOAT),  # grad bias
        ]
    )
    assert trace(linear, x) == ops  # nothing was accumulated into .grad: a second trace is the same
    assert linear.weight.grad is None and x.grad is None
    assert [op.phase for op in trace(linear, x, backward=False)] == ["forward"]


def test_broadcast_input_is_read_once() -> None:
    with torch.device("meta"):
        x = torch.randn(8, 16)
        row = torch.randn(16).expand(8, 16)

    class Add(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    (op,) = trace(Add(), x, row)
    assert op.bytes == (8 * 16 + 16 + 8 * 16) * FLOAT


def test_time_is_a_roofline_per_op() -> None:
    peak, efficiency, bandwidth, vector = 100e12, 0.5, 1e12, 10e12
    tokens, width = 4096, 1024
    with torch.device("meta"):
        linear = nn.Linear(width, width)
        x = torch.randn(tokens, width, requires_grad=True)
        gelu_in = torch.randn(1024, 1024, requires_grad=True)
    matmul = 2 * tokens * width * width / (peak * efficiency)  # each of the three matmuls: compute-bound
    assert matmul > (2 * tokens * width + width * width) * FLOAT / bandwidth
    bias_grad = (tokens * width + width) * FLOAT / bandwidth  # the sum over tokens: memory-bound
    times = LayerCost.of(linear, x).time(peak, efficiency, bandwidth, vector_flops=vector)
    assert times.forward == pytest.approx(matmul)
    assert times.backward == pytest.approx(2 * matmul + bias_grad)

    gelu = LayerCost.of(nn.GELU(), gelu_in)
    assert gelu.flops() == 0
    times = gelu.time(peak, efficiency, bandwidth, vector_flops=vector)
    assert times.forward == pytest.approx(2 * 1024 * 1024 * FLOAT / bandwidth)  # read x, write y
    assert times.backward == pytest.approx(3 * 1024 * 1024 * FLOAT / bandwidth)  # read grad and x, write dx

    def by_shape(op: Op) -> float:  # an efficiency measured at a shape
        return 0.25 if op.shapes[-1] == (width, width) else 0.5

    slower = LayerCost.of(linear, x).time(peak, by_shape, bandwidth, vector_flops=vector)
    assert slower.forward == pytest.approx(2 * matmul)  # addmm(bias, x, weight.T): its last input is the weight
    with pytest.raises(ValueError, match="efficiency"):
        LayerCost.of(linear, x).time(peak, 1.5, bandwidth)


def test_grouped_query_attention_counts_the_same_where_torchs_formulas_refuse_grouped_heads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11's attention formulas refuse fewer key/value heads than query heads (an AssertionError); the trace
    then counts with the heads repeated, which is what torch 2.13's formulas count (the registry as installed here,
    against one made as strict as 2.11's)."""
    from pipeengine.planner.cluster import costs

    with torch.device("meta"):
        module, inputs, kwargs = cases()["llama_layer"]()
    assert module.self_attn.config.num_key_value_heads < module.self_attn.config.num_attention_heads
    as_installed = LayerCost.of(module, *inputs, example_kwargs=kwargs)

    refusals: list[str] = []

    def strict(formula: Any) -> Any:
        def refusing(*args: Any, **kwargs: Any) -> Any:
            heads = {a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4}
            if len(heads) > 1:
                refusals.append(f"heads {sorted(heads)}")
                raise AssertionError(f"heads differ: {sorted(heads)}")
            return formula(*args, **kwargs)

        return refusing

    registry = dict(costs.flop_registry)
    attention = {packet for packet in registry if packet in costs._ATTENTION}
    monkeypatch.setattr(costs, "flop_registry", {p: strict(f) if p in attention else f for p, f in registry.items()})
    strict_cost = LayerCost.of(module, *inputs, example_kwargs=kwargs)
    assert refusals, "the strict formulas were asked for grouped heads (the fused kernels' forward and backward)"
    assert strict_cost.flops(kind="attention") > 0
    for phase in ("forward", "backward"):
        assert strict_cost.flops(phase) == as_installed.flops(phase)


def test_phase_totals_per_kind() -> None:
    with torch.device("meta"):
        module, inputs, kwargs = cases()["llama_layer"]()
    cost = LayerCost.of(module, *inputs, example_kwargs=kwargs)
    for phase in ("forward", "backward"):
        totals = cost.phase(phase)
        assert sum(totals.flops.values()) == cost.flops(phase)
        assert sum(totals.bytes.values()) == cost.bytes(phase)
        assert all(totals.flops[kind] > 0 for kind in ("matmul", "attention"))
    assert cost.forward == cost.phase("forward") and cost.backward == cost.phase("backward")


def test_refuses_a_module_not_on_meta() -> None:
    with pytest.raises(ValueError, match="meta device: weight"):
        trace(nn.Linear(4, 4), torch.randn(2, 4, device="meta"))
    with torch.device("meta"):
        linear = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta inputs"):
        trace(linear, torch.randn(2, 4))


def test_a_70b_llama_is_planned_without_allocating_it() -> None:
    """Llama-3-70B's shapes, all 80 layers built on meta; the embedding, one decoder layer and the head traced."""
    config = tiny_llama_config(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    )
    batch, seq = 1, 4096
    model_class = transformers.LlamaForCausalLM  # imported (lazily, by transformers) before the measure
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with torch.device("meta"):
        model = model_class(config).to(torch.bfloat16)
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        hidden, kwargs = llama_layer_inputs(model.model, batch, seq, torch.bfloat16)
        head = nn.Sequential(model.model.norm, model.lm_head)
    assert sum(p.numel() for p in model.parameters()) > 70e9
    assert all(p.is_meta for p in model.parameters())

    start = time.perf_counter()
    layer = LayerCost.of(model.model.layers[0], hidden, example_kwargs=kwargs)
    layer_seconds = time.perf_counter() - start
    embedding = LayerCost.of(model.model.embed_tokens, ids)
    lm_head = LayerCost.of(head, hidden)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    print(f"70B decoder layer traced in {layer_seconds:.3f} s; peak RSS grew {grown:.1f} MB")

    assert layer_seconds < 1.0
    assert grown < 200  # one decoder layer's bf16 weights alone would be 1.7 GB
    assert not torch.cuda.is_initialized()
    assert all(p.is_meta and p.grad is None for p in model.parameters())
    # 2 FLOPs a weight a token forward, 4 backward, for the layer's matmuls; attention's per the registry
    layer_weights = sum(p.numel() for p in model.model.layers[0].parameters() if p.dim() == 2)
    attention = 4 * batch * config.num_attention_heads * seq * seq * (config.hidden_size // 64)
    assert layer.flops("forward") == 2 * layer_weights * batch * seq + attention
    assert layer.flops("forward", "attention") == attention
    assert layer.flops("backward", "matmul") == 4 * layer_weights * batch * seq
    assert lm_head.flops("forward") == 2 * config.vocab_size * config.hidden_size * batch * seq
    assert embedding.flops() == 0 and embedding.bytes("backward") > 0
    step = (embedding.time(989e12, 0.6, 3.35e12), layer.time(989e12, 0.6, 3.35e12), lm_head.time(989e12, 0.6, 3.35e12))
    assert all(t.forward > 0 and t.backward > t.forward for t in step[1:])


def test_the_weights_gradients_are_marked_as_the_backward_a_split_defers() -> None:
    """W: the ops the split backward's I does not run (each Linear's weight-gradient matmul and bias sum); I: the
    rest (the input-gradient matmuls, GELU's backward, and the RMSNorm's backward with its scale's gradient, which
    pipeengine.step.backward makes in I). Where no input wants a gradient, all of it is W."""
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.RMSNorm(16), nn.Linear(16, 4))
        x = torch.empty(32, 8, requires_grad=True)
    ops = [op for op in trace(layers, x) if op.phase == "backward"]
    weight = [op for op in ops if op.weight]
    assert sorted(op.name for op in weight) == ["aten.mm.default"] * 2 + ["aten.sum.dim_IntList"] * 2
    assert sum(op.flops for op in weight) == 2 * 32 * (8 * 16 + 16 * 4)  # each weight's x^T dy
    assert sum(op.flops for op in ops if not op.weight) == 2 * 32 * (4 * 16 + 16 * 8)  # each input's dy W
    assert all(op.weight for op in trace(layers, x.detach()) if op.phase == "backward")
    assert not any(op.weight for op in trace(layers, x) if op.phase == "forward")
