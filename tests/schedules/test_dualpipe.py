"""DualPipeV (DeepSeek-V3, deepseek-ai/DualPipe): its order, valid everywhere, the published memory and bubble.

The published figures (DualPipe's README, per rank, PP = 2p stages on p ranks; F, B, W a chunk's
costs and F&B an overlapped forward-backward pair): bubble (PP/2 - 1)(F&B + B - 3W), activations
of PP + 1 chunks. This runtime runs a pair one after the other, so F&B = F + B here.
"""

import pytest

from schedules import Costs, Memory, build_schedule, compile_schedule, simulate, validate


def grid(ops: tuple) -> list[str]:  # type: ignore[type-arg]
    return [str(op) for op in ops]


def test_the_order_of_two_ranks_and_four_micro_batches_phase_by_phase() -> None:
    schedule = compile_schedule("dualpipe-v", 2, 4)
    assert schedule.placement == (0, 1, 1, 0)
    # rank 0: F0 F0 | F0 F1 | I1 W F1 | F0 B1 F1 B0 | B1 F1 B0 | B1 I0 | W I0 | W
    assert grid(schedule.instructions[0]) == [
        "0F0",
        "0F1",
        "0F2",
        "3F0",
        "3I0",
        "3W0",
        "3F1",
        "0F3",
        "3B1",
        "3F2",
        "0B0",
        "3B2",
        "3F3",
        "0B1",
        "3B3",
        "0I2",
        "0W2",
        "0I3",
        "0W3",
    ]
    # rank 1: (F0 F1) x2 | (F0 B1 F1 B0) x2 | B1 B0, I1 I0 | W W
    assert grid(schedule.instructions[1]) == [
        "1F0",
        "2F0",
        "1F1",
        "2F1",
        "1F2",
        "2B0",
        "2F2",
        "1B0",
        "1F3",
        "2B1",
        "2F3",
        "1B1",
        "2B2",
        "1B2",
        "2I3",
        "1I3",
        "2W3",
        "1W3",
    ]


def test_every_size_validates_and_fewer_than_2p_micro_batches_are_refused() -> None:
    for p in range(1, 9):
        for m in range(2 * p, 2 * p + 9):
            validate(build_schedule("dualpipe-v", p, m))
    with pytest.raises(ValueError, match=r"m >= 2p = 8\), got num_microbatches=7: use 8 or more"):
        build_schedule("dualpipe-v", 4, 7)
    with pytest.raises(ValueError, match=r"runs chunks=2 per rank, got chunks=3"):
        build_schedule("dualpipe-v", 4, 8, 3)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8])
def test_the_published_activations_and_bubble(p: int) -> None:
    for m in (2 * p, 4 * p):
        unit = simulate(build_schedule("dualpipe-v", p, m), Costs(memory=Memory(activation=1)))
        assert unit.peak_memory == [2 * p + 1] * p  # PP + 1 chunks on every rank
        for f, i, w in ((1, 1, 1), (1, 2, 1), (1, 1, 0.5), (2, 1, 1)):
            timeline = simulate(
                build_schedule("dualpipe-v", p, m), Costs(forward=f, backward_input=i, backward_weight=w)
            )
            idle = max(timeline.makespan - timeline.busy(r) for r in range(p))
            b = i + w
            assert idle <= (p - 1) * ((f + b) + b - 3 * w) + 1e-9, (p, m, (f, i, w), idle)
