"""compile_in_place: nn.Module.compile, for every layer, torch's own included."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__: list[str] = []


def compile_in_place(module: nn.Module, options: Mapping[str, object]) -> None:
    """``module.compile(**options)`` (the compiled call is the module's own: its names and state_dict stay), also for a
    module whose forward is torch's. torch 2.13's nn.Module.compile compiles ``module._call_impl``, and where the
    forward is torch's too (nn.Linear, an nn.Sequential of torch's layers) dynamo finds no frame it may trace and runs
    the module eagerly, silently (pytorch/pytorch#150915; torch.compile(module) wraps such a call, and #185722 teaches
    Module.compile the same, after 2.13). Such a module's call is wrapped in a frame of ours, which dynamo traces,
    inlining torch's; the layers of a model share its compiled code (the parameters are the graph's inputs)."""
    if not type(module).forward.__module__.startswith("torch."):
        module.compile(**options)
        return
    call = module._call_impl

    def compiled_call(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    module._compiled_call_impl = torch.compile(compiled_call, **dict(options))  # type: ignore[call-overload]
