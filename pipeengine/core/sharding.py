"""FSDP2's units in a stage module: gather a stage's whole parameters, and free them again.

    units(module)     its fully_shard'ed modules (the stage's root among them); none without FSDP
    gather(module)    every unit all-gathered: the module's parameters are the whole ones now
    reshard(module)   every unit back to its shard
"""

from __future__ import annotations

from torch import nn

__all__ = ["gather", "reshard", "units"]


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
