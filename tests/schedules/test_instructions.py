import pytest

from schedules import Batch, Instruction, Kind, Post, parse, peer


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_round_trips_through_its_text(kind: Kind) -> None:
    op = Instruction(12, kind, 30)
    assert str(op) == f"12{kind.value}30"
    assert parse(str(op)) == op


def test_a_post_round_trips_and_keeps_its_order() -> None:
    batch = parse("1SF3+1RB0")
    assert batch == Post((Instruction(1, Kind.SEND_ACTIVATION, 3), Instruction(1, Kind.RECV_GRADIENT, 0)))
    assert Batch is Post  # the name before 0.2
    assert str(batch) == "1SF3+1RB0"
    assert parse("1RB0+1SF3") != batch


def test_instructions_are_frozen_hashable_values_not_tuples() -> None:
    op = Instruction(1, Kind.FORWARD, 3)
    assert {op: "x"}[Instruction(1, Kind.FORWARD, 3)] == "x"
    assert op != (1, Kind.FORWARD, 3)
    with pytest.raises(AttributeError):
        op.stage = 2  # type: ignore[misc]


@pytest.mark.parametrize("text", ["", "F3", "1X3", "1F", "1F3+", "a1F3"])
def test_bad_text_names_the_expected_form(text: str) -> None:
    with pytest.raises(ValueError, match="expected <stage><kind><microbatch>"):
        parse(text)


def test_a_post_holds_only_communication() -> None:
    with pytest.raises(ValueError, match="send/recv"):
        Post((Instruction(0, Kind.FORWARD, 0),))
    with pytest.raises(ValueError):
        Post(())


@pytest.mark.parametrize(
    "op, partner",
    [("1SF3", "2RF3"), ("2RF3", "1SF3"), ("2SB3", "1RB3"), ("1RB3", "2SB3")],
)
def test_peer_is_the_matching_op_of_the_neighbouring_stage(op: str, partner: str) -> None:
    instruction = parse(op)
    assert isinstance(instruction, Instruction)
    assert peer(instruction) == parse(partner)
    assert peer(peer(instruction)) == instruction
