"""Forward-only schedules for evaluation."""

import pytest

from schedules import Kind, build_schedule, forward_only, simulate, validate


@pytest.mark.parametrize(
    "name, p, m, v", [("gpipe", 3, 5, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("1f1b", 1, 3, 1)]
)
def test_forward_only_keeps_the_forwards_validates_and_fills_the_pipe(name: str, p: int, m: int, v: int) -> None:
    schedule = forward_only(build_schedule(name, p, m, v))
    validate(schedule)
    kinds = {op.kind for rank in range(p) for _, op in schedule.ops(rank)}
    assert kinds <= {Kind.FORWARD, Kind.SEND_ACTIVATION, Kind.RECV_ACTIVATION}
    assert simulate(schedule).makespan == v * m + p - 1  # each stage once per micro-batch, pipelined


def test_a_schedule_missing_some_backwards_is_not_taken_for_forward_only() -> None:
    from schedules import Schedule, ScheduleError, parse

    half = Schedule("half", 1, 2, 1, (0,), (tuple(map(parse, "0F0 0F1 0B0".split())),))
    with pytest.raises(ScheduleError, match="missing 0B1"):
        validate(half)
