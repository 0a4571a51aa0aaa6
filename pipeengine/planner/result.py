"""What the planner returns: each Candidate (a whole layout, priced) and the TuneResult that ranks them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Candidate", "TuneResult"]


@dataclass(frozen=True)
class Candidate:
    """One way to lay the model out and pipeline it, priced by the simulator."""

    schedule: str
    num_microbatches: int
    chunks: int
    methods: tuple[str, ...]  # the partition methods that cut it this way
    partition: tuple[int, ...]  # layers per stage
    step_time: float  # predicted seconds per step
    bubble: float
    peak_memory: tuple[float, ...]  # bytes per rank that must fit: the step's peak or the optimizer step's after it
    data_parallel: int = 1  # replicas of the pipeline it was priced for
    fsdp: bool = False  # priced with each stage's state sharded over the replicas
    tensor_parallel: int = 1  # ranks per stage, each running its shard of the layers the plan splits
    checkpoint: str = "never"  # the engine's activation checkpointing
    tp_plan: Mapping[str, object] | None = field(default=None, compare=False, repr=False)  # the plan it was priced on

    @property
    def layout(self) -> str:
        """dp x pp x tp, and fsdp where sharded: "dp2 x pp2 x tp1 fsdp"."""
        pp = len(self.partition) // self.chunks
        return f"dp{self.data_parallel} x pp{pp} x tp{self.tensor_parallel}" + (" fsdp" if self.fsdp else "")

    def engine_kwargs(self) -> dict[str, object]:
        """The PipelineEngine options that build exactly what was priced:
        ``PipelineEngine(model, loss_fn, **c.engine_kwargs())``."""
        kwargs: dict[str, object] = {
            "schedule": self.schedule,
            "num_microbatches": self.num_microbatches,
            "chunks": self.chunks,
            "partition": list(self.partition),
            "data_parallel": self.data_parallel,
        }
        if self.fsdp:
            kwargs["fsdp"] = True
        if self.tensor_parallel > 1:
            kwargs.update(tensor_parallel=self.tensor_parallel, tp_plan=self.tp_plan)
        if self.checkpoint != "never":
            kwargs["checkpoint"] = self.checkpoint
        return kwargs

    def fits(self, limit: float | None) -> bool:
        return limit is None or max(self.peak_memory) <= limit


@dataclass
class TuneResult:
    """Every candidate that fits, fastest first (``rows``); those the memory limit dropped (``dropped``); the prices'
    source (``prices``: calibrated on this machine, or the built-in constants); each layout it could not build, with
    the reason (``refused``)."""

    rows: list[Candidate]
    dropped: list[Candidate] = field(default_factory=list)
    memory_limit: float | None = None
    search_seconds: float = 0.0  # pricing every candidate, after the layers were measured
    measure_seconds: float = 0.0
    prices: str = ""
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def best(self) -> Candidate:
        if not self.rows and not self.dropped:
            raise ValueError("no candidate was priced: see tune()'s reasons")
        if not self.rows:
            least = min(self.dropped, key=lambda c: max(c.peak_memory))
            raise ValueError(
                f"no candidate fits memory_limit={_mb(self.memory_limit)} per rank: the least memory any needs is "
                f"{_mb(max(least.peak_memory))} ({least.layout}, {least.schedule}, m={least.num_microbatches}, "
                f"partition {list(least.partition)}, checkpoint {least.checkpoint}); raise the limit, use more ranks, "
                "or shard (fsdp, tensor parallelism)"
            )
        return self.rows[0]

    def binding(self) -> str:
        """What the memory limit cost: which candidates it dropped, and the fastest of them."""
        if not self.dropped:
            return "no candidate was dropped for memory"
        faster = [c for c in self.dropped if not self.rows or c.step_time < self.rows[0].step_time]
        count = len(self.dropped)
        text = f"memory_limit={_mb(self.memory_limit)} per rank dropped {count} candidate{'s' if count != 1 else ''}"
        if faster:
            top = min(faster, key=lambda c: c.step_time)
            rank = top.peak_memory.index(max(top.peak_memory))
            text += (
                f"; without it the fastest would be {top.layout} {top.schedule} m={top.num_microbatches} "
                f"({top.step_time * 1e3:.2f} ms), peaking at {_mb(max(top.peak_memory))} on rank {rank}"
            )
        return text

    def __str__(self) -> str:
        lines = [
            f"{len(self.rows)} candidates (priced in {self.search_seconds:.2f} s after "
            f"{self.measure_seconds:.2f} s measuring the layers); {self.binding()}",
            f"prices: {self.prices}",
        ]
        lines += [f"refused {layout}: {why}" for layout, why in self.refused.items()]
        if self.rows:
            lines.append(
                f"{'#':>3}  {'layout':22} {'schedule':11} {'m':>3} {'v':>2} {'ckpt':11} {'step ms':>8}  "
                f"{'bubble':>6}  {'peak MiB/rank (max)':>19}  partition (methods)"
            )
        for index, c in enumerate(self.rows[:20]):
            lines.append(
                f"{index:3d}  {c.layout:22} {c.schedule:11} {c.num_microbatches:3d} {c.chunks:2d} "
                f"{c.checkpoint:11} {c.step_time * 1e3:8.2f}  {c.bubble:6.1%}  "
                f"{max(c.peak_memory) / 2**20:19.1f}  {list(c.partition)} "
                f"({', '.join(c.methods)})"
            )
        if len(self.rows) > 20:
            lines.append(f"... and {len(self.rows) - 20} more")
        return "\n".join(lines)


def _mb(value: float | None) -> str:
    """Bytes for people: 512 B, 3.0 KiB, 20.1 MiB, 1.50 GiB."""
    if value is None:
        return "none"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{value:.0f} B"
