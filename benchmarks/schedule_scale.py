"""Time build + validate + simulate of a large schedule (pure Python, no torch).

python benchmarks/schedule_scale.py                  # p=64, m=512, v=2, median of 5
python benchmarks/schedule_scale.py 1f1b 32 256 1    # name, ranks, micro-batches, chunks
"""

from __future__ import annotations

import statistics
import sys
import time

from schedules import build_schedule, simulate, validate

NAME, RANKS, MICROBATCHES, CHUNKS = "interleaved", 64, 512, 2
REPEATS = 5


def measure(name: str, p: int, m: int, v: int) -> tuple[float, float, float, int]:
    start = time.perf_counter()
    schedule = build_schedule(name, p, m, v)
    built = time.perf_counter()
    validate(schedule)
    validated = time.perf_counter()
    simulate(schedule)
    done = time.perf_counter()
    count = sum(len(stream) for stream in schedule.instructions)
    return built - start, validated - built, done - validated, count


def main() -> None:
    name, p, m, v = (
        (sys.argv[1], *map(int, sys.argv[2:5])) if len(sys.argv) == 5 else (NAME, RANKS, MICROBATCHES, CHUNKS)
    )
    runs = [measure(name, p, m, v) for _ in range(REPEATS)]
    build, check, sim = (statistics.median(run[i] for run in runs) for i in range(3))
    totals = sorted(sum(run[:3]) for run in runs)
    print(f"{name} p={p} m={m} v={v}: {runs[0][3]} instructions, median of {REPEATS}")
    print(f"  build {build:.2f} s  validate {check:.2f} s  simulate {sim:.2f} s")
    print(f"  total median {statistics.median(totals):.2f} s  (min {totals[0]:.2f}, max {totals[-1]:.2f})")


if __name__ == "__main__":
    main()
