"""FSDP2's units in a stage module: gather a stage's whole parameters, and free them again.

    units(module)     its fully_shard'ed modules (the stage's root among them); none without FSDP
    gather(module)    every unit all-gathered: the module's parameters are the whole ones now
    reshard(module)   every unit back to its shard
    stage_output(module)   a block in which FSDP2 does not warn that the stage's output is a view
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator

from torch import nn

__all__ = ["gather", "reshard", "stage_output", "units"]


def units(module: nn.Module) -> list[nn.Module]:
    """The FSDP units of a stage module (fully_shard'ed modules, the stage's root among them); none without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    return [unit for unit in module.modules() if isinstance(unit, FSDPModule)]


def gather(module: nn.Module, keep: bool = False) -> nn.Module:
    """The module with FSDP's whole parameters in place (its units all-gathered; nothing without FSDP); ``keep``:
    held through forwards too (reshard_after_forward off until reshard())."""
    for unit in units(module):
        unit.unshard()  # type: ignore[operator]
        if keep:
            unit.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
    return module


def reshard(module: nn.Module, after_forward: bool = False) -> None:
    """Free what gather() gathered: each unit back to its shard (``after_forward``: as it was built, resharding
    after each forward again)."""
    for unit in units(module):
        unit.reshard()  # type: ignore[operator]
        if after_forward:
            unit.set_reshard_after_forward(True, recurse=False)  # type: ignore[operator]


@contextlib.contextmanager
def stage_output(module: nn.Module) -> Iterator[None]:
    """Run a sharded stage module without FSDP2's warning that it (or its last layer, whose output is the stage's)
    returned a view: its warning is about an in-place op on that view in a later module, and the engine, which takes
    the stage's output, makes none (it casts, sends, backpropagates). The other units still warn."""
    children = list(module.children())
    names = {type(module).__name__, *([type(children[-1]).__name__] if children else [])}
    pattern = rf"FSDP2-wrapped module \(({'|'.join(map(re.escape, names))})\) returned a view tensor"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=pattern)
        yield
