"""ByIdentity: what is made once per object (a schedule a search prices many times), kept by identity."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["ByIdentity"]

T = TypeVar("T")


class ByIdentity(Generic[T]):
    """Values made once per object, by identity, for the last ``size`` objects (each held alive while kept, so that
    its id is not another's)."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self.kept: dict[int, tuple[object, T]] = {}

    def get(self, owner: object, make: Callable[[], T]) -> T:
        kept = self.kept.get(id(owner))
        if kept is not None and kept[0] is owner:
            return kept[1]
        value = make()
        if len(self.kept) >= self.size:
            del self.kept[next(iter(self.kept))]
        self.kept[id(owner)] = (owner, value)
        return value
