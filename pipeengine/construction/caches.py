"""The processor's caches emptied before a layer is timed: a rank meets its stage's weights cold in a pipeline step
(between two of its computes other layers, micro-batches, communication and the ranks sharing the machine run), so
the layer measurement times each layer's F, B, I and W from cold caches on the CPU (pipeengine.construction.measure:
the engine's partition by time and the planner's profile alike)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["flusher", "last_level_cache"]


def flusher(device: torch.device) -> Callable[[], None]:
    """On the CPU, what writes over a buffer the size of the processor's last-level cache (what runs next reads
    from memory); elsewhere nothing."""
    if device.type != "cpu":
        return lambda: None
    buffer = torch.zeros(last_level_cache() // 4)

    def flush() -> None:
        buffer.add_(1.0)

    return flush


def last_level_cache() -> int:
    """Bytes of this processor's largest cache (Linux's sysfs), else 32 MiB."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes, default=32 * 2**20)
