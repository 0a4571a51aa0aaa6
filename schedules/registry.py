"""build_schedule: compile a named schedule and lower it."""

from __future__ import annotations

from collections.abc import Callable

from schedules.gcpause import gc_paused
from schedules.gpipe import gpipe
from schedules.interleaved import interleaved_1f1b
from schedules.lowering import lower
from schedules.one_f_one_b import one_f_one_b
from schedules.schedule import Schedule
from schedules.zero_bubble import zb_h1, zb_v

__all__ = ["DEFAULT_CHUNKS", "SCHEDULES", "build_schedule", "compile_schedule"]


def _one_chunk(compiler: Callable[[int, int], Schedule], name: str) -> Callable[[int, int, int], Schedule]:
    def compile_(num_ranks: int, num_microbatches: int, chunks: int) -> Schedule:
        if chunks != 1:
            raise ValueError(
                f"'{name}' runs one stage per rank (chunks=1), got chunks={chunks}; "
                "use 'interleaved' for several chunks per rank"
            )
        return compiler(num_ranks, num_microbatches)

    return compile_


def _two_chunks(num_ranks: int, num_microbatches: int, chunks: int) -> Schedule:
    if chunks != 2:
        raise ValueError(f"'zb-v' runs two chunks per rank in a V (chunks=2), got chunks={chunks}")
    return zb_v(num_ranks, num_microbatches)


# name -> compiler(num_ranks, num_microbatches, chunks) emitting compute order only
SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": _one_chunk(gpipe, "gpipe"),
    "1f1b": _one_chunk(one_f_one_b, "1f1b"),
    "interleaved": interleaved_1f1b,
    "zb-h1": _one_chunk(zb_h1, "zb-h1"),
    "zb-v": _two_chunks,
}
DEFAULT_CHUNKS = {"interleaved": 2, "zb-v": 2}  # chunks when none is given (PipelineEngine, CLI)


def compile_schedule(name: str, num_ranks: int, num_microbatches: int, chunks: int = 1) -> Schedule:
    """The compute order of a named schedule, before lowering."""
    compiler = SCHEDULES.get(name)
    if compiler is None:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULES)}")
    for label, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    return compiler(num_ranks, num_microbatches, chunks)


@gc_paused()
def build_schedule(name: str, num_ranks: int, num_microbatches: int, chunks: int = 1) -> Schedule:
    """Compile a named schedule and lower it: the per-rank streams an executor runs.

    ``print(build_schedule("1f1b", 2, 2))`` (or ``python -m schedules show 1f1b -p 2 -m 2``)::

        1f1b: 2 ranks, 2 micro-batches, 1 chunk(s) per rank, 2 stages; stage->rank: 0 1
        step  rank 0     rank 1
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
