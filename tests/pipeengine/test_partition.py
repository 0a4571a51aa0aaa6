"""Partitioning: the exact solver, the cost methods, the report, and agreement across ranks."""

import dataclasses
import itertools
import random

import pytest
import torch
from torch import nn

from pipeengine import Partition, PipelineEngine, measure, plan, solve
from pipeengine.construction.partition import method_costs
from pipeengine.core.bounds import bounds_from_counts, check_bounds, stage_module
from schedules import Costs, build_schedule, simulate
from tests.pipeengine import ranks
from tests.pipeengine.models import MODELS, batch
from tests.pipeengine.ranks import on_ranks


def brute_force(costs: list[float], stages: int) -> float:
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(edges)))
    return best


@pytest.mark.parametrize("seed", range(400))
def test_solver_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    if seed % 2:  # integers with ties and zeros
        costs = [float(rng.choice([0, 0, 1, 2, 3, 5, 8, 13, 100])) for _ in range(n)]
    else:
        costs = [rng.random() * 10 for _ in range(n)]
    bounds = solve(costs, stages)
    assert check_bounds(bounds, n) == bounds and len(bounds) == stages  # contiguous, every stage non-empty
    assert max(sum(costs[a:b]) for a, b in bounds) == pytest.approx(brute_force(costs, stages), rel=1e-12)


@pytest.mark.parametrize(
    "costs, stages, bounds",
    [
        ([10] + [1] * 9, 2, [(0, 1), (1, 10)]),  # a heavy first layer gets a stage of its own
        ([1] * 8 + [20], 3, [(0, 4), (4, 8), (8, 9)]),  # and a heavy head too
        ([1] * 8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        ([5, 0, 5, 0], 2, [(0, 2), (2, 4)]),  # a parameter-free layer stays with its neighbour
        ([0] * 6, 3, [(0, 2), (2, 4), (4, 6)]),
        ([3], 1, [(0, 1)]),
    ],
)
def test_known_cases(costs: list[float], stages: int, bounds: list[tuple[int, int]]) -> None:
    assert solve(costs, stages) == bounds


@pytest.mark.parametrize("seed", range(200))
def test_joined_layers_stay_in_one_stage_and_the_rest_is_optimal(seed: int) -> None:
    """``joined[k]``: no stage ends on layer k (tensor parallelism's shards); the best split over the cuts left,
    against brute force over those cuts."""
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    joined = [rng.random() < 0.4 for _ in range(n - 1)]
    allowed = [k + 1 for k in range(n - 1) if not joined[k]]  # where a stage may end
    stages = rng.randint(1, len(allowed) + 1)
    costs = [rng.random() * 10 for _ in range(n)]
    bounds = solve(costs, stages, joined)
    assert check_bounds(bounds, n) == bounds and len(bounds) == stages
    assert all(not joined[b - 1] for _, b in bounds[:-1]), (joined, bounds)
    best = min(
        max(sum(costs[a:b]) for a, b in itertools.pairwise([0, *cuts, n]))
        for cuts in itertools.combinations(allowed, stages - 1)
    )
    assert max(sum(costs[a:b]) for a, b in bounds) == pytest.approx(best, rel=1e-12)


def test_more_stages_than_cuts_left_says_what_to_do() -> None:
    assert solve([1.0] * 6, 3, [True, False, True, False, True]) == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError, match="4 stages, but the model can be cut into 3 at most .* use fewer stages"):
        solve([1.0] * 6, 4, [True, False, True, False, True])


def test_more_stages_than_layers_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="5 stages but the model has 4 layers: .* use at most 4 ranks x chunks"):
        solve([1.0] * 4, 5)


@pytest.mark.parametrize("costs", [[1.0, -1.0], [float("nan"), 1.0]])
def test_costs_must_be_finite_and_non_negative(costs: list[float]) -> None:
    with pytest.raises(ValueError, match="finite and non-negative"):
        solve(costs, 1)


def test_the_solver_scales() -> None:
    costs = [random.Random(0).random() for _ in range(500)]
    assert len(solve(costs, 64)) == 64


@pytest.mark.parametrize("bounds", [[(0, 2), (3, 4)], [(0, 2), (2, 2), (2, 4)], [(0, 3)], [(1, 4)]])
def test_bounds_must_tile_the_layers_in_order(bounds: list[tuple[int, int]]) -> None:
    with pytest.raises(ValueError, match="layers"):
        check_bounds(bounds, 4)


def test_explicit_counts_become_bounds() -> None:
    assert bounds_from_counts([3, 1, 2], 6) == [(0, 3), (3, 4), (4, 6)]
    with pytest.raises(ValueError, match="cover 5 layers, the model has 6"):
        bounds_from_counts([3, 1, 1], 6)


def test_stage_modules_keep_the_sequentials_names_and_modules() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 3), nn.Linear(3, 1))
    stage = stage_module(model, 2, 4)
    assert [name for name, _ in stage.named_parameters()] == ["2.weight", "2.bias", "3.weight", "3.bias"]
    assert stage[0] is model[2]  # the same module, not a copy
    x = torch.randn(5, 3)
    torch.testing.assert_close(stage(x), model[3](model[2](x)))


def test_measured_costs_parameters_memory_and_activations() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    costs = measure(model, torch.randn(8, 16))
    assert costs.params == (16 * 32 + 32, 0, 32 * 4 + 4)
    assert costs.param_bytes == tuple(4 * p for p in costs.params)
    # saved for backward: Linear its input (8x16 floats), Tanh its output (8x32), Linear its input (8x32)
    assert costs.activation_bytes == (8 * 16 * 4, 8 * 32 * 4, 8 * 32 * 4)
    assert costs.memory == tuple(4 * b + a for b, a in zip(costs.param_bytes, costs.activation_bytes, strict=True))
    assert costs.forward is None and measure(model).activation_bytes is None


def test_timing_leaves_the_model_untouched() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    sample = torch.randn(4, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    costs = measure(model, sample, timed=True, repeats=2)
    assert costs.forward is not None and all(t > 0 for t in costs.forward)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # batch-norm statistics too
    assert torch.equal(rng, torch.get_rng_state())


def ten_x_widths() -> nn.Sequential:
    """Narrow layers, then a wide block: 640-wide layers cost ~100x the 64-wide ones."""
    torch.manual_seed(0)
    narrow, wide = 64, 640
    return nn.Sequential(
        nn.Linear(narrow, narrow),
        nn.ReLU(),
        nn.Linear(narrow, narrow),
        nn.ReLU(),
        nn.Linear(narrow, narrow),
        nn.ReLU(),
        nn.Linear(narrow, wide),
        nn.Linear(wide, wide),
        nn.Linear(wide, wide),
        nn.Linear(wide, narrow),
        nn.ReLU(),
        nn.Linear(narrow, narrow),
    )


def simulated_makespan(partition: Partition, forward: tuple[float, ...], backward: tuple[float, ...]) -> float:
    per_stage = [(sum(forward[a:b]), sum(backward[a:b])) for a, b in partition.bounds]
    costs = Costs(forward=[f for f, _ in per_stage], backward=[b for _, b in per_stage])
    return simulate(build_schedule("1f1b", len(per_stage), 8), costs).makespan


def injected_times(model: nn.Sequential, rows: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Forward and backward 'seconds' of each layer from its multiply-adds (a Linear's), 1 ns each: no clock."""
    forward = []
    for layer in model:
        macs = rows * layer.in_features * layer.out_features if isinstance(layer, nn.Linear) else 0
        forward.append(1e-9 * (macs + rows * 64))  # and a little per row for the element-wise layers
    return tuple(forward), tuple(2 * f for f in forward)  # backward: two matmuls per forward one


def test_time_balances_a_model_of_uneven_widths_better_than_uniform() -> None:
    model = ten_x_widths()
    forward, backward = injected_times(model, 32)
    costs = dataclasses.replace(measure(model, torch.randn(32, 64)), forward=forward, backward=backward)
    timed = Partition("time", solve(method_costs("time", costs), 4), costs)
    uniform = Partition("uniform", solve(method_costs("uniform", costs), 4), costs)
    by_time, by_count = simulated_makespan(timed, forward, backward), simulated_makespan(uniform, forward, backward)
    assert by_time < 0.8 * by_count, (timed.bounds, uniform.bounds, by_time, by_count)
    slowest_by_time = max(timed.stage_sum(costs.time) or [0.0])
    slowest_by_count = max(uniform.stage_sum(costs.time) or [0.0])
    assert 0 < slowest_by_time < slowest_by_count


def test_plan_by_time_solves_on_the_times_it_measured() -> None:
    model, sample = ten_x_widths(), torch.randn(32, 64)
    timed = plan(model, 4, "time", sample, repeats=2)
    assert timed.costs.forward is not None and timed.costs.backward is not None
    assert len(timed.costs.forward) == len(model) and all(t > 0 for t in timed.costs.forward)
    assert timed.bounds == solve(list(timed.costs.time or ()), 4)  # whatever this machine measured


def test_the_report_lists_every_stage() -> None:
    partition = plan(ten_x_widths(), 3, "parameters", torch.randn(4, 64))
    text = str(partition)
    assert text.startswith("partition by parameters: 3 stages, imbalance ")
    assert "stage  rank  layers   params    time ms  memory MiB" in text
    assert len(text.splitlines()) == 2 + 3
    assert partition.imbalance == pytest.approx(
        max(sum(partition.costs.params[a:b]) for a, b in partition.bounds) / (sum(partition.costs.params) / 3)
    )


def test_the_report_names_each_stages_world_ranks_and_under_tensor_parallelism_a_ranks_shares() -> None:
    from pipeengine.core.grid import Grid

    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 256), nn.Linear(256, 4))
    costs = measure(model, None)  # parameters: 262,656, 0, 131,328, 1,028
    partition = Partition("explicit", [(0, 2), (2, 4)], costs, placement=(0, 1))
    table = [
        "partition by explicit: 2 stages, imbalance 1.00 (max / mean of layers)",
        "stage  rank  layers   params    time ms  memory MiB",
        "    0     0  0-1      262,656          -        4.01",  # weights, gradients, AdamW's two: 16 bytes each
        "    1     1  2-3      132,356          -        2.02",
    ]
    assert str(partition).splitlines() == table
    assert str(dataclasses.replace(partition, grid=Grid(1, 2))).splitlines() == table  # no TP, one replica: as it was
    replicas = str(dataclasses.replace(partition, grid=Grid(2, 2))).splitlines()
    assert replicas == [*table, "rank of replica 0; replica r's are these + r x 2"]
    # tp=2: the first Linear split by columns (half its weight and bias), the second by rows (its bias whole)
    shards = dataclasses.replace(
        costs, params=(131_328, 0, 65_792, 1_028), param_bytes=(4 * 131_328, 0, 4 * 65_792, 4 * 1_028)
    )
    sharded = dataclasses.replace(partition, grid=Grid(2, 2, 2), shards=shards, tp_rank=1)
    assert str(sharded).splitlines() == [
        table[0],
        "stage  ranks  layers   params    time ms  memory MiB",
        "    0    0-1  0-1      131,328          -        2.00",
        "    1    2-3  2-3       66,820          -        1.02",
        "ranks of replica 0; replica r's are these + r x 4",
        "tensor_parallel=2: params and memory are one tensor-parallel rank's (tp rank 1's): its shards of the "
        "parameters, with their gradients and AdamW's state, and the activations as measured unsharded; time as "
        "measured unsharded",
    ]
    assert sharded.imbalance == partition.imbalance  # what was balanced: the whole layers


@pytest.mark.parametrize("bad", ["fastest", ["a"]])
def test_plan_names_the_valid_methods(bad: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        plan(ten_x_widths(), 2, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="valid: uniform, parameters, time, memory"):
        plan(ten_x_widths(), 2, "fastest")


def test_time_without_a_sample_says_so() -> None:
    with pytest.raises(ValueError, match="needs a sample micro-batch"):
        plan(ten_x_widths(), 2, "time")


@pytest.mark.timeout(120)
@on_ranks(4, timeout=60, in_process=True)
def test_every_rank_builds_the_same_partition_from_the_first_ranks_measurements() -> None:
    """Rank 0 alone has the sample: it measures, all agree on the partition by time, and it trains."""
    build, loss_fn = MODELS["transformer"]
    x, y = batch("transformer", 8, seed=0)
    engine = PipelineEngine(build(), loss_fn, num_microbatches=4, sample=x if ranks.rank() == 0 else None)
    assert engine.partition.method == "time" and engine.partition.costs.time is not None
    everyone = ranks.all_gather_object((engine.partition.bounds, engine.partition.costs.time))
    assert all(view == everyone[0] for view in everyone), everyone
    engine.train_step(x if engine.first else None, y if engine.last else None)  # and it trains


@pytest.mark.timeout(120)
@on_ranks(4, timeout=60, in_process=True)
def test_without_a_sample_the_engine_partitions_by_parameters() -> None:
    build, loss_fn = MODELS["transformer"]
    assert PipelineEngine(build(), loss_fn, num_microbatches=4).partition.method == "parameters"


@pytest.mark.timeout(120)
@on_ranks(4, timeout=60, in_process=True)
def test_an_engine_given_layer_counts_cuts_the_model_at_them() -> None:
    build, loss_fn = MODELS["transformer"]
    explicit = PipelineEngine(build(), loss_fn, num_microbatches=4, partition=[3, 2, 2, 2])
    assert explicit.partition.bounds == [(0, 3), (3, 5), (5, 7), (7, 9)]


@pytest.mark.timeout(120)
@on_ranks(4, timeout=60, in_process=True)
def test_an_engine_partitioned_by_time_with_no_sample_anywhere_is_refused() -> None:
    build, loss_fn = MODELS["transformer"]
    try:
        PipelineEngine(build(), loss_fn, num_microbatches=4, partition="time")  # no sample anywhere
    except ValueError as error:
        assert "needs sample=" in str(error) or "could not measure" in str(error), error
    else:
        raise AssertionError("partition='time' without a sample was accepted")
