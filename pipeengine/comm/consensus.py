"""Consensus: ranks fail together, and agree on the model they were given, before anything trains.

``raise_together`` turns one rank's error into a refusal on every rank: the rank that failed
raises its own error, every other rank a ``Refused`` that repeats it (a PeerError: launch
blames the rank that failed, never one that only heard of it).

``agree_on_model`` runs first in every engine's construction: each rank describes the model
it built, layer by layer (the layer's type, its parameters' and buffers' names, shapes, dtypes
and requires_grad, and a checksum of their values: their sum and their sum of squares), and a
model that differs on any rank (layers missing, another type, a seed forgotten on one rank) is
refused on every rank, naming the ranks and the first layer that differs::

    rank 0  [Linear f32[4,4] sum 1.52 ...] [Tanh] [Linear ...]  {schedule: '1f1b', ...}   all_gather_object
    rank 1  [Linear f32[4,4] sum 0.97 ...] ...                   {schedule: 'gpipe', ...}  -> what differs

The same exchange carries the engine options every rank must share (EngineConfig.shared: the schedule,
micro-batches, chunks, partition, layout, precision, checkpointing, loss_count, ...): ranks given different
ones are refused on every rank, naming each option that differs and each rank's value, instead of one rank
aborting in gloo or every rank waiting out the timeout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipeengine.comm.base import Transport
from pipeengine.errors import PeerError

__all__ = ["Refused", "agree_on_model", "raise_together"]


class Refused(PeerError, ValueError):
    """Another rank refused a call or a step: this rank refuses with it (the message repeats that rank's error)."""


def raise_together(failure: BaseException | None, transport: Transport, what: str) -> None:
    """Every rank of ``transport`` calls it: if any rank failed, every rank raises (see the module docstring)."""
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    errors = transport.all_gather_object(mine, what)
    if failure is not None:
        raise failure
    failed = [(transport.ranks[r], error) for r, error in enumerate(errors) if error is not None]
    if failed:
        raise Refused("; ".join(f"rank {rank} refused: {error}" for rank, error in failed))


_PIECE = 1 << 22  # elements summed at once (32 MiB of float64)
Layer = tuple[str, str, float, float]  # (name, structure, checksum: sum, sum of squares)


def describe(model: nn.Sequential) -> list[Layer]:
    """Each layer's name, structure and checksum, as agree_on_model compares them."""
    layers = []
    for name, layer in model.named_children():
        specs, total, squares, seen = [], 0.0, 0.0, set()
        for kind, items in (
            ("param", layer.named_parameters(remove_duplicate=False)),
            ("buffer", layer.named_buffers(remove_duplicate=False)),
        ):
            for key, tensor in items:
                grad = " grad" if kind == "param" and tensor.requires_grad else ""
                specs.append(f"{key} {str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}{grad}")
                if id(tensor) in seen or tensor.device.type == "meta" or not tensor.numel():
                    continue
                seen.add(id(tensor))
                for piece in tensor.detach().reshape(-1).split(_PIECE):  # float64 a piece at a time
                    values = (piece.abs() if piece.is_complex() else piece).to(torch.float64)
                    total += float(values.sum())
                    squares += float(values.square().sum())
        structure = f"{type(layer).__qualname__}({', '.join(specs)})"
        layers.append((name, structure, total, squares))
    return layers


Options = Mapping[str, tuple[object, str]]  # option -> (what is compared, how it is shown)


def agree_on_model(model: nn.Sequential, transport: Transport, options: Options | None = None) -> None:
    """Every rank built the same model and passed the same ``options``, or every rank raises the same ValueError
    naming where they differ (the model first)."""
    mine = (describe(model), dict(options or {}))
    views = transport.all_gather_object(mine, "the other ranks' description of the model and the engine's options")
    problem = difference([view for view, _ in views], transport.ranks)
    problem = problem or options_difference([shared for _, shared in views], transport.ranks)
    if problem:
        raise ValueError(problem)


def options_difference(views: Sequence[Options], ranks: Sequence[int]) -> str:
    """Which options differ across the ranks, each with each rank's value ("" where none does)."""
    differing = []
    for name in dict.fromkeys(key for view in views for key in view):  # every rank's options, in order
        seen: dict[object, list[int]] = {}
        shown: dict[object, str] = {}
        for rank, view in zip(ranks, views, strict=True):
            key, text = view.get(name, (_MISSING, "not given"))
            seen.setdefault(key, []).append(rank)
            shown.setdefault(key, text)
        if len(seen) > 1:
            values = ", ".join(
                f"rank {holders[0]}: {shown[key]}" if len(holders) == 1 else f"ranks {holders}: {shown[key]}"
                for key, holders in seen.items()
            )
            differing.append(f"{name} differs across ranks: {values}")
    if not differing:
        return ""
    return "; ".join(differing) + "; every rank must pass the same engine options"


_MISSING = "<missing>"  # an option one rank did not describe (a different version of pipeengine)


def difference(views: Sequence[list[Layer]], ranks: Sequence[int]) -> str:
    """Where the ranks' models differ ("" where they do not): the first layer that differs, and on which ranks."""
    counts = [len(view) for view in views]
    for index in range(max(counts)):
        seen: dict[Any, list[int]] = {}
        for rank, view in zip(ranks, views, strict=True):
            layer = view[index] if index < len(view) else None
            seen.setdefault(_key(layer), []).append(rank)
        if len(seen) == 1:
            continue
        rows = []
        for key, holders in seen.items():
            if key is None:
                rows.append(f"  ranks {holders}: no layer {index}")
            else:
                name, structure, total, squares = key
                rows.append(f"  ranks {holders}: {name!r} = {structure}, checksum {total} / {squares}")
        same_structure = len({k[:2] if k else None for k in seen}) == 1
        why = (
            "the same layers with different weights: seed every rank alike (torch.manual_seed before building), or "
            "load the same checkpoint everywhere"
            if same_structure
            else "every rank must build the same nn.Sequential (the same layers, parameters and shapes)"
        )
        sizes = "" if len(set(counts)) == 1 else f" (their layer counts: {dict(zip(ranks, counts, strict=True))})"
        return (
            f"the ranks built different models{sizes}; the first layer that differs is layer {index}:\n"
            + "\n".join(rows)
            + f"\n{why}"
        )
    return ""


def _key(layer: Layer | None) -> Any:
    """A layer as compared: NaN checksums equal to each other (a NaN weight everywhere is the same model)."""
    if layer is None:
        return None
    name, structure, total, squares = layer
    return (name, structure, *("nan" if math.isnan(x) else float(f"{x:.15g}") for x in (total, squares)))
