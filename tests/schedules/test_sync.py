"""The sync passes: one all-reduce per stage, and one sum per rank of a tied-weight group, after the last gradient."""

import dataclasses

import pytest

from schedules import (
    Instruction,
    Kind,
    Schedule,
    ScheduleError,
    build_schedule,
    simulate,
    tie_ranks,
    validate,
    with_gradient_sync,
    with_tie_sync,
)

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


TIE_CASES = [
    (name, p, m) for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v") for p in (2, 3, 4) for m in (p, 2 * p)
]


@pytest.mark.parametrize("name, p, m", TIE_CASES)
def test_tied_first_and_last_stages_are_summed_once_per_rank_after_their_last_gradient(
    name: str, p: int, m: int
) -> None:
    built = build_schedule(name, p, m)
    tied = dataclasses.replace(built, tied=((0, built.num_stages - 1),))
    for synced in (with_tie_sync(tied), with_gradient_sync(with_tie_sync(tied))):
        validate(synced)
        sums = [
            (rank, i, a)
            for rank, s in enumerate(synced.instructions)
            for i, a in enumerate(s)
            if isinstance(a, Instruction) and a.kind is Kind.TIE_REDUCE
        ]
        if name == "zb-v":  # the V puts the first and last stage on rank 0: the tie is local
            assert sums == [] and tie_ranks(tied, 0) == (0,)
            continue
        assert sorted(rank for rank, _, _ in sums) == [0, p - 1]
        for rank, i, action in sums:
            later = [
                a
                for a in synced.instructions[rank][i:]
                if isinstance(a, Instruction)
                and a.stage in (0, built.num_stages - 1)
                and a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT)
            ]
            assert not later and action.microbatch == 0


def test_a_missing_or_early_tie_sum_is_refused() -> None:
    tied = dataclasses.replace(build_schedule("1f1b", 2, 2), tied=((0, 1),))
    with pytest.raises(ScheduleError, match="summed exactly once on each rank that holds it"):
        validate(tied)
    synced = with_tie_sync(tied)
    stream = list(synced.instructions[1])
    at = next(i for i, a in enumerate(stream) if isinstance(a, Instruction) and a.kind is Kind.TIE_REDUCE)
    stream.insert(0, stream.pop(at))  # the sum moved before the backwards it must follow
    early = synced.with_streams([synced.instructions[0], stream])
    with pytest.raises(ScheduleError, match="summed after the last gradient compute that touches them"):
        validate(early)


def test_tie_groups_travel_in_the_schedule_text() -> None:
    tied = with_tie_sync(dataclasses.replace(build_schedule("interleaved", 2, 4), tied=((0, 3),)))
    assert "tied 0 3" in tied.to_text() and Schedule.from_text(tied.to_text()) == tied
    with pytest.raises(ScheduleError, match="a tie group is two or more stages"):
        dataclasses.replace(tied, tied=((3, 0),))
