"""A large schedule stays exact (its speed is measured in benchmarks/schedule_scale.py)."""

from schedules import build_schedule, simulate, validate


def test_p64_m512_v2_validates_with_the_published_bubble() -> None:
    p, m, v = 64, 512, 2
    schedule = build_schedule("interleaved", p, m, v)
    validate(schedule)
    timeline = simulate(schedule)
    makespan, busy = round(timeline.makespan), round(sum(timeline.busy(r) for r in range(p)))
    assert (p * makespan - busy) * (v * m + p - 1) == (p - 1) * p * makespan
