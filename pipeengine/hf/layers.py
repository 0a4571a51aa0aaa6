"""A causal LM as an nn.Sequential of its own modules: the embedding, one entry per decoder layer, the head.

    nn.Sequential( Embed(ids [, attention_mask] -> hidden [, mask]),  Decoder(layer 0), ..., Final(norm, lm_head) )

Each entry holds the model's own modules (its parameters are the model's: nothing is copied), so
the names map back to HF's, and a head tied to the embedding stays one parameter, which the engine
ties across ranks. Each decoder computes what it needs from what it receives: positions 0..T-1 (as
``model(ids)`` takes them), its attention mask (transformers' own ``create_causal_mask`` or
``create_sliding_window_causal_mask``, as the family decides per layer: families.py) and rotary
embeddings from a copy of the model's rotary module of its own (a buffer shared across ranks would
be refused). Given ``(input_ids, attention_mask)``, the 2-D mask crosses every stage beside the
hidden state, so left-padded rows equal ``model(ids, attention_mask=mask)``. Built with ``packed=True`` it takes
``(input_ids, position_ids)`` instead, rows packed with several documents whose positions restart at each (as
transformers' DataCollatorWithFlattening makes them): the position ids cross every stage, and each layer's mask,
made by the same functions from them, lets each document attend to itself alone, as
``model(ids, position_ids=position_ids)`` does.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeengine.hf.families import embedding_scale, family_of, layer_kinds, logits_step

__all__ = ["IGNORE", "causal_lm_loss", "count_labels", "sequential"]

IGNORE = -100  # HF's ignore_index: padding, prompts
Value = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # the hidden state, and the attention mask if one was given


class Embed(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, D): the embedding, GPT-2's learned positions, the dropout; an
    attention mask given beside the ids goes on with the hidden state."""

    def __init__(
        self,
        tokens: nn.Module,
        config: Any,
        positions: nn.Module | None = None,
        drop: nn.Module | None = None,
        scale: float = 1.0,
        packed: bool = False,
    ) -> None:
        super().__init__()
        self.packed = packed  # the second input is the position ids of packed documents, not a mask
        self.tokens, self.positions, self.drop = tokens, positions, drop
        self.scale = scale  # the family's embedding multiplier (Granite), taken where its model takes it
        self.config = config  # not a module: it holds no tensors
        self.dropout = float(getattr(config, "embedding_dropout", 0.0) or 0.0)  # Starcoder2's, after the embedding

    def forward(self, value: Value) -> Value:
        if self.packed and not isinstance(value, tuple):
            raise ValueError(
                "hf.sequential(model, packed=True) takes (input_ids, position_ids): rows of packed documents whose "
                "position ids restart at each document; pass both, or build it without packed=True"
            )
        input_ids, mask = value if isinstance(value, tuple) else (value, None)
        if mask is None:
            self._refuse_left_padding(input_ids)
        hidden: torch.Tensor = self.tokens(input_ids)
        if self.scale != 1.0:
            hidden = hidden * self.scale
        if self.positions is not None:
            where = mask if self.packed else torch.arange(input_ids.shape[1], device=input_ids.device)
            hidden = hidden + self.positions(where)
        if self.drop is not None:
            hidden = self.drop(hidden)
        if self.dropout:
            hidden = F.dropout(hidden, p=self.dropout, training=self.training)
        return hidden if mask is None else (hidden, mask)

    def _refuse_left_padding(self, input_ids: torch.Tensor) -> None:
        """Rows that begin with the pad token and hold tokens after it are left-padded: without their attention
        mask every token would attend to the padding (HF computes that too, and warns)."""
        pad, bos = getattr(self.config, "pad_token_id", None), getattr(self.config, "bos_token_id", None)
        if pad is None or pad == bos or input_ids.device.type == "meta" or not input_ids.numel():
            return
        padded = (input_ids[:, 0] == pad) & (input_ids != pad).any(dim=1)
        if bool(padded.any()):
            row = int(padded.nonzero()[0, 0])
            raise ValueError(
                f"row {row} of the batch starts with the pad token (pad_token_id={pad}) and has tokens after it: a "
                "left-padded batch needs its attention mask. Pass the inputs as (input_ids, attention_mask): "
                "pipeengine.hf carries the mask across the stages, as model(input_ids, attention_mask=...) uses it"
            )


class Decoder(nn.Module):
    """One decoder layer, its positions, attention mask and rotary embeddings computed from what it receives."""

    def __init__(
        self, layer: nn.Module, config: Any, rotary: nn.Module | None, gpt2: bool, kind: str, packed: bool = False
    ) -> None:
        super().__init__()
        self.packed = packed  # what crosses beside the hidden state: position ids (packed documents), else a mask
        self.layer, self.rotary, self.gpt2 = layer, rotary, gpt2
        self.config, self.kind = config, kind  # not modules: no tensors
        # Gemma 3's rotary embedding differs by layer type (local and global bases): it is asked for this one's
        self.typed = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters

    def forward(self, value: Value) -> Value:
        hidden, mask = value if isinstance(value, tuple) else (value, None)
        if self.packed:  # the documents' own positions: transformers' mask functions find each from where they restart
            position_ids, attention = mask, self.mask(hidden, None, mask)  # type: ignore[arg-type]
        else:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            attention = self.mask(hidden, mask, position_ids)
        if self.gpt2:
            out = self.layer(hidden, attention_mask=attention, position_ids=position_ids)
        else:
            rotary = None
            if self.rotary is not None:
                typed = (self.kind,) if self.typed else ()
                rotary = self.rotary(hidden, position_ids, *typed)
            out = self.layer(hidden, attention_mask=attention, position_ids=position_ids, position_embeddings=rotary)
        out = out[0] if isinstance(out, tuple) else out
        return out if mask is None else (out, mask)

    def mask(self, hidden: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor) -> object:
        """The layer's attention mask, by transformers' own functions (positional arguments: the cache's keyword
        changed name in transformers 5). Shapes alone on the meta device: no mask to read there."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        if hidden.device.type == "meta":
            return None
        make = create_sliding_window_causal_mask if self.kind == "sliding_attention" else create_causal_mask
        return make(self.config, hidden, mask, None, position_ids)


class Final(nn.Module):
    """The final norm and the head: hidden states -> logits (B, T, vocabulary)."""

    def __init__(
        self, norm: nn.Module, head: nn.Module, times: float = 1.0, divided: float = 1.0, cap: float | None = None
    ) -> None:
        super().__init__()
        self.norm, self.head = norm, head
        self.times, self.divided, self.cap = times, divided, cap  # the family's last step (families.logits_step)

    def forward(self, value: Value) -> torch.Tensor:
        hidden = value[0] if isinstance(value, tuple) else value
        logits: torch.Tensor = self.head(self.norm(hidden))
        if self.times != 1.0:
            logits = logits * self.times  # Cohere
        if self.divided != 1.0:
            logits = logits / self.divided  # Granite
        if self.cap is not None:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits


def sequential(model: nn.Module, packed: bool = False) -> nn.Sequential:
    """An nn.Sequential computing what ``model`` (a causal LM) computes, sharing its parameters (see the module
    docstring); its ``hf_names`` maps each of its parameter and buffer names to the model's. An architecture it
    does not know, or a family it does not compute exactly, is refused naming what it could not find or apply.
    ``packed``: it takes (input_ids, position_ids) of rows packed with several documents (the module docstring)."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    base = getattr(model, "model", None)
    if base is not None and all(hasattr(base, part) for part in ("embed_tokens", "layers", "norm")):
        family = family_of(model)
        rotary = getattr(base, "rotary_emb", None)
        kinds = layer_kinds(family, config, len(base.layers))
        parts: list[nn.Module] = [
            Embed(base.embed_tokens, config, scale=embedding_scale(family, config), packed=packed)
        ]
        parts += [
            Decoder(layer, config, copy.deepcopy(rotary) if rotary is not None else None, False, kind, packed)
            for layer, kind in zip(base.layers, kinds, strict=True)
        ]
        parts.append(Final(base.norm, head, *logits_step(family, config)))  # type: ignore[arg-type]
    elif (gpt2 := getattr(model, "transformer", None)) is not None and all(
        hasattr(gpt2, part) for part in ("wte", "wpe", "h", "ln_f")
    ):
        family_of(model)
        parts = [Embed(gpt2.wte, config, gpt2.wpe, getattr(gpt2, "drop", None), packed=packed)]
        parts += [Decoder(block, config, None, True, "full_attention", packed) for block in gpt2.h]
        parts.append(Final(gpt2.ln_f, head))  # type: ignore[arg-type]
    else:
        found = [name for name, _ in model.named_children()]
        raise ValueError(
            f"pipeengine.hf.sequential knows causal LMs laid out as Llama's (model.model.embed_tokens, .layers, "
            f".norm, model.lm_head) or GPT-2's (model.transformer.wte, .wpe, .h, .ln_f, model.lm_head); "
            f"{type(model).__name__} has children {found}: write its nn.Sequential by hand"
        )
    if head is None:
        raise ValueError(f"{type(model).__name__} has no lm_head: pipeengine.hf.sequential needs a causal LM")
    seq = nn.Sequential(*parts)
    seq.hf_names = names(seq, model)  # type: ignore[assignment]
    return seq


def names(seq: nn.Sequential, model: nn.Module) -> dict[str, list[str]]:
    """Each name in the Sequential's state -> the model's names for the same tensor (a tied weight has two)."""
    theirs: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        theirs.setdefault(id(tensor), []).append(name)
    return {name: theirs.get(id(tensor), []) for name, tensor in seq.state_dict(keep_vars=True).items()}


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The next-token cross entropy summed over the labels that count (HF's shift: position t predicts t+1;
    -100 ignored), in float32; with ``loss_count=count_labels`` the engine divides by the step's count."""
    shifted = logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(shifted, labels[:, 1:].flatten(), ignore_index=IGNORE, reduction="sum")


def count_labels(labels: torch.Tensor) -> torch.Tensor:
    """How many labels count in a micro-batch: those a position predicts (after the shift), not -100."""
    return (labels[:, 1:] != IGNORE).sum()
