"""The engine's trained weights out as a Hugging Face checkpoint of the user's model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from pipeengine.hf.layers import sequential

__all__ = ["save_pretrained"]


def save_pretrained(engine: Any, model: nn.Module, directory: str | Path, **kwargs: Any) -> Path | None:
    """Write the engine's trained weights as an HF checkpoint of ``model`` (``from_pretrained(directory)`` loads
    it). Every rank calls it: the engine gathers the whole model's state on world rank 0
    (``engine.full_state_dict()``), which maps it to the model's names and calls
    ``model.save_pretrained(directory, state_dict=..., **kwargs)``: the model's own tensors are not read, so a model
    whose layers the engine parallelized or sharded (tensor_parallel, fsdp) exports whole tensors as well. Returns
    the directory on the writing rank, None elsewhere."""
    state = engine.full_state_dict()
    if state is None:
        return None
    hf_names: dict[str, list[str]] = sequential(model).hf_names  # type: ignore[assignment]  # the Sequential's names
    theirs: dict[str, Any] = {}
    for seq_name, model_names in hf_names.items():
        value = state.get(seq_name)
        if value is not None:
            theirs.update(dict.fromkeys(model_names, value))
    own = set(model.state_dict())
    missing = sorted(own - set(theirs))
    if missing:
        raise ValueError(f"the engine's state lacks {missing[:6]} of {type(model).__name__}: is it the same model?")
    target = Path(directory)
    save: Any = model.save_pretrained
    save(target, state_dict={name: theirs[name] for name in model.state_dict()}, **kwargs)
    return target
