"""The layout search at cluster scale: every tp x pp x dp, micro-batch, schedule, chunks and recomputation for a
global batch on W devices, priced from a hardware description in seconds.

Every candidate is priced by ``layout.estimate`` (the bubble from its formula; its memory from the same model as
``price``, or a bound below it where that model is a replay: ``sequential.Sequential``'s); those past the device's
memory are refused with the reason. The best ``replayed`` by that estimate that fit are priced again by
``layout.price``, the schedule replayed by the simulator, and ranked by it: the bounds prune, the
simulator ranks what is left. A layout the user fixes is priced by the same ``price``, so it costs the same however
it was found.

What is searched: tp dividing the devices of a node and the heads (tensor parallelism stays inside a node; a generic
nn.Sequential, ``sequential.Sequential``, keeps tp=1); pp dividing a transformer's layers (a Sequential's: any pp up
to its layers, the stages cut by time); dp = W / (tp pp) dividing the global batch; micro-batch sizes dividing a
replica's batch (up to ``max_micro_batch``: by default 16 for a transformer, a replica's batch for a Sequential);
1F1B, interleaved 1F1B with v chunks where v divides the layers of a stage and the micro-batches divide by pp
(Megatron-LM's rule), ZB-H1 and ZB-V (the backward split into I and W, Qi et al.); full recomputation or none
(``recompute``); the replicas copying the weights or sharding them with FSDP2 (``fsdp``, where dp > 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pipeengine.planner.cluster.hardware import Hardware
from pipeengine.planner.cluster.layout import (
    PIPEENGINE,
    SCHEDULES,
    Layout,
    Model,
    Price,
    Runtime,
    Transformer,
    check,
    estimate,
    price,
)

__all__ = ["ClusterPlan", "search"]


@dataclass
class ClusterPlan:
    rows: list[Price]  # the replayed candidates, fastest first
    considered: int
    refused: dict[str, str] = field(default_factory=dict)  # a layout -> why it cannot run
    seconds: float = 0.0
    closest: Price | None = None  # of the layouts refused for memory, the one that needs the least

    @property
    def best(self) -> Price:
        if not self.rows:
            if self.closest is not None:
                raise ValueError(
                    f"no layout of the {self.considered} considered fits; the one needing the least "
                    f"memory, {self.closest.layout.describe()}, {self.closest.refused}: give the devices "
                    "more memory, or more devices"
                )
            raise ValueError(
                f"no layout of the {self.considered} considered can run: "
                f"{next(iter(self.refused.values()), 'none was possible')}"
            )
        return self.rows[0]


def _divisors(n: int, at_most: int | None = None) -> list[int]:
    return [d for d in range(1, (at_most or n) + 1) if n % d == 0]


CHOICES = {"always": (True,), "never": (False,), "search": (True, False)}


def candidates(
    model: Model,
    devices: int,
    hw: Hardware,
    global_batch: int,
    recompute: str = "search",
    max_micro_batch: int | None = None,
    schedules: tuple[str, ...] = SCHEDULES,
    fsdp: str = "search",
) -> list[Layout]:
    """Every layout the module docstring lists: the devices and the global batch split whole, and each layout one
    that ``layout.check`` (the rules a fixed layout is held to: one set of rules) lets through."""
    for name, value in (("recompute", recompute), ("fsdp", fsdp)):
        if value not in CHOICES:
            raise ValueError(f"{name}={value!r}: one of 'always', 'never', 'search'")
    out = []
    for tp in _divisors(hw.devices_per_node):
        for pp in range(1, model.layers + 1):
            if devices % (tp * pp) or global_batch % (devices // (tp * pp)):
                continue
            dp = devices // (tp * pp)
            replica = global_batch // dp
            for b in _divisors(replica, min(replica, _largest(model, replica, max_micro_batch))):
                m = replica // b
                for schedule, v in _schedules(pp, schedules):
                    for again in CHOICES[recompute]:
                        for sharded in CHOICES[fsdp] if dp > 1 else (False,):  # one replica: nothing to shard
                            out.append(Layout(tp, pp, dp, b, m, schedule, v, again, sharded))
    return [layout for layout in out if _allowed(model, layout, hw)]


def _largest(model: Model, replica: int, max_micro_batch: int | None) -> int:
    """The largest micro-batch searched: ``max_micro_batch``, else 16 sequences for a transformer (Megatron-LM's
    runs use 1 to 16) and a replica's whole batch for any other model (a micro-batch of a few rows of an MLP
    leaves a GPU idle)."""
    if max_micro_batch is not None:
        return max_micro_batch
    return 16 if isinstance(model, Transformer) else replica


def _allowed(model: Model, layout: Layout, hw: Hardware) -> bool:
    try:
        check(model, layout, hw)
    except ValueError:
        return False
    return True


def _schedules(pp: int, allowed: tuple[str, ...]) -> list[tuple[str, int]]:
    """(schedule, chunks) for a pipeline of ``pp`` ranks: one rank runs its micro-batches back to back ("1f1b");
    interleaved with v chunks (2 to 8), ZB-H1, ZB-V's 2; ``check`` refuses what a pipeline cannot run."""
    if pp == 1:
        return [("1f1b", 1)]
    found = [("1f1b", 1)] if "1f1b" in allowed else []
    found += [("interleaved", v) for v in range(2, 9)] if "interleaved" in allowed else []
    found += [("zb-h1", 1)] if "zb-h1" in allowed else []
    found += [("zb-v", 2)] if "zb-v" in allowed else []
    return found


def search(
    model: Model,
    devices: int,
    hw: Hardware,
    global_batch: int,
    *,
    recompute: str = "search",
    dtype: str = "fp16",
    replayed: int = 3,
    max_micro_batch: int | None = None,
    schedules: tuple[str, ...] = SCHEDULES,
    runtime: Runtime = PIPEENGINE,
    fsdp: str = "search",
) -> ClusterPlan:
    """The fastest layouts of ``model`` on ``devices`` devices of ``hw`` for ``global_batch`` sequences a step, as
    ``runtime`` runs them."""
    started = time.perf_counter()
    if devices < 1 or global_batch < 1:
        raise ValueError(f"devices={devices}, global_batch={global_batch}: both must be 1 or more")
    layouts = candidates(model, devices, hw, global_batch, recompute, max_micro_batch, schedules, fsdp)
    if not layouts:
        heads = f"{model.heads} heads, " if isinstance(model, Transformer) else ""
        raise ValueError(
            f"no layout of {devices} devices ({hw.devices_per_node} a node) splits {model.layers} layers, "
            f"{heads}and a global batch of {global_batch}: change one of them"
        )
    refused: dict[str, str] = {}
    fitting: list[Price] = []
    closest: Price | None = None
    for layout in layouts:
        try:
            guess = estimate(model, layout, hw, dtype, runtime)
        except ValueError as error:  # the model cannot run this layout (a Sequential's forward at one micro-batch)
            refused[layout.describe()] = str(error)
            continue
        if guess.refused:
            refused[layout.describe()] = guess.refused
            closest = guess if closest is None or guess.peak_bytes < closest.peak_bytes else closest
        else:
            fitting.append(guess)
    fitting.sort(key=lambda priced: priced.step_s)
    rows: list[Price] = []
    for guessed in fitting:  # the estimate's memory may be a bound below the replay's (sequential.Sequential's)
        if len(rows) == replayed:
            break
        priced = price(model, guessed.layout, hw, dtype, runtime)
        if priced.refused:
            refused[priced.layout.describe()] = priced.refused
            closest = priced if closest is None or priced.peak_bytes < closest.peak_bytes else closest
        else:
            rows.append(priced)
    rows.sort(key=lambda priced: priced.step_s)
    return ClusterPlan(rows, len(layouts), refused, time.perf_counter() - started, closest)
