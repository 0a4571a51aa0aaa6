"""Tiny Hugging Face causal LMs of each family, built from configs (nothing is downloaded), and their batches: for
tests/pipeengine/test_hf.py and the composition matrix. transformers is imported when a model is built."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from pipeengine import hf
from tests.pipeengine.models import SEEDED

VOCAB, LENGTH = 64, 8

# fmt: off
FAMILIES: dict[str, tuple[str, str, dict[str, object]]] = {  # family: (config, model, what makes it itself)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 3,
                                                         "max_window_layers": 1}),  # layer 1 slides, 0 does not
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 3}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 3, "pad_token_id": 0}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": 3, "bos_token_id": 0,
                                                                 "eos_token_id": 0}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "sliding_window": 3}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 16,
                                                            "shared_expert_intermediate_size": 32}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # a step outside the decoder layers, taken as the model takes it (a small softcap: one that changes the logits)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "sliding_window": 3, "final_logit_softcapping": 0.5,
                                                     "layer_types": ["sliding_attention", "full_attention"]}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),  # logit_scale 0.0625
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 2.0, "logits_scaling": 4.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "sliding_window": 3,
                                                         "final_logit_softcapping": 0.5,
                                                         "layer_types": ["sliding_attention", "full_attention"]}),
}
# fmt: on


def build(family: str, layers: int = 2, tied: bool = True, **options: object) -> nn.Module:
    """A tiny causal LM of the family, the same weights on every rank (no dropout: equal to one process)."""
    transformers: Any = importlib.import_module("transformers")  # imported only here: pip install transformers

    small = {"vocab_size": VOCAB, "tie_word_embeddings": tied}
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_embd=32,
            n_layer=layers,
            n_head=4,
            n_positions=LENGTH,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            **small,
            **options,
        )
        kind = transformers.GPT2LMHeadModel
    else:
        config_name, model_name, own = FAMILIES[family]
        sizes = {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": LENGTH,
        }
        config = getattr(transformers, config_name)(**{**sizes, **small, **own, **options})
        kind = getattr(transformers, model_name)
    with SEEDED:
        torch.manual_seed(0)
        return kind(config)  # type: ignore[no-any-return]


def batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows: labels -100 on the padding (and the ids there arbitrary, as a collator leaves them); no id
    below 2, the pad tokens of the families (a row starting with one would be a left-padded row, refused)."""
    generator = torch.Generator().manual_seed(4000 + seed)
    ids = torch.randint(2, VOCAB, (size, LENGTH), generator=generator)
    labels = ids.clone()
    lengths = torch.randint(2, LENGTH + 1, (size,), generator=generator)
    labels[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = hf.IGNORE
    return ids, labels
