"""A Hugging Face decoder-only model, described for the cluster planner from its config alone: nothing allocated.

``from_config(config, seq)`` builds, on the meta device, one decoder layer at a tensor-parallel rank's shapes (the
config with heads, key-value heads and the MLP's width divided by tp, as Megatron-style column/row sharding leaves
them on a rank; the head dimension kept) and the embedding, final norm and head, and traces them
(pipeengine.planner.cluster.costs) per (tp, micro-batch) when the pricing asks. The model's FLOPs per sequence are
PaLM's count (Chowdhery et al. 2022, appendix B): 6 N per token for N parameters, plus 12 l h s for attention.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeengine.planner.cluster.costs import Op, trace
from pipeengine.planner.cluster.layout import Transformer

__all__ = ["from_config", "load_config"]


def load_config(path: str | os.PathLike[str]) -> Any:
    """A Hugging Face config.json, as transformers' AutoConfig reads it (no weights, no network)."""
    from transformers import AutoConfig

    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON ({error}): give a Hugging Face config.json") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(
            f"{path} names no model_type: give a Hugging Face config.json (e.g. a model's, from its hub page)"
        )
    kind = data.pop("model_type")
    return AutoConfig.for_model(kind, **data)


def _sharded(config: Any, tp: int) -> Any:
    """The config a tensor-parallel rank computes with: heads, key-value heads and the MLP's width over tp."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(f"tensor_parallel={tp} does not divide the {heads} attention heads: choose a tp that does")
    local = copy.deepcopy(config)
    local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    local.num_attention_heads = heads // tp
    local.num_key_value_heads = max(1, kv // tp) if kv % tp == 0 or tp % kv == 0 else kv  # replicated where uneven
    local.intermediate_size = -(-config.intermediate_size // tp)
    return local


def from_config(config: Any, seq: int) -> Transformer:
    """The planner's description of a Hugging Face causal LM's config (the module docstring)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16

    def model_of(tp: int) -> Any:
        with torch.device("meta"):
            local = _sharded(config, tp)
            local.num_hidden_layers = 1
            return AutoModelForCausalLM.from_config(local, dtype=dtype)

    @functools.cache
    def block_ops(tp: int, micro_batch: int) -> list[Op]:
        model = model_of(tp)
        inner = model.model
        with torch.device("meta"):
            hidden = torch.empty(micro_batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
            positions = torch.arange(seq)[None]
            kwargs = (
                {"attention_mask": None, "position_embeddings": inner.rotary_emb(hidden, positions)}
                if hasattr(inner, "rotary_emb")
                else {"attention_mask": None}
            )
        return trace(inner.layers[0], hidden, example_kwargs=kwargs)

    @functools.cache
    def head_ops(tp: int, micro_batch: int) -> list[Op]:
        model = model_of(tp)
        with torch.device("meta"):
            tokens = torch.zeros(micro_batch, seq, dtype=torch.int64)
            ends = _Ends(model)
        return trace(ends, tokens)

    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parameters = float(sum(p.numel() for p in whole.parameters()))
    layers, hidden = config.num_hidden_layers, config.hidden_size
    flops = 6 * parameters * seq + 12 * layers * hidden * seq * seq
    return Transformer(
        layers,
        hidden,
        config.num_attention_heads,
        seq,
        config.vocab_size,
        parameters,
        block_ops,
        head_ops,
        flops_per_sequence=flops,
        fused_attention=True,
    )  # traced fused


class _Ends(nn.Module):
    """The embedding, the final norm and the head of a one-layer model: what the first and last stages add."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.embed, self.norm, self.head = model.model.embed_tokens, model.model.norm, model.lm_head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
