"""How late a rank woken by a message starts while others compute (pipeengine.planner.wakes): the delay from the
chain's transits, the probe on live ranks, the curve the planner charges and the calibration file keeps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeengine.planner import calibration, wakes
from pipeengine.planner.calibration import Prices
from pipeengine.planner.measure import profile_layers
from schedules import build_schedule
from tests.pipeengine.ranks import on_ranks


def test_the_delay_is_the_mean_woken_transit_with_work_beside_less_that_with_none() -> None:
    """wakes.delays: per burst, the median time alone over the ranks and the mean transit of the chain with many
    micro-batches less that with one, over ranks whose sender shares their host (here rank 3's sender is on another
    host: its transits do not count); never below 0; a chain that woke none gives no point."""
    ms = 1e-3
    first = (0.5 * ms, ([0.1 * ms, 0.1 * ms], [0.1 * ms, 0.5 * ms, 0.3 * ms]))  # idle mean 0.1, loaded 0.3
    second = (2.0 * ms, ([0.2 * ms], [0.1 * ms]))  # faster with work beside: 0
    everyone = [
        ("a", [(0.4 * ms, ([], [])), (1.8 * ms, ([], []))]),  # rank 0 receives nothing
        ("a", [first, second]),
        ("a", [(0.6 * ms, ([0.1 * ms], [0.3 * ms])), (2.2 * ms, ([0.2 * ms], [0.1 * ms]))]),
        ("b", [(0.5 * ms, ([9 * ms], [9 * ms])), (2.0 * ms, ([9 * ms], [9 * ms]))]),
    ]
    points = wakes.delays(everyone)
    assert points == (pytest.approx((0.5 * ms, 0.2 * ms)), pytest.approx((2.0 * ms, 0.0)))
    assert wakes.delays([("a", [(ms, ([], []))]), ("a", [(ms, ([], [ms]))])]) == ()
    assert wakes.delays([("a", [(ms, ([], []))]), ("b", [(ms, ([ms], [ms]))])]) == ()


@on_ranks(2, timeout=120)
def test_the_probe_gives_every_rank_one_point_per_burst() -> None:
    import torch.distributed as dist

    for _ in range(3):  # a chain of 2 on one host wakes rank 1; on a loaded machine a pass may wake none (no point)
        points = wakes.wakes(10, (1e-3, 2e-3))
        everyone: list[object] = [None, None]
        dist.all_gather_object(everyone, points)
        assert everyone[0] == everyone[1], everyone  # every rank the same curve, always
        if len(points) == 2:
            break
    assert len(points) == 2, everyone
    assert all(compute > 0 and late >= 0 for compute, late in points), points


def test_the_planner_charges_the_calibrated_wake_and_the_file_keeps_it() -> None:
    """A calibration's wake curve goes to the simulator through the stage costs, a file keeps it; a file without one
    (calibrated before the probe) reads as none; one with a negative delay is refused, naming it."""
    prices = Prices(processors=1.0, wake=((1e-3, 2e-4), (4e-3, 6e-4)))
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    profile = profile_layers(model, torch.randn(8, 4), 2, repeats=1, device=torch.device("cpu"), allocator=False)
    program = build_schedule("gpipe", 2, 4)
    costs = profile.stage_costs([(0, 2), (2, 4)], prices=prices, placement=program.placement)
    assert costs.wake == prices.wake and costs.processors == 1.0
    record = prices.to_json()
    assert record["wake"] == [[1e-3, 2e-4], [4e-3, 6e-4]]
    assert Prices.from_json(record, "kept").wake == prices.wake
    del record["wake"]
    assert Prices.from_json(record, "kept before").wake == ()
    with pytest.raises(ValueError, match=r"wake\[0\]\[1\] is -0.0002: not a number of seconds >= 0"):
        Prices.from_json({**prices.to_json(), "wake": [[1e-3, -2e-4]]}, "broken")
    for broken in ("abc", {"0.001": 0.1}, [[1e-3]]):
        with pytest.raises(ValueError, match="not a list of \\[compute seconds, delay seconds\\] pairs"):
            Prices.from_json({**prices.to_json(), "wake": broken}, "broken")
    assert calibration.Prices().wake == ()  # the built-in constants: none
