"""The gradient-sync pass: one all-reduce per stage, right after its last gradient compute."""

import pytest

from schedules import Instruction, Kind, Schedule, ScheduleError, build_schedule, simulate, validate, with_gradient_sync

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)]


@pytest.mark.parametrize("name, chunks", CASES)
def test_each_stage_syncs_once_right_after_its_last_gradient(name: str, chunks: int) -> None:
    for p in (1, 2, 3, 4):
        for m in (p, 2 * p):
            schedule = with_gradient_sync(build_schedule(name, p, m, chunks))
            validate(schedule)
            simulate(schedule)
            for rank, stream in enumerate(schedule.instructions):
                for stage in schedule.stages_of(rank):
                    steps = [i for i, a in enumerate(stream) if isinstance(a, Instruction) and a.stage == stage]
                    reduce_at = [i for i in steps if stream[i].kind is Kind.ALL_REDUCE]  # type: ignore[union-attr]
                    grads = [i for i in steps if stream[i].kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT)]  # type: ignore[union-attr]
                    assert len(reduce_at) == 1 and reduce_at[0] == max(grads) + 1


def planted(stream: str) -> Schedule:
    from schedules import parse

    return Schedule("planted", 1, 2, 1, (0,), (tuple(map(parse, stream.split())),))


def test_an_all_reduce_before_a_gradient_is_refused() -> None:
    with pytest.raises(ScheduleError, match="all-reduced after its last gradient compute"):
        validate(planted("0F0 0F1 0B0 0AR0 0B1"))


def test_two_all_reduces_of_a_stage_are_refused() -> None:
    with pytest.raises(ScheduleError, match="exactly once"):
        validate(planted("0F0 0F1 0B0 0B1 0AR1 0AR1"))


def test_the_short_form_round_trips() -> None:
    from schedules import parse

    assert parse("3AR7") == Instruction(3, Kind.ALL_REDUCE, 7) and str(parse("3AR7")) == "3AR7"
