"""Scaled-dot-product attention traced as a GPU runs it: the fused kernel (flash, or memory-efficient with a mask),
not the meta device's math path (a full S x S score matrix). ``fused_attention()`` routes F.scaled_dot_product_attention
there for the duration of a trace (pipeengine.planner.cluster.costs)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["fused_attention"]

aten = torch.ops.aten


def _sdpa_args(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float, bool, float | None, bool]:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _fused_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """``F.scaled_dot_product_attention`` through the fused kernel a GPU would run, or None where none applies."""
    query, key, value, mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_args(*args, **kwargs)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)):
        return None
    batch, heads, length_q, head_dim = query.shape
    if key.shape[0] != batch or value.shape[0] != batch or key.shape[-1] != head_dim or value.shape[-1] != head_dim:
        return None
    kv_heads = key.shape[1]
    if value.shape[1] != kv_heads or heads % kv_heads != 0 or (kv_heads != heads and not enable_gqa):
        return None
    if mask is None:
        # Flash attention: no mask, grouped key/value heads read in place.
        result = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)
        return result[0]  # type: ignore[no-any-return]
    if is_causal:
        return None  # torch refuses a mask with is_causal; let it say so
    if kv_heads != heads:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    if mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, float("-inf"))  # as sdpa makes a boolean mask additive
    bias = mask.to(query.dtype).expand(batch, heads, length_q, key.shape[2])
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, bias))
    result = aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, needs_grad, dropout_p, False, scale=scale
    )
    return result[0]  # type: ignore[no-any-return]


_SDPA = torch._C._nn.scaled_dot_product_attention  # what F.scaled_dot_product_attention is, unpatched


def _sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
    fused = _fused_sdpa(*args, **kwargs)
    return _SDPA(*args, **kwargs) if fused is None else fused


class _FusedAttention(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Any,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is _SDPA:
            return _sdpa(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def fused_attention() -> Iterator[None]:
    """Route ``F.scaled_dot_product_attention`` to the fused kernel a GPU would run (``trace`` does, by default).

    Without a mask: ``_scaled_dot_product_flash_attention`` (grouped key/value heads in place); with one:
    ``_scaled_dot_product_efficient_attention`` (key/value heads repeated, a boolean mask made additive). Inputs
    neither takes (not 4-D, differing head dims) keep PyTorch's own path.

    Two hooks, as neither sees every call: a function mode sees the builtin wherever it is called from, except
    inside a Python function torch dispatches to modes itself (``F.multi_head_attention_forward``: the mode is
    off inside it), which looks the name up in ``torch.nn.functional``, patched for the context (process-wide:
    don't run attention in other threads meanwhile).
    """
    patched = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _sdpa
    try:
        with _FusedAttention():
            yield
    finally:
        F.scaled_dot_product_attention = patched
