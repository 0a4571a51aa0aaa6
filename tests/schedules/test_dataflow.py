"""The dataflow (what each compute consumes and produces), gradient-free boundaries, semantics, schedule files."""

import pytest

from schedules import (
    SCHEDULES,
    Dataflow,
    Instruction,
    Kind,
    Message,
    Schedule,
    ScheduleError,
    Semantics,
    build_schedule,
    compile_schedule,
    lower,
    ops_of,
    parse,
    receives_first,
    simulate,
    validate,
)


def suits(name: str, p: int, m: int) -> bool:
    """Whether the schedule runs m micro-batches on p ranks (interleaved: a multiple of p; DualPipeV: 2p or more)."""
    check = SCHEDULES[name].check_microbatches
    try:
        if check is not None:
            check(p, m)
    except ValueError:
        return False
    return True


GRID = [(name, p, m) for name in SCHEDULES for p in (1, 2, 3, 4) for m in (1, 2, 4, 5, 8) if suits(name, p, m)]


def test_what_each_compute_consumes_and_produces_in_a_chain_of_four() -> None:
    flow = Dataflow(4, 2, (0, 1, 2, 3))
    assert flow.consumes(parse("0F1")) is None and flow.produces(parse("0F1")) == Message(0, 1, False)
    assert flow.consumes(parse("3F1")) == Message(2, 1, False) and flow.produces(parse("3F1")) is None
    assert flow.consumes(parse("3B0")) is None and flow.produces(parse("3B0")) == Message(2, 0, True)
    assert flow.consumes(parse("1I0")) == Message(1, 0, True) and flow.produces(parse("1I0")) == Message(0, 0, True)
    assert flow.consumes(parse("0B0")) == Message(0, 0, True) and flow.produces(parse("0B0")) is None
    assert flow.consumes(parse("2W0")) is None and flow.produces(parse("2W0")) is None


def test_a_gradient_free_boundary_has_no_gradient_message() -> None:
    flow = Dataflow(3, 1, (0, 1, 2), no_gradient={0})
    assert flow.produces(parse("1B0")) is None and flow.consumes(parse("0B0")) is None
    assert flow.produces(parse("2B0")) == Message(1, 0, True)  # the other boundary still carries one
    assert flow.produces(parse("0F0")) == Message(0, 0, False)  # and activations always cross


def test_messages_their_keys_and_their_send_and_recv_agree() -> None:
    m = 3
    keys = set()
    for boundary in range(4):
        for mb in range(m):
            for gradient in (False, True):
                message = Message(boundary, mb, gradient)
                assert Message.from_key(message.key(m), m) == message
                assert Message.of(message.send()) == message == Message.of(message.recv())
                assert message.send().stage == message.sender and message.recv().stage == message.receiver
                keys.add(message.key(m))
    assert keys == set(range(2 * 4 * m))  # 4 boundaries: dense keys, one per message


@pytest.mark.parametrize("name, p, m", GRID)
def test_gradient_free_boundaries_lower_without_gradient_messages_and_validate(name: str, p: int, m: int) -> None:
    full = build_schedule(name, p, m)
    boundaries = full.num_stages - 1
    for frozen in ({0}, set(range(boundaries)), {boundaries - 1}) if boundaries else ():
        schedule = lower(full.without_gradient(frozen))
        for semantics in Semantics:
            validate(schedule, semantics)
        validate(receives_first(schedule), Semantics.BUFFERED)
        gradients = {
            Message.of(op).boundary
            for rank in range(p)
            for _, op in schedule.ops(rank)
            if op.kind in (Kind.SEND_GRADIENT, Kind.RECV_GRADIENT)
        }
        assert not gradients & frozen
        assert schedule.compute_only() == full.without_gradient(frozen)  # the computes stay where they were
        simulate(schedule)


def test_a_gradient_sent_across_a_gradient_free_boundary_is_refused() -> None:
    full = build_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match=r"1SB0 .* boundary 0 carries no gradient"):
        validate(Schedule(full.name, 2, 2, 1, full.placement, full.instructions, frozenset({0})))


def test_under_buffered_semantics_a_compute_waiting_on_a_late_send_is_a_deadlock() -> None:
    # rank 0 sends activation 0 only after its backward, which waits for rank 1's gradient, which needs that activation
    streams = ["0F0 0RB0 0B0 0SF0", "1RF0 1F0 1B0 1SB0"]
    stuck = Schedule("stuck", 2, 1, 1, (0, 1), tuple(tuple(map(parse, s.split())) for s in streams))
    with pytest.raises(ScheduleError) as caught:
        validate(stuck, Semantics.BUFFERED)
    text = str(caught.value)
    assert "a compute waits for the send of what it consumes" in text
    assert "rank 0 at instruction 2 (0B0) waits for rank 1 to post 1SB0" in text
    assert "rank 1 at instruction 1 (1F0) waits for rank 0 to post 0SF0" in text


@pytest.mark.parametrize("name, p, m", GRID)
def test_what_gloo_runs_is_proved_under_gloos_semantics(name: str, p: int, m: int) -> None:
    validate(receives_first(build_schedule(name, p, m)), Semantics.BUFFERED)


@pytest.mark.parametrize("name, p, m", GRID)
def test_a_schedule_reads_back_from_its_text(name: str, p: int, m: int) -> None:
    for schedule in (build_schedule(name, p, m), compile_schedule(name, p, m)):
        assert Schedule.from_text(schedule.to_text()) == schedule
    if p > 1:
        frozen = lower(compile_schedule(name, p, m).without_gradient({0}))
        assert "no-gradient 0" in frozen.to_text() and Schedule.from_text(frozen.to_text()) == frozen


def test_a_hand_written_schedule_runs_through_the_passes() -> None:
    text = """
    # GPipe on 2 ranks, 2 micro-batches, written by hand
    schedule mine
    ranks 2
    microbatches 2
    placement 0 1
    rank 0: 0F0 0F1 0B0 0B1
    rank 1: 1F0 1F1 1B0 1B1
    """
    schedule = lower(Schedule.from_text(text))
    validate(schedule)
    assert schedule.name == "mine" and schedule.chunks == 1
    assert [str(a) for a in schedule.instructions[0][:3]] == ["0F0", "0SF0", "0F1"]


@pytest.mark.parametrize(
    "text, error",
    [
        ("ranks 1\nmicrobatches 1\nplacement 0\nrank 0: 0F0 0X0", r"line 4: 'rank 0: 0F0 0X0': cannot parse '0X0'"),
        ("ranks 1\nmicrobatches 1\nplacement 0\nstages 3", r"line 4: .*unknown field 'stages'"),
        ("ranks 2\nmicrobatches 1\nplacement 0 1\nrank 0: 0F0", r"needs lines 'rank 0:' .. 'rank 1:', got ranks \[0\]"),
        ("microbatches 1\nrank 0: 0F0", "no ranks, placement line"),
    ],
)
def test_a_bad_schedule_file_names_the_line(text: str, error: str) -> None:
    with pytest.raises(ScheduleError, match=error):
        Schedule.from_text(text)


def test_every_action_of_a_lowered_stream_is_an_instruction_or_a_post() -> None:
    schedule = build_schedule("interleaved", 2, 4)
    assert all(
        isinstance(op, Instruction)
        for rank in range(2)
        for action in schedule.instructions[rank]
        for op in ops_of(action)
    )


@pytest.mark.parametrize(
    "edit, error",
    [
        (lambda t: t.replace("ranks 2", "ranks 2 3"), r"line 2: 'ranks 2 3': ranks takes one integer, got 2"),
        (lambda t: t + "rank 0: 0F0\n", r"line 8: 'rank 0: 0F0': rank 0's stream was given already, on line 6"),
        (lambda t: t + "ranks 2\n", r"line 8: 'ranks 2': 'ranks' was given already, on line 2"),
        (lambda t: t.replace("placement 0 1", "placement 0 x"), r"line 5: .*placement takes integers, got '0 x'"),
    ],
)
def test_a_schedule_file_with_a_line_wrong_names_the_line(edit: object, error: str) -> None:
    text = build_schedule("1f1b", 2, 2).to_text()
    with pytest.raises(ScheduleError, match=error):
        Schedule.from_text(edit(text))  # type: ignore[operator]
