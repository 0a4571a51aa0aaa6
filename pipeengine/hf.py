"""Hugging Face causal language models through the pipeline, in and out (``pip install -e ".[hf]"``).

    from pipeengine import PipelineEngine, hf
    model = AutoModelForCausalLM.from_pretrained(path)              # or from a config, for a new model
    engine = PipelineEngine(hf.sequential(model), hf.causal_lm_loss, num_microbatches=8, loss_count=hf.count_labels)
    loss = engine.train_step(input_ids, labels)                     # labels as HF takes them: unshifted, -100 ignored
    hf.save_pretrained(engine, model, "out/")                       # every rank calls it; from_pretrained loads it

``sequential(model)`` finds the parts structurally, so one adapter serves the Llama-like families
(Llama, Qwen2, Mistral, ...: ``model.model.{embed_tokens, layers, norm, rotary_emb}`` and
``model.lm_head``) and GPT-2 (``model.transformer.{wte, wpe, drop, h, ln_f}``)::

    nn.Sequential( Embed(ids -> hidden),  Decoder(layer 0), ..., Decoder(layer L-1),  Final(norm, lm_head) )

Each entry holds the model's own modules (its parameters are the model's: nothing is copied), so
the names map back to HF's, and a head tied to the embedding (GPT-2, ``tie_word_embeddings``) stays
one parameter, which the engine ties across ranks. Each decoder computes what it needs from the
hidden state it receives: positions 0..T-1, the causal mask (transformers' own
``create_causal_mask``), and rotary embeddings from a copy of the model's rotary module of its own
(a buffer shared across ranks would be refused). Right-padded batches, the padding's labels -100,
equal HF's ``model(input_ids, labels=labels)``; left padding and packed rows (an attention mask
crossing the stages) are not supported.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeengine.core.dtensors import whole

__all__ = ["IGNORE", "causal_lm_loss", "count_labels", "save_pretrained", "sequential", "tp_plan"]

IGNORE = -100  # HF's ignore_index: padding, prompts


class Embed(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, D): the embedding, and GPT-2's learned positions and dropout."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None = None, drop: nn.Module | None = None) -> None:
        super().__init__()
        self.tokens, self.positions, self.drop = tokens, positions, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.tokens(input_ids)
        if self.positions is not None:
            hidden = hidden + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device))
        return self.drop(hidden) if self.drop is not None else hidden


class Decoder(nn.Module):
    """One decoder layer, its positions, causal mask and rotary embeddings computed from the hidden state."""

    def __init__(self, layer: nn.Module, config: Any, rotary: nn.Module | None, gpt2: bool) -> None:
        super().__init__()
        self.layer, self.rotary, self.gpt2 = layer, rotary, gpt2
        self.config = config  # not a module: it holds no tensors

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # no position_ids here: rows are not packed (their detection reads the data, which the meta device has not)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None)  # fmt: skip
        if self.gpt2:
            out = self.layer(hidden, None, mask, None, position_ids=position_ids)
        else:
            embeddings = self.rotary(hidden, position_ids) if self.rotary is not None else None
            out = self.layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=embeddings)
        return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


class Final(nn.Module):
    """The final norm and the head: hidden states -> logits (B, T, vocabulary)."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))  # type: ignore[no-any-return]


def sequential(model: nn.Module) -> nn.Sequential:
    """An nn.Sequential computing what ``model`` (a causal LM) computes, sharing its parameters (see the module
    docstring); its ``hf_names`` maps each of its parameter and buffer names to the model's. An architecture it
    does not know is refused naming what it could not find."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    base = getattr(model, "model", None)
    if base is not None and all(hasattr(base, part) for part in ("embed_tokens", "layers", "norm")):
        rotary = getattr(base, "rotary_emb", None)
        parts: list[nn.Module] = [Embed(base.embed_tokens)]
        parts += [Decoder(layer, config, copy.deepcopy(rotary) if rotary is not None else None, gpt2=False)
                  for layer in base.layers]  # fmt: skip
        parts.append(Final(base.norm, head))  # type: ignore[arg-type]
    elif (gpt2 := getattr(model, "transformer", None)) is not None and all(
        hasattr(gpt2, part) for part in ("wte", "wpe", "h", "ln_f")
    ):
        parts = [Embed(gpt2.wte, gpt2.wpe, getattr(gpt2, "drop", None))]
        parts += [Decoder(block, config, None, gpt2=True) for block in gpt2.h]
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
    seq.hf_names = _names(seq, model)  # type: ignore[assignment]
    return seq


def _names(seq: nn.Sequential, model: nn.Module) -> dict[str, list[str]]:
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


def save_pretrained(engine: Any, model: nn.Module, directory: str | Path, **kwargs: Any) -> Path | None:
    """Write the engine's trained weights as an HF checkpoint of ``model`` (``model.from_pretrained(directory)``
    loads it). Every rank calls it: the ranks of the first pipeline gather their stages' state, and its first rank
    (world rank 0) loads it into ``model`` and calls ``model.save_pretrained(directory, **kwargs)``. Returns the
    directory on the writing rank, None elsewhere."""
    state = {key: whole(value).detach().cpu() for key, value in engine.state_dict().items()}
    pieces = engine.topology.pipeline.all_gather_object(state, "the stages' weights for save_pretrained")
    if engine.topology.world.rank != 0:
        return None
    merged = {key: value for piece in pieces for key, value in piece.items()}
    seq = sequential(model)  # the same Sequential's names as the engine's: the map back to the model's
    first: dict[int, str] = {}  # a tensor -> the first of its names, the one the engine keeps for a tied weight
    theirs: dict[str, torch.Tensor] = {}
    for seq_name, tensor in seq.state_dict(keep_vars=True).items():
        value = merged.get(first.setdefault(id(tensor), seq_name))
        if value is not None:
            theirs.update(dict.fromkeys(seq.hf_names[seq_name], value))  # type: ignore[index]
    own = model.state_dict()
    missing = sorted(set(own) - set(theirs))
    if missing:
        raise ValueError(f"the engine's state lacks {missing[:6]} of {type(model).__name__}: is it the same model?")
    with torch.no_grad():
        model.load_state_dict(theirs)
    target = Path(directory)
    model.save_pretrained(target, **kwargs)  # type: ignore[operator]
    return target


def tp_plan(model: nn.Module) -> dict[str, object]:
    """The model config's own tensor-parallel plan (``base_model_tp_plan``), for ``tp_plan=`` on the Sequential:
    HF's "layers.*.self_attn.q_proj": "colwise" becomes "*.layer.self_attn.q_proj": ColwiseParallel()."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    out: dict[str, object] = {}
    for key, style in plan.items():
        head, _, rest = key.partition(".*.")
        if head not in ("layers", "h") or style not in styles:
            raise ValueError(
                f"{type(model).__name__}'s tp plan entry {key!r}: {style!r} is not one pipeengine.hf translates "
                f"(per-layer 'colwise' and 'rowwise' entries); pass tp_plan= by hand"
            )
        out[f"*.layer.{rest}"] = styles[style]()
    if not out:
        raise ValueError(f"{type(model).__name__}'s config has no base_model_tp_plan to translate")
    return out
