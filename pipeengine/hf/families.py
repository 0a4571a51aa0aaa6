"""Which Hugging Face families pipeengine.hf computes exactly, and how each masks its attention.

A family is listed only once a test holds it equal to ``model(input_ids, labels=...)`` (logits, loss,
every gradient; tests/pipeengine/test_hf.py). Anything else is refused, naming the config field the
adapter does not apply (a step the model takes outside its decoder layers) or the model type.

    masks "causal"   one causal mask for every layer
          "window"   the sliding window's mask on every layer while config.sliding_window is set
          "types"    per layer, as config.layer_types says ("full_attention" or "sliding_attention")
    steps            the config fields whose step outside the decoder layers the family takes, as its model does:
          embedding_multiplier     the embeddings times it (Granite)
          logits_scaling           the logits divided by it (Granite)
          logit_scale              the logits times it (Cohere)
          final_logit_softcapping  the logits capped: tanh(logits / cap) * cap (Gemma 2, 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__: list[str] = []


@dataclass(frozen=True)
class Family:
    masks: str  # "causal" | "window" | "types" (the module docstring)
    steps: tuple[str, ...] = ()  # config fields of the steps outside the decoder layers it takes (the docstring)


EXACT = {
    "llama": Family("causal"),
    "gemma": Family("causal"),
    "gpt2": Family("causal"),
    "qwen2": Family("types"),
    "qwen3": Family("types"),
    "mistral": Family("window"),
    "phi3": Family("window"),
    "starcoder2": Family("window"),
    "mixtral": Family("window"),
    "qwen2_moe": Family("types"),
    "olmo2": Family("causal"),
    "gemma2": Family("types", ("final_logit_softcapping",)),
    "gemma3_text": Family("types", ("final_logit_softcapping",)),
    "cohere": Family("causal", ("logit_scale",)),
    "granite": Family("causal", ("embedding_multiplier", "logits_scaling")),
}

# config fields whose step lies outside the decoder layers, which the adapter does not take: field -> (what it does,
# the value at which it does nothing)
UNHANDLED: dict[str, tuple[str, Any]] = {
    "final_logit_softcapping": ("caps the logits with tanh (Gemma 2, 3)", None),
    "logit_scale": ("scales the logits (Cohere)", None),
    "logits_scaling": ("divides the logits (Granite)", 1.0),
    "embedding_multiplier": ("scales the embeddings (Granite)", 1.0),
    "output_router_logits": ("adds the router's auxiliary loss to the loss (mixture of experts)", False),
    "use_bidirectional_attention": ("attends both ways (Gemma 3's bidirectional variant)", False),
}


def family_of(model: Any) -> Family:
    """The family of ``model`` (a transformers causal LM), or a ValueError naming what the adapter would get wrong."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    taken = EXACT[kind].steps if kind in EXACT else ()
    for field, (what, neutral) in UNHANDLED.items():
        value = getattr(config, field, neutral)
        if value is not None and value != neutral and field not in taken:
            raise ValueError(
                f"{type(model).__name__}: config.{field}={value!r} {what}, a step pipeengine.hf does not take: "
                "the pipeline's logits and loss would differ from the model's. Write its nn.Sequential by hand; "
                f"pipeengine.hf computes these families exactly: {', '.join(sorted(EXACT))}"
            )
    family = EXACT.get(kind)  # type: ignore[arg-type]
    if family is None:
        raise ValueError(
            f"{type(model).__name__} (config.model_type={kind!r}) is not a family pipeengine.hf has been checked to "
            f"compute exactly; it knows {', '.join(sorted(EXACT))}. Write its nn.Sequential by hand"
        )
    return family


def embedding_scale(family: Family, config: Any) -> float:
    """What the family multiplies the embeddings by outside the embedding module (1: nothing)."""
    return float(getattr(config, "embedding_multiplier", 1.0)) if "embedding_multiplier" in family.steps else 1.0


def logits_step(family: Family, config: Any) -> tuple[float, float, float | None]:
    """The logits' final step as the family's model takes it: (times, divided by, a softcap or None)."""
    times = float(config.logit_scale) if "logit_scale" in family.steps else 1.0
    divided = float(config.logits_scaling) if "logits_scaling" in family.steps else 1.0
    cap = getattr(config, "final_logit_softcapping", None) if "final_logit_softcapping" in family.steps else None
    return times, divided, cap


def layer_kinds(family: Family, config: Any, layers: int) -> list[str]:
    """Each decoder layer's attention: "full_attention" or "sliding_attention", as the model itself decides."""
    if family.masks == "types":
        return list(getattr(config, "layer_types", None) or ["full_attention"] * layers)[:layers]
    if family.masks == "window" and getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * layers
    return ["full_attention"] * layers
