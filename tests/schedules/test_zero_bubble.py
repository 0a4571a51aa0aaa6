"""Zero-bubble schedules (Qi et al., 2023): valid everywhere, the paper's bubbles, 1F1B's memory."""

import pytest

from schedules import Costs, Kind, build_schedule, simulate, validate


def idle(name: str, p: int, m: int, chunks: int = 1, costs: Costs | None = None) -> list[float]:
    timeline = simulate(build_schedule(name, p, m, chunks), costs)
    return [timeline.makespan - timeline.busy(rank) for rank in range(p)]


@pytest.mark.parametrize("name, chunks", [("zb-h1", 1), ("zb-v", 2)])
def test_every_size_validates_and_other_chunk_counts_are_refused(name: str, chunks: int) -> None:
    for p in range(1, 9):
        for m in range(1, 33):
            schedule = build_schedule(name, p, m, chunks)
            validate(schedule)
            kinds = {op.kind for rank in range(p) for _, op in schedule.ops(rank) if op.kind.is_compute}
            assert kinds == {Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT}
    for other in {1, 2, 3} - {chunks}:
        with pytest.raises(ValueError, match="chunks"):
            build_schedule(name, 4, 8, other)


@pytest.mark.parametrize("forward, grad_input, weight", [(1, 1, 1), (2, 3, 1), (3, 2, 2)])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_h1_idles_p_minus_1_times_f_plus_b_minus_w_where_1f1b_idles_f_plus_b_plus_w(
    forward: float, grad_input: float, weight: float, p: int
) -> None:
    costs = Costs(forward=forward, backward_input=grad_input, backward_weight=weight)  # full backward = I + W
    for m in (p, p + 1, 2 * p, 4 * p + 3):
        assert idle("1f1b", p, m, costs=costs) == pytest.approx([(p - 1) * (forward + grad_input + weight)] * p)
        assert idle("zb-h1", p, m, costs=costs) == pytest.approx([(p - 1) * (forward + grad_input - weight)] * p)


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_v_bubble_is_far_below_zb_h1(p: int) -> None:
    for m in (2 * p, 4 * p):
        # per-chunk costs are halved: the same model in twice as many stages
        half = Costs(forward=0.5, backward_input=0.5, backward_weight=0.5)
        v = simulate(build_schedule("zb-v", p, m, 2), half).bubble_fraction
        h1 = simulate(build_schedule("zb-h1", p, m)).bubble_fraction
        assert v < 0.6 * h1, (p, m, v, h1)
        assert idle("zb-v", p, m, 2, half) == pytest.approx([(p - 1) / 2] * p)  # only the ramp in and out


@pytest.mark.parametrize("p", range(1, 9))
def test_peak_activation_memory_is_1f1bs(p: int) -> None:
    for m in (p, 2 * p, 4 * p):
        one = max(simulate(build_schedule("1f1b", p, m)).peak_inflight)
        assert max(simulate(build_schedule("zb-h1", p, m)).peak_inflight) == one == min(p, m)
        if m >= 2 * p:  # ZB-V's chunks are half-size stages
            assert max(simulate(build_schedule("zb-v", p, m, 2)).peak_inflight) == 2 * one


def test_zb_v_places_stage_r_and_2p_1_r_on_rank_r() -> None:
    schedule = build_schedule("zb-v", 4, 8, 2)
    assert schedule.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.stages_of(0) == (0, 7)
