"""The validator catches planted faults, and says which rule, where, and shows the grid."""

import pytest

from schedules import Schedule, ScheduleError, build_schedule, compile_schedule, parse, validate

# 1F1B, p=2, m=2, lowered: the reference the faults below are planted in
GOOD = [
    "0F0 0SF0 0F1 0SF1+0RB0 0B0 0RB1 0B1",
    "1RF0 1F0 1RF1 1B0 1SB0 1F1 1B1 1SB1",
]


def make(*streams: str, m: int = 2, placement: tuple[int, ...] = (0, 1)) -> Schedule:
    return Schedule("planted", len(streams), m, 1, placement, tuple(tuple(map(parse, s.split())) for s in streams))


def test_the_reference_is_valid_and_is_what_lowering_emits() -> None:
    validate(make(*GOOD))
    assert make(*GOOD).instructions == build_schedule("1f1b", 2, 2).instructions


def test_recv_before_send_on_both_sides_without_batching_is_a_deadlock_with_its_cycle() -> None:
    # rank 0 waits for the gradient before sending activation 1; rank 1 waits for activation 1
    # before sending the gradient: each single op blocks until its partner is posted
    stuck = make("0F0 0SF0 0F1 0RB0 0SF1 0B0 0RB1 0B1", "1RF0 1F0 1B0 1RF1 1SB0 1F1 1B1 1SB1")
    with pytest.raises(ScheduleError) as caught:
        validate(stuck)
    text = str(caught.value)
    assert "rule broken: no deadlock" in text
    assert "rank 0 at instruction 3 (0RB0) waits for rank 1 to post 1SB0 at instruction 4" in text
    assert "rank 1 at instruction 3 (1RF1) waits for rank 0 to post 0SF1 at instruction 4" in text
    assert ">0RB0<" in text and ">1RF1<" in text  # the cells of the cycle are marked in the grid


def test_the_same_ops_batched_together_do_not_deadlock() -> None:
    validate(make("0F0 0SF0 0F1 0RB0+0SF1 0B0 0RB1 0B1", "1RF0 1F0 1B0 1RF1+1SB0 1F1 1B1 1SB1"))


def test_missing_recv() -> None:
    with pytest.raises(ScheduleError, match=r"rank 1 instruction 4: 1SB0 has no matching recv 0RB0 on rank 0"):
        validate(make("0F0 0SF0 0F1 0SF1 0B0 0RB1 0B1", GOOD[1]))


def test_backward_before_its_forward() -> None:
    with pytest.raises(ScheduleError, match=r"forward runs before its backward[\s\S]*rank 1: 1B0 at instruction 1"):
        validate(make(GOOD[0], "1RF0 1B0 1RF1 1F0 1SB0 1F1 1B1 1SB1"))


def test_duplicated_forward() -> None:
    with pytest.raises(
        ScheduleError, match=r"exactly once[\s\S]*0F1 appears at \(rank, instruction\) \(0, 2\) and \(0, 3"
    ):
        validate(make("0F0 0SF0 0F1 0F1 0SF1+0RB0 0B0 0RB1 0B1", GOOD[1]))


def test_missing_backward() -> None:
    with pytest.raises(ScheduleError, match=r"missing 0B1 \(or both 0I1 and 0W1\) on rank 0"):
        validate(make("0F0 0SF0 0F1 0SF1+0RB0 0B0 0RB1", GOOD[1]))


def test_send_before_its_producer() -> None:
    with pytest.raises(ScheduleError, match=r"0SF1 at instruction 2 is posted before 0F1 at 3"):
        validate(make("0F0 0SF0 0SF1 0F1 0RB0 0B0 0RB1 0B1", GOOD[1]))


def test_recv_after_its_consumer() -> None:
    with pytest.raises(ScheduleError, match=r"1RF1 at instruction 5 comes after 1F1 at 4"):
        validate(make(GOOD[0], "1RF0 1F0 1B0 1SB0 1F1 1RF1 1B1 1SB1"))


def test_messages_received_out_of_order_on_a_channel() -> None:
    with pytest.raises(ScheduleError, match=r"in the order they are sent[\s\S]*message 0 sent is 0SF0.*is 1RF1"):
        validate(make(GOOD[0], "1RF1 1RF0 1F0 1B0 1SB0 1F1 1B1 1SB1"))


def test_communication_between_stages_on_the_same_rank() -> None:
    one_rank = Schedule("planted", 1, 1, 2, (0, 0), (tuple(map(parse, "0F0 0SF0 1RF0 1F0 1B0 0B0".split())),))
    with pytest.raises(
        ScheduleError, match=r"only crosses ranks[\s\S]*0SF0 talks to stage 1, which is on the same rank"
    ):
        validate(one_rank)


def test_instruction_on_a_rank_that_does_not_host_its_stage() -> None:
    with pytest.raises(ScheduleError, match=r"rank 0 instruction 0: 1F0 belongs to stage 1, hosted on rank 1"):
        validate(make("1F0 " + GOOD[0], GOOD[1]))


def test_a_compute_only_schedule_must_be_lowered_first() -> None:
    with pytest.raises(ScheduleError, match="must go through schedules.lower first"):
        validate(compile_schedule("1f1b", 2, 2))


def test_schedule_error_is_a_value_error() -> None:
    assert issubclass(ScheduleError, ValueError)


def test_errors_on_large_schedules_show_only_the_rows_around_the_fault() -> None:
    good = build_schedule("1f1b", 16, 64)
    streams = list(good.instructions)
    streams[5] = streams[5][:40] + streams[5][41:]  # drop one instruction in the middle of rank 5
    broken = Schedule("1f1b", 16, 64, 1, good.placement, tuple(streams))
    with pytest.raises(ScheduleError) as caught:
        validate(broken)
    text = str(caught.value)
    assert "..." in text and ">" in text
    assert len(text.splitlines()) < 30
