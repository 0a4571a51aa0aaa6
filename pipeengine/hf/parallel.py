"""The model config's own tensor-parallel plan, translated to the Sequential's module names, with its heads checked.

    HF's style                           pipeengine's
    colwise / rowwise                    ColwiseParallel() / RowwiseParallel(): attention split by heads (checked)
    colwise_gather_output, colwise_rep   ColwiseParallel(output_layouts=Replicate()): the output gathered whole
    rowwise_split_input, rowwise_rep     RowwiseParallel(input_layouts=Replicate()): a whole input split here
    replicated_with_grad_allreduce       ReplicatedGradSum(): a per-head norm whole on every rank, its gradient
                                         summed over the tensor-parallel ranks (pipeengine.parallel.styles)

Entries for modules outside the decoder layers (transformers 5.17's Llama plans ``embed_tokens`` as
``embedding_rowwise``, a vocabulary-parallel embedding) are not translated: pipeengine splits the decoder layers
alone, and the embedding, the final norm and the head stay whole on every tensor-parallel rank.

And what a config's plan leaves out: Cohere's per-head q_norm/k_norm (use_qk_norm=True), HeadRows() (each rank
its heads' rows). A parameter of an attention split by heads that the plan says nothing of is refused, naming it:
each rank would apply it whole to its own heads.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["tp_plan"]

SPLITS_HEADS = ("colwise", "rowwise")  # the styles that split attention by heads: the degree must divide them
# what a family's config plan leaves out, by config field set: (model_type, field) -> {module under a layer: style}
LEFT_OUT = {("cohere", "use_qk_norm"): {"self_attn.q_norm": "head_rows", "self_attn.k_norm": "head_rows"}}


def tp_plan(model: nn.Module) -> dict[str, object]:
    """The model config's own tensor-parallel plan (``base_model_tp_plan``), for ``tp_plan=`` on the Sequential:
    HF's "layers.*.self_attn.q_proj": "colwise" becomes "*.layer.self_attn.q_proj": ColwiseParallel() (the module
    docstring lists each style). A degree that does not divide the attention heads and the key-value heads is
    refused when the engine is built, naming them."""
    config = getattr(model, "config", None)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    name = type(model).__name__
    if not plan:
        raise ValueError(f"{name}'s config has no base_model_tp_plan to translate")
    for (kind, field), entries in LEFT_OUT.items():
        if getattr(config, "model_type", None) == kind and getattr(config, field, False):
            plan.update({f"layers.*.{inner}": style for inner, style in entries.items()})
    heads: int | None = getattr(config, "num_attention_heads", None)
    kv_heads: int = getattr(config, "num_key_value_heads", None) or heads or 1
    out: dict[str, object] = {}
    for key, style in plan.items():
        head, _, rest = key.partition(".*.")
        if head not in ("layers", "h"):
            continue  # outside the decoder layers: whole on every rank (the module docstring)
        made = _style(style)
        if made is None:
            raise ValueError(
                f"{name}'s tp plan entry {key!r}: {style!r} is not one pipeengine.hf translates (per-layer "
                "'colwise', 'rowwise', 'colwise_gather_output', 'rowwise_split_input', "
                "'replicated_with_grad_allreduce'); pass tp_plan= by hand"
            )
        if style in SPLITS_HEADS and "attn" in rest and heads is not None:
            made.check_degree = _heads(name, heads, kv_heads)
        out[f"*.layer.{rest}"] = made
    _refuse_uncovered(model, name, plan)
    return out


def _style(style: str) -> Any:
    """pipeengine's style for HF's (the module docstring), or None where it has none."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pipeengine.parallel.styles import HeadRows, ReplicatedGradSum

    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "replicated_with_grad_allreduce": ReplicatedGradSum,
        "head_rows": HeadRows,
    }
    made = styles.get(style)
    return made() if made is not None else None


def _refuse_uncovered(model: nn.Module, name: str, plan: dict[str, str]) -> None:
    """An attention the plan splits by heads (a column-wise entry in it) whose modules with parameters are not all in
    the plan: each rank would apply such a module whole to its own heads (wrong shapes, or a gradient of its heads
    alone). Refused, naming the first."""
    split = {
        rest.rpartition(".")[0]
        for key, style in plan.items()
        if style == "colwise"
        for rest in [key.partition(".*.")[2]]
        if "attn" in rest
    }
    covered = {key.partition(".*.")[2] for key in plan}
    for attention in sorted(split):
        for module_name, module in model.named_modules():
            if not any(fnmatch.fnmatchcase(module_name, f"*{head}.0.{attention}") for head in ("layers", "h")):
                continue
            for child, inner in module.named_children():
                shapes = [tuple(p.shape) for p in inner.parameters()]
                if shapes and f"{attention}.{child}" not in covered:
                    raise ValueError(
                        f"{name}'s tp plan splits {attention} by heads (a column-wise projection) and says nothing of "
                        f"{attention}.{child} (parameters {shapes}): each tensor-parallel rank would apply it whole to "
                        "its own heads. Pass tp_plan= by hand with a style for it (pipeengine.parallel.styles: "
                        "ReplicatedGradSum for a per-head weight, HeadRows for one with a row per head), or one that "
                        "leaves attention whole"
                    )
            break


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
