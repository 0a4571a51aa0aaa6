"""Cut an nn.Sequential into contiguous stages: exact min-max balancing of per-layer costs, and a report."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipeengine.construction.layercosts import LayerCosts
from pipeengine.construction.measure import measure
from pipeengine.core.bounds import Bounds, bounds_from_counts, check_counts
from pipeengine.core.config import METHODS
from pipeengine.core.grid import Grid
from pipeengine.core.specs import Tensors

__all__ = ["METHODS", "Partition", "cut_points", "plan", "solve"]


def solve(costs: Sequence[float], num_stages: int, joined: Sequence[bool] = ()) -> Bounds:
    """Split layers into ``num_stages`` contiguous non-empty stages minimising the largest stage cost, exactly.
    ``joined[k]``: layer k stays in the stage of layer k + 1 (no stage may end on it): solved over the runs of
    joined layers, each one unit.

    ``best[k][i] = min over j of max(best[k-1][j], S[i] - S[j])``, S the prefix sums: the first
    term never falls and the second never rises as j grows (costs >= 0), so the optimal j
    form one interval around their crossing, found by binary search: O(stages x layers x log).
    Among optimal j the last stage gets the count of layers closest to an even share.
    """
    if any(joined):
        units = cut_points(len(costs), joined)
        if num_stages > len(units):
            raise ValueError(
                f"{num_stages} stages, but the model can be cut into {len(units)} at most (a stage cannot "
                "end on a layer whose output is a tensor-parallel shard): use fewer stages"
            )
        merged = solve([sum(costs[a:b]) for a, b in units], num_stages)
        return [(units[i][0], units[j - 1][1]) for i, j in merged]
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages > n:
        raise ValueError(
            f"{num_stages} stages but the model has {n} layers: every stage needs at least one layer; "
            f"use at most {n} ranks x chunks, or split the model into more nn.Sequential layers"
        )
    if any(not math.isfinite(c) or c < 0 for c in costs):
        raise ValueError(f"layer costs must be finite and non-negative, got {list(costs)}")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    best = [prefix[:]]  # one stage: best[0][i] = S[i]
    choice: list[list[int]] = [[0] * (n + 1)]
    for k in range(1, num_stages):  # k + 1 stages
        row, picks = [math.inf] * (n + 1), [0] * (n + 1)
        previous = best[-1]
        for i in range(k + 1, n + 1):
            lo, hi = k, i  # j in [lo, hi): the first k stages take layers [0, j), the last [j, i)
            total = prefix[i]

            def crossed(j: int, a: list[float] = previous, t: float = total) -> bool:
                return a[j] >= t - prefix[j]

            crossing = _first(lo, hi, crossed)
            value = min(max(previous[j], total - prefix[j]) for j in (crossing - 1, crossing) if lo <= j < hi)

            # the optimal j: previous[j] <= value holds on a prefix of j, total - S[j] <= value on a suffix
            def rest_fits(j: int, t: float = total, v: float = value) -> bool:
                return t - prefix[j] <= v

            def head_exceeds(j: int, a: list[float] = previous, v: float = value) -> bool:
                return a[j] > v

            first, last = _first(lo, hi, rest_fits), _first(lo, hi, head_exceeds) - 1
            even = i - i / (k + 1)  # the j that leaves the last stage an even share of the i layers
            row[i], picks[i] = value, min(max(math.ceil(even - 0.5), first), last)
        best.append(row)
        choice.append(picks)
    bounds: Bounds = []
    end = n
    for k in range(num_stages - 1, 0, -1):
        start = choice[k][end]
        bounds.append((start, end))
        end = start
    bounds.append((0, end))
    return bounds[::-1]


def cut_points(layers: int, joined: Sequence[bool]) -> list[tuple[int, int]]:
    """The runs of layers a cut may not split: [start, end) each, a run ending on a layer not ``joined`` to the next."""
    units, start = [], 0
    for k in range(layers):
        if k == layers - 1 or not (k < len(joined) and joined[k]):
            units.append((start, k + 1))
            start = k + 1
    return units


def _first(lo: int, hi: int, predicate: Callable[[int], bool]) -> int:
    """The first index in [lo, hi) where a monotone predicate (False, ..., True) holds, or hi."""
    return lo + bisect_left(range(lo, hi), True, key=predicate)


def check_method(method: str) -> None:
    if method not in METHODS:
        raise _unknown(method)


def _unknown(method: str) -> ValueError:
    valid = ", ".join(METHODS)
    return ValueError(f"unknown partition method {method!r}; valid: {valid}, or a list of layers per stage")


def method_costs(method: str, costs: LayerCosts) -> list[float]:
    """The per-layer numbers a method balances."""
    if method == "uniform":
        return [1.0] * len(costs)
    if method == "parameters":
        return [float(p) for p in costs.params]
    if method == "memory":
        return [float(m) for m in costs.memory]
    if method == "time":
        if costs.time is None:
            raise ValueError("partition='time' needs measured layer times: pass a sample micro-batch")
        return list(costs.time)
    raise _unknown(method)


@dataclass(frozen=True)
class Partition:
    """Which layers each stage runs, how it was decided, and what each stage costs."""

    method: str  # one of METHODS, or "explicit"
    bounds: Bounds
    costs: LayerCosts
    placement: tuple[int, ...] | None = None  # stage -> pipeline position, for the report
    grid: Grid | None = None  # the engine's (dp, pp, tp) grid: the report names each stage's world ranks
    # under tensor parallelism: the layers' parameters as tensor-parallel rank ``tp_rank`` holds them, for the report
    shards: LayerCosts | None = None
    tp_rank: int = 0

    def stage_sum(self, values: Sequence[float] | None) -> list[float] | None:
        return None if values is None else [sum(values[a:b]) for a, b in self.bounds]

    @property
    def imbalance(self) -> float:
        """max / mean over stages of what the method balanced (layer counts for an explicit split)."""
        method = "uniform" if self.method == "explicit" else self.method
        per_stage = self.stage_sum(method_costs(method, self.costs)) or []
        mean = sum(per_stage) / len(per_stage)
        return max(per_stage) / mean if mean > 0 else 1.0

    def ranks(self, stage: int) -> str:
        """The world ranks that run a stage in the first replica ("-" without a placement): its pipeline position
        without tensor parallelism, else its tensor-parallel ranks, "2-3"."""
        if self.placement is None:
            return "-"
        if self.grid is None:
            return str(self.placement[stage])
        ranks = self.grid.select(dp=[0], pp=[self.placement[stage]])
        return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"

    def __str__(self) -> str:
        tp, dp = (self.grid.tp, self.grid.dp) if self.grid else (1, 1)
        sizes = self.shards if tp > 1 and self.shards is not None else self.costs
        params = self.stage_sum(sizes.params) or []
        times = self.stage_sum(self.costs.time)
        memory = self.stage_sum(sizes.memory) or []
        balanced = {"uniform": "layers", "explicit": "layers"}.get(self.method, self.method)
        lines = [
            f"partition by {self.method}: {len(self.bounds)} stages, imbalance {self.imbalance:.2f} "
            f"(max / mean of {balanced})"
        ]
        ranks = [self.ranks(stage) for stage in range(len(self.bounds))]
        word = "ranks" if tp > 1 else "rank"
        width = max(len(word), *(len(r) for r in ranks))
        lines.append(f"stage  {word:>{width}}  layers   params    time ms  memory MiB")
        for stage, (start, end) in enumerate(self.bounds):
            ms = f"{1e3 * times[stage]:9.2f}" if times else "        -"
            lines.append(
                f"{stage:5d}  {ranks[stage]:>{width}}  {f'{start}-{end - 1}':7}  {int(params[stage]):7,d}  {ms}  "
                f"{memory[stage] / 2**20:10.2f}"
            )
        if self.grid is not None and dp > 1:
            lines.append(f"{word} of replica 0; replica r's are these + r x {self.grid.pp * tp}")
        if tp > 1 and self.shards is not None:
            lines.append(
                f"tensor_parallel={tp}: params and memory are one tensor-parallel rank's (tp rank {self.tp_rank}'s): "
                "its shards of the parameters, with their gradients and AdamW's state, and the activations as "
                "measured unsharded; time as measured unsharded"
            )
        elif tp > 1:
            lines.append(f"tensor_parallel={tp}: params, time and memory as measured unsharded, not per rank")
        return "\n".join(lines)


def plan(
    model: nn.Sequential,
    num_stages: int,
    method: str | Sequence[int] = "time",
    sample: torch.Tensor | Tensors | None = None,
    *,
    repeats: int = 5,
    device: str | torch.device | None = None,
) -> Partition:
    """Partition a model without any process group: measure its layers (on one micro-batch), then solve.

    ``method``: "uniform" (layer count), "parameters", "time" (needs ``sample``), "memory"
    (parameters + optimizer state + activations; activations need ``sample``), or the
    number of layers of each stage.
    """
    if not isinstance(method, str):
        counts = check_counts(method, num_stages)
        return Partition("explicit", bounds_from_counts(counts, len(model)), measure(model, sample))
    check_method(method)
    costs = measure(model, sample, timed=method == "time", repeats=repeats, device=device)
    return Partition(method, solve(method_costs(method, costs), num_stages), costs)
