"""The schedule registry: one record per schedule, read by build_schedule, the CLI, the engine and its errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from schedules.compilers.controllable import v_half, v_min
from schedules.compilers.dualpipe_v import check_dualpipe_v, dualpipe_v
from schedules.compilers.gpipe import gpipe
from schedules.compilers.interleaved import check_rounds, interleaved_1f1b
from schedules.compilers.one_f_one_b import one_f_one_b
from schedules.compilers.zb_h1 import zb_h1
from schedules.compilers.zb_v import zb_v
from schedules.ir.gcpause import gc_paused
from schedules.ir.schedule import Schedule
from schedules.passes.lowering import lower

__all__ = ["Registration", "SCHEDULES", "register", "registration", "build_schedule", "compile_schedule"]


@dataclass(frozen=True)
class Registration:
    """What a schedule is: its compiler, the chunks it runs, what it needs of m, and a line about it.

    ``compiler`` emits the compute order only. With one allowed chunk count it is called as
    ``compiler(num_ranks, num_microbatches)``; with several (``chunks=None``: any) as
    ``compiler(num_ranks, num_microbatches, chunks)``. ``check_microbatches(p, m)`` raises
    ValueError, saying what to use, when m does not suit p.
    """

    name: str
    compiler: Callable[..., Schedule]
    summary: str
    chunks: tuple[int, ...] | None = (1,)  # the chunk counts it runs; None: any positive count
    default_chunks: int = 1
    check_microbatches: Callable[[int, int], None] | None = None

    def check_chunks(self, chunks: int) -> None:
        if self.chunks is not None and chunks not in self.chunks:
            allowed = " or ".join(map(str, self.chunks))
            hint = "; 'interleaved' runs any number of chunks per rank" if self.chunks == (1,) else ""
            raise ValueError(
                f"'{self.name}' ({self.summary}) runs chunks={allowed} per rank, got chunks={chunks}{hint}"
            )

    def compile(self, num_ranks: int, num_microbatches: int, chunks: int | None = None) -> Schedule:
        """The compute order for p ranks, m micro-batches and ``chunks`` (default: the schedule's own)."""
        chunks = self.default_chunks if chunks is None else chunks
        for label, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches), ("chunks", chunks)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{label} must be a positive int, got {value!r}")
        self.check_chunks(chunks)
        if self.check_microbatches is not None:
            self.check_microbatches(num_ranks, num_microbatches)
        if self.chunks is not None and len(self.chunks) == 1:
            return self.compiler(num_ranks, num_microbatches)
        return self.compiler(num_ranks, num_microbatches, chunks)


SCHEDULES: dict[str, Registration] = {}


def register(record: Registration) -> Registration:
    """Add a schedule under its name (a name is registered once)."""
    if record.name in SCHEDULES:
        raise ValueError(f"a schedule named {record.name!r} is already registered")
    SCHEDULES[record.name] = record
    return record


register(Registration("gpipe", gpipe, "all forwards, then all backwards"))
register(Registration("1f1b", one_f_one_b, "warm-up, one forward one backward, cool-down"))
register(
    Registration(
        "interleaved",
        interleaved_1f1b,
        "1F1B over v chunks per rank, stage k on rank k mod p",
        chunks=None,
        default_chunks=2,
        check_microbatches=check_rounds,
    )
)
register(Registration("zb-h1", zb_h1, "1F1B with the backward split into I at once and W deferred"))
register(Registration("zb-v", zb_v, "two chunks per rank in a V with a split backward", chunks=(2,), default_chunks=2))
register(
    Registration("v-half", v_half, "ZB-V's V holding about half of 1F1B's activations", chunks=(2,), default_chunks=2)
)
register(
    Registration("v-min", v_min, "ZB-V's V holding about a third of 1F1B's activations", chunks=(2,), default_chunks=2)
)
register(
    Registration(
        "dualpipe-v",
        dualpipe_v,
        "DeepSeek's DualPipeV: a V alternating a forward of one chunk with a backward of the other",
        chunks=(2,),
        default_chunks=2,
        check_microbatches=check_dualpipe_v,
    )
)


def registration(name: str) -> Registration:
    """The record of a schedule name; an unknown name is a ValueError listing the valid ones."""
    record = SCHEDULES.get(name)
    if record is None:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULES)}")
    return record


def compile_schedule(name: str, num_ranks: int, num_microbatches: int, chunks: int | None = None) -> Schedule:
    """The compute order of a named schedule, before lowering (``chunks`` default: the schedule's own)."""
    return registration(name).compile(num_ranks, num_microbatches, chunks)


@gc_paused()
def build_schedule(name: str, num_ranks: int, num_microbatches: int, chunks: int | None = None) -> Schedule:
    """Compile a named schedule and lower it: the per-rank streams an executor runs.

    ``print(build_schedule("1f1b", 2, 2))`` (or ``python -m schedules show 1f1b -p 2 -m 2``)::

        1f1b: 2 ranks, 2 micro-batches, 1 chunk(s) per rank, 2 stages; stage->rank: 0 1
        #  rank 0     rank 1
        0  0F0        1RF0
        1  0SF0       1F0
        2  0F1        1RF1
        3  0SF1+0RB0  1B0
        4  0B0        1SB0
        5  0RB1       1F1
        6  0B1        1B1
        7             1SB1
    """
    return lower(compile_schedule(name, num_ranks, num_microbatches, chunks))
