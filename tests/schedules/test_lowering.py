"""The one lowering pass: where sends and recvs go, and how they are batched."""

from bisect import bisect_left
from itertools import pairwise

import pytest

from schedules import (
    Instruction,
    Kind,
    Post,
    Schedule,
    ScheduleError,
    build_schedule,
    compile_schedule,
    lower,
    ops_of,
    peer,
    receives_first,
    simulate,
    validate,
)

CASES = [
    (name, p, m, v)
    for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)]
    for p in (2, 3, 4, 6)
    for m in (1, 2, 4, 7, 12)
    if name != "interleaved" or m % p == 0
]


def producer(recv: Instruction) -> tuple[int, Kind, int]:
    """The compute whose output a recv carries: (stage, kind, micro-batch)."""
    send = peer(recv)
    kind = Kind.FORWARD if send.kind is Kind.SEND_ACTIVATION else Kind.BACKWARD
    return send.stage, kind, send.microbatch


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_each_recv_goes_to_the_first_gap_reached_after_its_send(name: str, p: int, m: int, v: int) -> None:
    """'As early as it can be posted': in the unit-cost timing of the compute order, one gap
    earlier would post it before its data is sent; never later than just before its consumer."""
    compute = compile_schedule(name, p, m, v)
    timing = simulate(compute)
    end_of = {
        (s.action.stage, s.action.kind, s.action.microbatch): s.end  # type: ignore[union-attr]
        for r in range(p)
        for s in timing.compute_spans(r)
    }
    lowered = build_schedule(name, p, m, v)
    recvs_seen = 0
    for rank, stream in enumerate(lowered.instructions):
        gap_times = [0.0] + [s.end for s in timing.compute_spans(rank)]
        gap = 0  # computes seen so far on this rank = index of the current gap
        for action in stream:
            if isinstance(action, Instruction) and action.kind.is_compute:
                gap += 1
                continue
            for op in ops_of(action):
                if op.kind.is_recv:
                    recvs_seen += 1
                    first_gap = bisect_left(gap_times, end_of[producer(op)])
                    consumer = compute.instructions[rank][gap] if gap < len(compute.instructions[rank]) else None
                    if gap < first_gap:  # only allowed when the very next compute consumes it
                        assert isinstance(consumer, Instruction)
                        assert (consumer.stage, consumer.microbatch) == (op.stage, op.microbatch)
                    else:
                        assert gap == first_gap, (rank, op)
    assert recvs_seen == (2 * m * (p * v - 1) if p > 1 else 0)


def compute_neighbours(stream: tuple[Instruction | Post, ...]):  # type: ignore[no-untyped-def]
    """Each pair of consecutive computes on a rank with the communication actions between them."""
    computes = [i for i, a in enumerate(stream) if isinstance(a, Instruction) and a.kind.is_compute]
    for i, j in pairwise(computes):
        yield stream[i], stream[i + 1 : j], stream[j]


@pytest.mark.parametrize("p, m", [(p, m) for p in range(2, 7) for m in (p, p + 1, 3 * p)])
def test_1f1b_steady_state_pairs_send_activation_with_recv_gradient_and_back(p: int, m: int) -> None:
    schedule = build_schedule("1f1b", p, m)
    pairs = 0
    for rank, stream in enumerate(schedule.instructions):
        first_backward = True
        for before, between, after in compute_neighbours(stream):
            kinds = {op.kind for action in between for op in ops_of(action)}
            if before.kind is Kind.FORWARD and after.kind is Kind.BACKWARD and rank < p - 1:
                assert len(between) == 1 and {Kind.SEND_ACTIVATION, Kind.RECV_GRADIENT} <= kinds, (rank, between)
                pairs += 1
            if before.kind is Kind.BACKWARD and after.kind is Kind.FORWARD and rank > 0:
                if not first_backward:  # the first one's next input was posted even earlier
                    assert len(between) == 1 and {Kind.SEND_GRADIENT, Kind.RECV_ACTIVATION} <= kinds, (rank, between)
                    pairs += 1
            first_backward = first_backward and before.kind is not Kind.BACKWARD
    # rank r warms up with w = p-r-1 forwards, then m-w steady F->B steps and m-w-1 B->F steps;
    # counted: F->B on ranks 0..p-2, B->F but the first on ranks 1..p-1
    warmup = [p - r - 1 for r in range(p)]
    assert pairs == sum(m - warmup[r] for r in range(p - 1)) + sum(max(0, m - warmup[r] - 2) for r in range(1, p))


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_sends_follow_their_producer_and_each_gap_is_one_batch(name: str, p: int, m: int, v: int) -> None:
    for stream in build_schedule(name, p, m, v).instructions:
        for before, between, _ in compute_neighbours(stream):
            assert len(between) <= 1  # all communication of a gap is posted together
            for op in (op for action in between for op in ops_of(action)):
                if op.kind.is_send:
                    assert (op.stage, op.microbatch) == (before.stage, before.microbatch)


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_lowering_is_idempotent_and_keeps_the_compute_order(name: str, p: int, m: int, v: int) -> None:
    lowered = build_schedule(name, p, m, v)
    assert lower(lowered) == lowered
    assert lowered.compute_only() == compile_schedule(name, p, m, v)


def test_stages_on_the_same_rank_need_no_communication() -> None:
    schedule = build_schedule("interleaved", 1, 4, 3)  # stages 0, 1, 2 all on rank 0
    assert all(isinstance(a, Instruction) and a.kind.is_compute for a in schedule.instructions[0])


def test_lowering_refuses_a_compute_order_that_breaks_a_dependency() -> None:
    bad = Schedule("bad", 1, 1, 1, (0,), ((Instruction(0, Kind.BACKWARD, 0), Instruction(0, Kind.FORWARD, 0)),))
    with pytest.raises(ValueError, match="forward runs before its backward"):
        lower(bad)


@pytest.mark.parametrize("name, p, m, v", [*CASES, ("zb-h1", 3, 6, 1), ("zb-v", 2, 4, 2), ("zb-v", 3, 3, 2)])
def test_receives_first_posts_every_recv_at_the_start_and_moves_nothing_else(name: str, p: int, m: int, v: int) -> None:
    lowered = build_schedule(name, p, m, v)
    eager = receives_first(lowered)
    assert eager.compute_only() == lowered.compute_only()
    for before, after in zip(lowered.instructions, eager.instructions, strict=True):
        ops = [op for action in before for op in ops_of(action)]
        recvs = [op for op in ops if op.kind.is_recv]
        head, rest = (ops_of(after[0]), after[1:]) if recvs else ((), after)
        assert list(head) == recvs  # all at once, in stream order: every channel keeps the order of its sends
        assert [op for action in rest for op in ops_of(action)] == [op for op in ops if not op.kind.is_recv]
        assert not any(op.kind.is_recv for action in rest for op in ops_of(action))


def test_receives_first_is_only_for_transports_whose_posts_never_block() -> None:
    """Under rendezvous (NCCL's in-order stream) each rank's first recv waits for a send queued behind the other's."""
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(receives_first(build_schedule("1f1b", 2, 4)))
