"""The model config's own tensor-parallel plan, translated to the Sequential's module names, with its heads checked."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["tp_plan"]


def tp_plan(model: nn.Module) -> dict[str, object]:
    """The model config's own tensor-parallel plan (``base_model_tp_plan``), for ``tp_plan=`` on the Sequential:
    HF's "layers.*.self_attn.q_proj": "colwise" becomes "*.layer.self_attn.q_proj": ColwiseParallel(). A degree that
    does not divide the attention heads and the key-value heads is refused when the engine is built, naming them."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    heads: int | None = getattr(config, "num_attention_heads", None)
    kv_heads: int = getattr(config, "num_key_value_heads", None) or heads or 1
    out: dict[str, object] = {}
    for key, style in plan.items():
        head, _, rest = key.partition(".*.")
        if head not in ("layers", "h") or style not in ("colwise", "rowwise"):
            raise ValueError(
                f"{type(model).__name__}'s tp plan entry {key!r}: {style!r} is not one pipeengine.hf translates "
                f"(per-layer 'colwise' and 'rowwise' entries); pass tp_plan= by hand"
            )
        made: Any = ColwiseParallel() if style == "colwise" else RowwiseParallel()
        if "attn" in rest and heads is not None:
            made.check_degree = _heads(type(model).__name__, heads, kv_heads)
        out[f"*.layer.{rest}"] = made
    if not out:
        raise ValueError(f"{type(model).__name__}'s config has no base_model_tp_plan to translate")
    return out


def _heads(name: str, heads: int, kv_heads: int) -> Any:
    def check(degree: int) -> None:
        """Each tensor-parallel rank computes whole heads: the degree divides both head counts."""
        if heads % degree or kv_heads % degree:
            fits = max(d for d in range(1, degree + 1) if heads % d == 0 and kv_heads % d == 0)
            raise ValueError(
                f"tensor_parallel={degree} splits {name}'s attention by heads, and its {heads} attention heads and "
                f"{kv_heads} key-value heads do not both divide by {degree}: use a tensor_parallel that divides both "
                f"(e.g. {fits}), or a plan that "
                "leaves attention whole"
            )

    return check
