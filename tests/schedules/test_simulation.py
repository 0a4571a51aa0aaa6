"""The cost-model simulator: costs per kind and per stage, messages, and what the Timeline reports."""

from itertools import pairwise

import pytest

from schedules import (
    Costs,
    Instruction,
    Kind,
    Schedule,
    ScheduleError,
    Span,
    Timeline,
    build_schedule,
    compile_schedule,
    ops_of,
    parse,
    replay,
    simulate,
    with_gradient_sync,
)


def test_gpipe_two_stages_one_microbatch_by_hand() -> None:
    # F0 on rank 0, F1 on rank 1, B1, B0: 1 + 1 + 2 + 2
    assert simulate(build_schedule("gpipe", 2, 1)).makespan == 6
    # each of the two messages adds its latency
    assert simulate(build_schedule("gpipe", 2, 1), Costs(latency=0.5)).makespan == 7
    # and its bytes: 0.1 per byte x 10 bytes
    assert simulate(build_schedule("gpipe", 2, 1), Costs(per_byte=0.1, message_bytes=10)).makespan == pytest.approx(8)


def test_per_stage_costs() -> None:
    # rank 0: F0 [0,1] F1 [1,2]; rank 1 (forward 3): F0 [1,4] F1 [4,7] B0 [7,9] B1 [9,11]; rank 0: B0 [9,11] B1 [11,13]
    timeline = simulate(build_schedule("gpipe", 2, 2), Costs(forward=[1, 3]))
    assert timeline.makespan == 13
    assert [(s.start, s.end) for s in timeline.compute_spans(1)] == [(1, 4), (4, 7), (7, 9), (9, 11)]


def test_full_backward_defaults_to_input_plus_weight() -> None:
    timeline = simulate(build_schedule("1f1b", 1, 1), Costs(backward_input=2, backward_weight=3))
    assert [s.duration for s in timeline.compute_spans(0)] == [1, 5]
    assert simulate(build_schedule("1f1b", 1, 1), Costs(backward=4)).makespan == 5


@pytest.mark.parametrize(
    "costs, message",
    [
        (Costs(forward=[1, 2, 3]), "Costs.forward has 3 values, the schedule has 2 stages"),
        (Costs(backward_weight=-1), "must not be negative"),
    ],
)
def test_bad_costs_are_refused_with_the_values(costs: Costs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate(build_schedule("1f1b", 2, 2), costs)


def test_compute_only_and_lowered_schedules_time_the_compute_alike() -> None:
    for name, p, m, v in [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2)]:
        lowered, compute = simulate(build_schedule(name, p, m, v)), simulate(compile_schedule(name, p, m, v))
        for rank in range(p):
            assert [(s.start, s.end) for s in lowered.compute_spans(rank)] == [
                (s.start, s.end) for s in compute.compute_spans(rank)
            ]


def test_timeline_spans_compute_never_overlaps_and_messages_complete_after_posting() -> None:
    timeline = simulate(build_schedule("interleaved", 4, 8, 2), Costs(latency=0.25))
    for rank in range(4):
        spans = timeline.compute_spans(rank)
        assert all(a.end <= b.start for a, b in pairwise(spans))
    comm = [s for s in timeline.spans if not s.is_compute]
    assert len(comm) > 0 and all(s.end >= s.start + 0.25 for s in comm)
    assert len(timeline.spans) == sum(len(stream) for stream in build_schedule("interleaved", 4, 8, 2).instructions)


def test_bubble_per_rank_and_overall() -> None:
    timeline = simulate(build_schedule("gpipe", 2, 1))
    assert timeline.bubble_fractions == [0.5, 0.5]  # each rank computes 3 of 6
    assert timeline.bubble_fraction == 0.5


def test_a_stuck_schedule_is_reported_not_looped_on() -> None:
    stuck = Schedule("stuck", 1, 1, 1, (0,), ((parse("0B0"), parse("0F0")),))
    for costs in (Costs(), Costs(processors=0.5)):  # the replay of ranks sharing processors too
        with pytest.raises(ScheduleError, match=r"the simulation is stuck: rank 0 at instruction 0 \(0B0\)"):
            simulate(stuck, costs)


def test_replay_charges_each_compute_its_own_measured_time() -> None:
    # gpipe p=2, m=2, measured with gaps (host time) that the replay drops:
    # rank 0: F0 2, F1 1; rank 1: F0 3, F1 1, B0 1, B1 2; rank 0: B0 4, B1 1
    measured = Timeline(
        2,
        [
            Span(0, parse("0F0"), 0, 2),
            Span(0, parse("0F1"), 2.5, 3.5),
            Span(1, parse("1F0"), 2.5, 5.5),
            Span(1, parse("1F1"), 6, 7),
            Span(1, parse("1B0"), 7, 8),
            Span(1, parse("1B1"), 8.5, 10.5),
            Span(0, parse("0B0"), 9, 13),
            Span(0, parse("0B1"), 13, 14),
            Span(1, parse("1RF1"), 5.5, 6, wait=True),
        ],
        unit="s",
        measured=True,
    )
    replayed = replay(build_schedule("gpipe", 2, 2), measured)
    # rank 1: F0 [2,5] F1 [5,6] B0 [6,7] B1 [7,9]; rank 0: B0 after 1B0 [7,11], B1 after 1B1 [11,12]
    assert [(s.start, s.end) for s in replayed.compute_spans(1)] == [(2, 5), (5, 6), (6, 7), (7, 9)]
    assert [(s.start, s.end) for s in replayed.compute_spans(0)] == [(0, 2), (2, 3), (7, 11), (11, 12)]
    assert replayed.makespan == 12 < measured.makespan and replayed.unit == "s"


@pytest.mark.parametrize(
    "name, p, m, v",
    [("gpipe", 3, 5, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb-h1", 3, 6, 1), ("zb-v", 2, 4, 2)],
)
def test_replaying_a_simulated_timeline_gives_it_back(name: str, p: int, m: int, v: int) -> None:
    schedule = build_schedule(name, p, m, v)
    simulated = simulate(
        schedule, Costs(forward=[1 + s for s in range(p * v)], backward_input=2.5, backward_weight=0.5)
    )
    replayed = replay(schedule, simulated)
    for rank in range(p):
        again, before = replayed.compute_spans(rank), simulated.compute_spans(rank)
        assert [s.action for s in again] == [s.action for s in before]
        assert [t for s in again for t in (s.start, s.end)] == pytest.approx(
            [t for s in before for t in (s.start, s.end)]
        )


def test_replaying_another_schedules_timeline_is_refused_with_where_they_differ() -> None:
    timeline = simulate(build_schedule("1f1b", 2, 4))
    with pytest.raises(ValueError, match="rank 0 ran 8 computes, its stream of 'gpipe' has 8; compute 2 is 0B0 where"):
        replay(build_schedule("gpipe", 2, 4), timeline)
    with pytest.raises(ValueError, match="rank 0 ran 8 computes, its stream of '1f1b' has 6"):
        replay(build_schedule("1f1b", 2, 3), timeline)


def test_a_schedule_priced_again_at_other_costs_is_as_a_fresh_copy_of_it() -> None:
    """simulate keeps each schedule's price-free skeleton and memory plan (a search prices one program many times):
    a second pricing of the same object, at other costs, equals pricing a copy that was never priced."""
    import copy

    from schedules import Memory, lowered, with_gradient_sync

    program = with_gradient_sync(lowered(build_schedule("zb-v", 2, 4)))
    first = Costs(
        forward=[1, 2, 1, 3],
        backward_input=2,
        backward_weight=1,
        latency=0.2,
        all_reduce=0.5,
        gather=0.3,
        memory=Memory(state=100, activation=[10, 20, 30, 5], boundary=2, gradient=3, sync=7),
    )
    second = Costs(
        forward=2,
        backward_input=[1, 3, 2, 1],
        backward_weight=2,
        latency=0.1,
        all_reduce=[1, 0, 2, 0],
        memory=Memory(state=50, activation=8, boundary=[4, 1, 1, 0], gradient=1, gathered=[6, 0, 0, 6]),
    )
    simulate(program, first)
    again, fresh = simulate(program, second), simulate(copy.deepcopy(program), second)
    assert again.makespan == fresh.makespan and again.required_memory == fresh.required_memory
    assert [(s.start, s.end) for s in again.spans] == [(s.start, s.end) for s in fresh.spans]
    assert again.memory == fresh.memory


def test_ranks_sharing_processors_by_hand() -> None:
    # gpipe p=2, m=2, F = B = 1, on 1.5 processors: 0F0 alone [0, 1]; 0F1 and 1F0 together at 0.75 each [1, 7/3];
    # 1F1 alone [7/3, 10/3]; 1B0 alone [10/3, 13/3]; 1B1 and 0B0 together [13/3, 17/3]; 0B1 alone [17/3, 20/3]
    timeline = simulate(build_schedule("gpipe", 2, 2), Costs(forward=1, backward=1, processors=1.5))
    spans = {str(s.action): (s.start, s.end) for s in timeline.spans if s.is_compute}
    expected = {
        "0F0": (0, 1),
        "0F1": (1, 7 / 3),
        "1F0": (1, 7 / 3),
        "1F1": (7 / 3, 10 / 3),
        "1B0": (10 / 3, 13 / 3),
        "1B1": (13 / 3, 17 / 3),
        "0B0": (13 / 3, 17 / 3),
        "0B1": (17 / 3, 20 / 3),
    }
    assert spans == {name: pytest.approx(times) for name, times in expected.items()}


def test_what_a_compute_waits_on_other_ranks_takes_no_processor() -> None:
    # gpipe p=2, m=2 on 1 processor, B = 1; stage 0's F = 2 of which 1 waits (a tensor-parallel collective): 0F0's
    # work [0, 1] alone, its wait to 2; 0F1 and 1F0 share the processor [2, 4], then 0F1 waits to 5; 1F1 [5, 6], 1B0
    # [6, 7]; 1B1 and 0B0 share it [7, 9]; 0B1 [9, 10]. Unshared the wait is part of the price: 0F0 [0, 2], 0F1 [2, 4]
    costs = {"forward": [2, 1], "backward": 1, "forward_wait": [1, 0]}
    timeline = simulate(build_schedule("gpipe", 2, 2), Costs(**costs, processors=1))  # type: ignore[arg-type]
    spans = {str(s.action): (s.start, s.end) for s in timeline.spans if s.is_compute}
    expected = {
        "0F0": (0, 2),
        "0F1": (2, 5),
        "1F0": (2, 4),
        "1F1": (5, 6),
        "1B0": (6, 7),
        "1B1": (7, 9),
        "0B0": (7, 9),
        "0B1": (9, 10),
    }
    assert spans == {name: pytest.approx(times) for name, times in expected.items()}
    unshared = simulate(build_schedule("gpipe", 2, 2), Costs(**costs))  # type: ignore[arg-type]
    assert [(s.start, s.end) for s in unshared.compute_spans(0)][:2] == [(0, 2), (2, 4)]


def test_posting_takes_its_host_time_on_the_rank_by_hand() -> None:
    # gpipe p=2, m=1, F = B = 1, a post 0.5 and 0.25 a message in it: 1RF0 [0, 0.75]; 0F0 [0, 1], 0SF0+0RB0 [1, 2]
    # (two messages), so 1F0 [2, 3], 1B0 [3, 4], 1SB0 [4, 4.75], and 0B0 [4.75, 5.75]; free posts take 4
    schedule = build_schedule("gpipe", 2, 1)
    assert simulate(schedule, Costs(forward=1, backward=1)).makespan == 4
    for processors in (None, 2 - 1e-9):  # both replays
        timeline = simulate(schedule, Costs(forward=1, backward=1, post=0.5, post_message=0.25, processors=processors))
        spans = {str(s.action): (s.start, s.end) for s in timeline.spans if s.is_compute}
        expected = {"0F0": (0, 1), "1F0": (2, 3), "1B0": (3, 4), "0B0": (4.75, 5.75)}
        assert spans == {name: pytest.approx(times) for name, times in expected.items()}


def test_a_gradient_sync_takes_its_host_time_then_runs_beside_or_holds_the_rank_by_hand() -> None:
    # gpipe p=2, m=1 with its ARs, F = B = 1, an AR 2 after 0.5 of host time. Beside: 1AR0's host [2 + 1, 3.5] (1B0
    # ends at 3), so 1SB0 is posted at 3.5 and 0B0 runs [3.5, 4.5]; 0AR0's host [4.5, 5], its collective [5, 7].
    # Blocking: 1AR0 holds rank 1 to 5.5, 0B0 [5.5, 6.5], 0AR0 [6.5, 9]
    schedule = with_gradient_sync(build_schedule("gpipe", 2, 1))
    for processors in (None, 2 - 1e-9):
        costs = {"forward": 1, "backward": 1, "all_reduce": 2, "sync_host": 0.5, "processors": processors}
        beside, blocking = simulate(schedule, Costs(**costs)), simulate(schedule, Costs(**costs, sync_blocking=True))
        assert (beside.makespan, blocking.makespan) == (pytest.approx(7), pytest.approx(9))
        syncs = [(s.rank, s.start, s.end) for s in blocking.spans if str(s.action).endswith("AR0")]
        assert sorted(syncs) == [(0, pytest.approx(6.5), pytest.approx(9)), (1, pytest.approx(3), pytest.approx(5.5))]
    # on one processor the collective beside is work that shares it: 0F0 [0, 1], 1F0 [1, 2], 1B0 [2, 3]; 1AR0 from 3
    # beside 0B0, each at half speed: 0B0 [3, 5]; then both ARs at half speed to 7 (1AR0's second half), 0AR0 alone
    # to 8. Unshared: 0B0 [3, 4], 0AR0 [4, 6]
    one = simulate(schedule, Costs(forward=1, backward=1, all_reduce=2, processors=1))
    spans = {f"{s.action}": (s.start, s.end) for s in one.spans if s.is_compute or str(s.action).endswith("AR0")}
    assert spans == {"0F0": (0, 1), "1F0": (1, 2), "1B0": (2, 3), "0B0": (3, 5), "1AR0": (3, 7), "0AR0": (5, 8)}
    assert simulate(schedule, Costs(forward=1, backward=1, all_reduce=2)).makespan == 6


GRID = [
    (name, p, m)
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min", "dualpipe-v")
    for p in (2, 4)
    for m in (4, 8)
    if (name, p, m) != ("dualpipe-v", 4, 4)
]


def _priced(name: str, p: int, m: int, seed: int) -> tuple[Schedule, dict[str, object]]:
    import random

    from schedules import registration, with_gradient_sync

    generator = random.Random(seed)
    schedule = with_gradient_sync(build_schedule(name, p, m, (registration(name).chunks or (2,))[0]))
    stages = schedule.num_stages

    def draw(low: float, high: float) -> list[float]:
        return [generator.uniform(low, high) for _ in range(stages)]

    return schedule, {"forward": draw(1, 2), "backward_input": draw(1, 2), "backward_weight": draw(0.5, 1)}


@pytest.mark.parametrize("name, p, m", GRID)
def test_ranks_on_one_processor_take_the_sum_of_their_work(name: str, p: int, m: int) -> None:
    """With free messages one processor is never idle while a compute waits (a schedule that can progress always
    has one ready): the step takes every compute's work, one after another."""
    schedule, costs = _priced(name, p, m, seed=p * m)
    alone = simulate(schedule, Costs(**costs))  # type: ignore[arg-type]
    shared = simulate(schedule, Costs(**costs, processors=1))  # type: ignore[arg-type]
    work = sum(s.duration for s in alone.spans if s.is_compute)
    assert shared.makespan == pytest.approx(work, rel=1e-9) and work > alone.makespan
    # posting and a sync's host time are work too (an AR's collective itself is free here)
    hosted = Costs(**costs, post=0.125, post_message=0.0625, sync_host=0.25, processors=1)  # type: ignore[arg-type]
    actions = [a for stream in schedule.instructions for a in stream]
    syncs = [a for a in actions if isinstance(a, Instruction) and a.kind is Kind.ALL_REDUCE]
    posts = [a for a in actions if not isinstance(a, Instruction) or not (a.kind.is_compute or a.kind.is_collective)]
    host = 0.25 * len(syncs) + sum(0.125 + 0.0625 * len(ops_of(a)) for a in posts)
    assert simulate(schedule, hosted).makespan == pytest.approx(work + host, rel=1e-9)
    assert sum(s.duration for s in shared.spans if s.is_compute) > work  # each span stretched by its sharing


@pytest.mark.parametrize("name, p, m", GRID)
def test_enough_processors_for_every_rank_replay_as_unshared(name: str, p: int, m: int) -> None:
    """The event-by-event replay of shared processors (schedules.sim.sharing) follows the same rules as the
    unshared one: with all but a hair of a processor for each rank and one for its asynchronous collectives (work
    too), every span is where the unshared replay puts it."""
    schedule, costs = _priced(name, p, m, seed=p + m)
    costs.update(
        latency=0.3,
        per_byte=0.01,
        message_bytes=10.0,
        all_reduce=2.0,
        post=0.05,
        post_message=0.02,
        sync_host=0.1,
        sync_blocking=p == 4,
    )
    alone = simulate(schedule, Costs(**costs))  # type: ignore[arg-type]
    nearly = simulate(schedule, Costs(**costs, processors=2 * p - 1e-9))  # type: ignore[arg-type]
    assert [(s.rank, s.action) for s in nearly.spans] == [(s.rank, s.action) for s in alone.spans]
    assert [t for s in nearly.spans for t in (s.start, s.end)] == pytest.approx(
        [t for s in alone.spans for t in (s.start, s.end)], rel=1e-6
    )


def test_a_rank_woken_while_others_compute_starts_late_by_hand() -> None:
    """Costs.wake: a compute woken by its input while other work runs starts late by the curve at that work's mean
    price. gpipe p=2, m=2, F = B = 1 on 1.5 processors, 0.25 late behind work of price 1 (between points 0 at 0.5
    and 0.5 at 1.5): 1F0 is woken at 1 while 0F1 runs, starts at 1.25; 0F1 alone to then, shares to 2.25; 1F0 alone
    again from 2.25 to 2.5. 1F1's input is there before its rank is free: no wake. 0B0 is woken at 4.5 beside 1B1."""
    costs = {"forward": 1, "backward": 1, "processors": 1.5}
    woken = simulate(build_schedule("gpipe", 2, 2), Costs(**costs, wake=((0.5, 0.0), (1.5, 0.5))))  # type: ignore[arg-type]
    spans = {str(s.action): (s.start, s.end) for s in woken.spans if s.is_compute}
    expected = {
        "0F0": (0, 1),
        "0F1": (1, 2.25),
        "1F0": (1.25, 2.5),
        "1F1": (2.5, 3.5),
        "1B0": (3.5, 4.5),
        "1B1": (4.5, 5.75),
        "0B0": (4.75, 6),
        "0B1": (6, 7),
    }
    assert spans == {name: pytest.approx(times) for name, times in expected.items()}
    # with nothing else running a woken rank starts at once: one micro-batch, each compute alone
    assert simulate(build_schedule("gpipe", 2, 1), Costs(**costs, wake=((1.0, 0.25),))).makespan == pytest.approx(4)  # type: ignore[arg-type]
    # beyond the curve's points it is level: work of price 1 is behind the first point at 2
    level = simulate(build_schedule("gpipe", 2, 2), Costs(**costs, wake=((2.0, 0.25), (3.0, 1.0))))  # type: ignore[arg-type]
    assert level.makespan == pytest.approx(woken.makespan)
    # ranks with processors of their own have no one to wait behind: the curve is not charged
    assert simulate(build_schedule("gpipe", 2, 2), Costs(forward=1, backward=1, wake=((1.0, 0.25),))).makespan == 6


def test_a_rank_woken_beside_two_computes_starts_late_by_their_mean_price_by_hand() -> None:
    """Costs.wake at the mean price of what runs, not its sum: gpipe p=3, m=3, F = B = 1 on 2 processors (never more
    than two run: each at full speed), the curve 0.5 late at price 1, 1.0 at 2. 1F0 is woken at 1 beside 0F1 alone:
    1.5 to 2.5. 2F0 is woken at 2.5 beside 0F2 (2 to 3) and 1F1 (its input there at 2: not woken, 2.5 to 3.5), of
    mean price 1: it starts at 3 (the sum, 2, would start it at 3.5), 3 to 4; 2F1 4 to 5, 2F2 5 to 6 (their inputs
    there first); 1F2 3.5 to 4.5. 2B0, 2B1, 2B2 6 to 9. 1B0 is woken at 7 beside 2B1 alone: 7.5 to 8.5, 1B1 and 1B2
    to 10.5. 0B0 is woken at 8.5 beside 2B2 (8 to 9) and 1B1 (8.5 to 9.5): at 9 (the sum: 9.5), 0B1 and 0B2 to 12."""
    timeline = simulate(
        build_schedule("gpipe", 3, 3), Costs(forward=1, backward=1, processors=2, wake=((1.0, 0.5), (2.0, 1.0)))
    )
    spans = {str(s.action): (s.start, s.end) for s in timeline.spans if s.is_compute}
    expected = {
        "0F0": (0, 1),
        "0F1": (1, 2),
        "0F2": (2, 3),
        "1F0": (1.5, 2.5),
        "1F1": (2.5, 3.5),
        "1F2": (3.5, 4.5),
        "2F0": (3, 4),
        "2F1": (4, 5),
        "2F2": (5, 6),
        "2B0": (6, 7),
        "2B1": (7, 8),
        "2B2": (8, 9),
        "1B0": (7.5, 8.5),
        "1B1": (8.5, 9.5),
        "1B2": (9.5, 10.5),
        "0B0": (9, 10),
        "0B1": (10, 11),
        "0B2": (11, 12),
    }
    assert spans == {name: pytest.approx(times) for name, times in expected.items()}


def test_the_wake_curve_is_checked() -> None:
    for wake in (((2.0, 0.1), (1.0, 0.2)), ((1.0, -0.1),)):
        with pytest.raises(ValueError, match=r"Costs.wake must be \(price, seconds\) points sorted by price"):
            simulate(build_schedule("gpipe", 2, 2), Costs(processors=1, wake=wake))
