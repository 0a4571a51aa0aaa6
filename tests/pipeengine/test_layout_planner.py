"""The planner chooses the layout: every row it returns for 4 ranks (dp x pp x tp, FSDP on and off) builds and trains
like one process on real gloo ranks; the collectives are priced as the injected prices say, where the runtime runs
them; a layout it cannot build is refused with the reason. Calibration, the prices it keeps: test_calibration.py."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pipeengine import PipelineEngine
from pipeengine.construction import measure
from pipeengine.planner import calibration
from pipeengine.planner import measure as planner_measure
from pipeengine.planner.calibration import Prices
from pipeengine.planner.measure import profile_layers
from pipeengine.tune import tune
from schedules import Costs, Instruction, Kind, build_schedule, simulate, with_gradient_sync
from schedules.sim.simulation import summarize
from tests.pipeengine import ranks
from tests.pipeengine.gpt import one_process_loss, padded_batch, tied_gpt
from tests.pipeengine.models import mse
from tests.pipeengine.parity import OneProcess, train_like_one_process
from tests.pipeengine.planning import BATCH, PRICES, blocks, data
from tests.pipeengine.ranks import on_ranks

PLAN = {"*.0": ColwiseParallel(), "*.2": RowwiseParallel()}  # each block's MLP, Megatron's pair: an all-reduce each way
LAYOUTS = {(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)}


@pytest.fixture(scope="module")
def planned():  # type: ignore[no-untyped-def]
    x, y = data()
    return tune(
        blocks(),
        mse,
        x,
        4,
        target=y,
        tp_plan=PLAN,
        schedules=["1f1b", "gpipe"],
        microbatches=[2],
        methods=("uniform",),
        checkpoint=["never", "always"],
        repeats=1,
        allocator=False,
    )


def test_every_factorisation_of_4_ranks_is_priced_with_fsdp_both_ways(planned) -> None:  # type: ignore[no-untyped-def]
    seen = {(c.data_parallel, len(c.partition) // c.chunks, c.tensor_parallel, c.fsdp) for c in planned.rows}
    assert {(dp, pp, tp) for dp, pp, tp, _ in seen} == LAYOUTS, seen
    assert {(dp, pp, tp) for dp, pp, tp, fsdp in seen if fsdp} == {x for x in LAYOUTS if x[0] > 1}
    assert {c.checkpoint for c in planned.rows} == {"never", "always"}
    assert planned.prices.startswith("calibrated on the tests' fixed prices")  # tests/conftest.py's file
    kwargs = next(c for c in planned.rows if c.tensor_parallel == 2 and c.checkpoint == "always").engine_kwargs()
    assert kwargs["tensor_parallel"] == 2 and kwargs["tp_plan"] is PLAN and kwargs["checkpoint"] == "always"
    assert str(planned).count("dp") > 6 and "prices: calibrated on" in str(planned)


@on_ranks(4, timeout=240)
def test_every_layout_row_builds_and_trains_like_one_process_on_4_gloo_ranks(planned, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    chosen: dict[tuple[int, int, int, bool], dict[str, object]] = {}
    for c in planned.rows:  # the fastest row of each layout, FSDP on and off; one checkpointed row
        key = (c.data_parallel, len(c.partition) // c.chunks, c.tensor_parallel, c.fsdp)
        chosen.setdefault(key, c.engine_kwargs())
    chosen[(0, 0, 0, False)] = next(c for c in planned.rows if c.checkpoint == "always").engine_kwargs()
    assert len(chosen) == 10
    # and schedule="auto" with tensor parallelism (at the kept prices: measuring them first is tested below)
    chosen[(-1, 0, 0, False)] = {
        "schedule": "auto",
        "tensor_parallel": 2,
        "tp_plan": PLAN,
        "data_parallel": 1,
        "num_microbatches": 2,
    }  # one size to measure (in a spawned process: TP on ranks)
    x, y = data()
    for kwargs in chosen.values():
        if kwargs["schedule"] == "auto":
            kwargs = {**kwargs, "sample": x if ranks.rank() == 0 else None}
        dp = int(kwargs["data_parallel"])  # type: ignore[call-overload]
        model = blocks()
        one = OneProcess(model, mse)
        engine = PipelineEngine(model, mse, **kwargs)  # type: ignore[arg-type]
        optimizers = (torch.optim.SGD(engine.parameters(), lr=0.1), torch.optim.SGD(one.parameters(), lr=0.1))
        share = BATCH // dp
        parts = [(x[r * share : (r + 1) * share], y[r * share : (r + 1) * share]) for r in range(dp)]
        train_like_one_process(engine, one, optimizers, 2, f"layout {kwargs}", lambda step, parts=parts: parts)  # type: ignore[misc]


@pytest.fixture
def kept_prices() -> str:
    """The prices file the tests keep (tests/conftest.py's), as the pytest process names it."""
    return os.environ["PIPEENGINE_CALIBRATION"]


@pytest.mark.timeout(120)
@on_ranks(2, timeout=60)
def test_schedule_auto_with_no_prices_kept_measures_them_on_every_rank_and_rank_0_keeps_them(
    tmp_path: Path, kept_prices: str
) -> None:
    """schedule="auto" where no prices are kept: every rank measures them (calibration.calibrate, here the kept
    prices, counted) and rank 0 keeps them; then the engine builds the planner's choice."""
    prices, fixture = str(tmp_path / "prices.json"), kept_prices
    calls: list[int] = []

    def measured(engine: object) -> Prices:
        calls.append(1)
        return calibration.load(fixture)

    os.environ["PIPEENGINE_CALIBRATION"] = prices  # none there yet
    calibration.calibrate = measured  # type: ignore[assignment]  (a process of its own: nothing to restore)
    x, _ = data()
    engine = PipelineEngine(blocks(), mse, schedule="auto", sample=x if ranks.rank() == 0 else None)
    assert calls == [1] and engine.tuned is not None
    ranks.barrier()
    assert json.loads(Path(prices).read_text())["world_size"] == 2


@pytest.fixture(scope="module")
def tied_v():  # type: ignore[no-untyped-def]
    """A GPT whose head is its embedding's weight, ZB-V on 2 ranks: the layouts searched (8 sequences a step), and dp2
    fixed (a replica's 4); the layers' times injected, so that both price from alike measurements."""
    x, y = padded_batch(8, 0, 2)
    options: dict[str, object] = dict(
        schedules=["zb-v"], microbatches=[1, 2], methods=("uniform",), checkpoint=["never"], repeats=1
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(measure, "time_layer", lambda *args: (1e-4, 2e-4, 1e-4, 1e-4))
        searched = tune(tied_gpt(blocks=2), one_process_loss, x, 2, target=y, **options)  # type: ignore[arg-type]
        fixed = tune(tied_gpt(blocks=2), one_process_loss, x[:4], 2, target=y[:4], data_parallel=2, **options)  # type: ignore[arg-type]
    return searched, fixed


@on_ranks(2, timeout=120)
def test_every_row_offered_for_a_tied_model_on_a_v_builds(tied_v) -> None:  # type: ignore[no-untyped-def]
    """ZB-V's V puts the embedding's stage and the head's on one rank, where FSDP cannot shard their weight (one root
    per stage): the search asks each cut the engine's own rule (pipeengine.parallel.checked_ties), so it offers no
    dp2 x pp1 fsdp row, and says why."""
    searched, _ = tied_v
    for kwargs in [c.engine_kwargs() for c in searched.rows]:
        PipelineEngine(tied_gpt(blocks=2), one_process_loss, **kwargs)  # type: ignore[arg-type]
    assert {(c.data_parallel, c.fsdp) for c in searched.rows} == {(1, False), (2, False)}
    assert "both on pipeline rank 0" in searched.refused["dp2 x pp1 x tp1 fsdp"]


def test_a_layout_is_priced_alike_found_by_the_search_or_fixed(tied_v) -> None:  # type: ignore[no-untyped-def]
    """dp2 x pp1 found among 2 ranks' layouts, or given (data_parallel=2): one price, peak and step. Each layer's
    transients were measured by watches that counted a free of memory allocated outside them at the size of whatever
    block an earlier watch saw at that address (torch's stale record), or not at all: the peaks hung on what the
    process had measured before (observe.allocator: AllocatorWatches): measured again here, the same layers differed."""
    x, y = padded_batch(8, 0, 2)
    again = [
        profile_layers(
            tied_gpt(blocks=2),
            x,
            4,
            device=torch.device("cpu"),
            loss=one_process_loss,
            target=y,
            allocator=True,
            timed=False,
        ).allocations
        for _ in range(2)
    ]
    assert again[0] == again[1]
    searched, fixed = tied_v

    def prices(result):  # type: ignore[no-untyped-def]
        return {
            (c.fsdp, c.num_microbatches, c.partition): (c.step_time, c.peak_memory)
            for c in result.rows
            if c.data_parallel == 2
        }

    assert prices(searched) == prices(fixed) and {m for _, m, _ in prices(fixed)} == {1, 2}


def test_the_replicas_collectives_sit_on_the_timeline_where_the_runtime_runs_them() -> None:
    """dp=2, pp=2, 1F1B, m=2, every compute 1 s: each stage's AR starts after its last B, they run one at a time on a
    rank, and the step ends when the last is done; FSDP's gather holds a stage's first F, its reduce-scatter is the
    AR. The prices are the injected ones: all_reduce over 2 = 1 s + 1 ms a byte."""
    program = with_gradient_sync(build_schedule("1f1b", 2, 2))
    free = simulate(program, Costs(forward=1.0, backward=1.0))
    assert free.makespan == 6.0  # rank 0: F0 F1, B0 at 3-4 (after rank 1's F0 B0), B1 at 5-6
    sizes = [100.0, 300.0]  # each stage's gradient bytes
    synced = simulate(
        program, Costs(forward=1.0, backward=1.0, all_reduce=[PRICES.collective("all_reduce", 2, s) for s in sizes])
    )
    # rank 0's AR (stage 0) starts after its last B at 6 and takes 1 + 0.1; rank 1's (stage 1) after its last B at 5
    assert synced.makespan == pytest.approx(7.1)
    spans = [s for s in synced.spans if isinstance(s.action, Instruction) and s.action.kind is Kind.ALL_REDUCE]
    assert sorted((s.rank, s.start, round(s.end, 6)) for s in spans) == [(0, 6.0, 7.1), (1, 5.0, 6.3)]
    gathered = simulate(program, Costs(forward=1.0, backward=1.0, gather=[0.5, 0.5], all_reduce=[0.25, 0.25]))
    # each rank's first F takes 0.5 s more (its stage's parameters gathered): rank 0's F0 ends at 1.5, rank 1's at
    # 3, rank 1's B0 at 4, F1 at 5, B1 at 6, so rank 0's B1 at 7; its AR ends 0.25 later
    assert gathered.makespan == pytest.approx(7.25)


def test_no_candidate_ends_a_stage_on_a_tensor_parallel_shard() -> None:
    """A plan over the model's own layers (ColwiseParallel, GELU, RowwiseParallel: three layers a block): a stage
    ending after the Colwise or the GELU would send a shard, which the engine refuses (a new user's probe: auto
    picked one). The profile says which layers' outputs are shards; every tensor-parallel cut falls after a Rowwise,
    and 4 stages of 6 layers (2 places to cut) are left out, saying why."""
    flat = nn.Sequential(*[layer for block in blocks(2) for layer in block])
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(), "5": RowwiseParallel()}
    x, y = data()
    profile = profile_layers(flat, x, 4, repeats=0, device=torch.device("cpu"), tensor_parallel=2, tp_plan=plan)
    assert profile.shards_output == (True, True, False, True, True, False)
    result = tune(
        flat,
        mse,
        x,
        4,
        target=y,
        tp_plan=plan,
        schedules=["1f1b", "interleaved"],
        microbatches=[2],
        repeats=1,
        allocator=False,
        methods=("uniform", "time"),
    )
    tensor_parallel = [row for row in result.rows if row.tensor_parallel > 1]
    assert tensor_parallel and all(row.partition in ((6,), (3, 3)) for row in tensor_parallel), tensor_parallel
    assert any(len(row.partition) == 4 for row in result.rows if row.tensor_parallel == 1)  # 4 stages: tp=1 only


def test_tensor_parallel_collectives_are_measured_per_layer_and_priced_inside_the_computes() -> None:
    """A TP rank's profile of each block: its shard's parameters, and one all-reduce of the block's output in the
    forward and one of its input's gradient in the backward (Megatron's pair), each the size of a (rows, width)
    float tensor; the stage's F, B and I each carry their price, W none."""
    model, (x, _) = blocks(2, 16), data()
    x = torch.randn(BATCH, 16)
    hook = sys.excepthook
    profile = profile_layers(model, x, 4, repeats=1, device=torch.device("cpu"), tensor_parallel=2, tp_plan=PLAN)
    assert sys.excepthook is hook  # the fake group's "[rank0]: " prefix is not left on the user's tracebacks
    whole = profile_layers(model, x, 4, repeats=1, device=torch.device("cpu"))
    size = 4 * 16 * 4  # the (4 rows, 16) float activation
    # the first block's input needs no gradient (the user's batch): no backward all-reduce there
    assert profile.collectives == ((("F", "all_reduce", size),), (("F", "all_reduce", size), ("B", "all_reduce", size)))
    assert [2 * s for s in profile.parameter_bytes] == [w + 16 * 4 for w in whole.parameter_bytes]  # bias 2: whole
    costs = profile.stage_costs([(0, 2)], prices=PRICES)
    each = PRICES.collective("all_reduce", 2, size)
    assert each == pytest.approx(1.0 + size * 1e-3)
    assert costs.forward[0] == pytest.approx(sum(profile.forward) + 2 * each)  # type: ignore[index]
    assert costs.backward_input[0] == pytest.approx(sum(profile.backward_input) + each)  # type: ignore[index]
    assert costs.backward[0] == pytest.approx(sum(profile.backward) + each)  # type: ignore[index]
    assert costs.backward_weight[0] == pytest.approx(sum(profile.backward_weight))  # type: ignore[index]
    # the collectives wait on the other TP rank: where ranks share processors, that part is not shared
    assert costs.forward_wait == [pytest.approx(2 * each)] and costs.backward_wait == [pytest.approx(each)]
    # a machine whose ranks share 2 processors: one pipeline's ranks have them shared with the other replicas' and
    # the other tensor-parallel ranks' (each simulated rank stands for dp x tp ranks computing at once)
    sharing = dataclasses.replace(PRICES, processors=2.0)
    assert costs.processors is None and whole.stage_costs([(0, 2)], prices=sharing).processors == 2.0
    assert profile.stage_costs([(0, 1), (1, 2)], prices=sharing, data_parallel=2).processors == 0.5
    # FSDP: one all-gather and one reduce-scatter per unit (each layer with parameters), each paying its latency
    sharded = whole.stage_costs([(0, 2)], prices=PRICES, data_parallel=2, fsdp=True)
    assert sharded.gather == [pytest.approx(2 * 0.5)] and sharded.all_reduce == [pytest.approx(2 * 0.25)]
    # an unmeasured group size scales as a ring from the nearest measured one; an unmeasured op is a ring of p2p
    assert PRICES.collective("all_reduce", 4, 1000.0) == pytest.approx(1.0 * 6 / 2 + 1e-3 * 1000 * 0.75 / 0.5)
    built_in = 3 * calibration.LATENCY + 0.75 * calibration.PER_BYTE * 1e6  # a ring of the built-in messages
    assert Prices().collective("all_gather", 4, 1e6) == pytest.approx(built_in)


def test_each_timed_run_of_a_layer_starts_with_the_caches_flushed() -> None:
    """On the CPU a layer's F, B, I and W are each timed right after the caches are written over (a rank meets its
    stage's weights cold in a step), with a buffer the size of the processor's largest cache."""
    order: list[str] = []
    layer = nn.Linear(4, 4)
    layer.register_forward_pre_hook(lambda *_: order.append("F"))
    layer.register_full_backward_pre_hook(lambda *_: order.append("B"))
    measure.time_layer(layer, torch.randn(2, 4), False, torch.device("cpu"), lambda: order.append("flush"))
    # F, B, then F again untimed (I and W need its graph), I, W: each timed one after a flush
    assert order == ["flush", "F", "flush", "B", "F", "flush", "B", "flush"]
    from pipeengine.construction.caches import last_level_cache

    assert last_level_cache() >= 2**20


def test_a_layout_of_one_pipeline_rank_is_priced_from_layers_timed_with_the_host_path_warm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """warm=True: each timed compute follows the flush and a forward and backward of a copy of the layer (its own
    weights: the layer's stay cold). tune measures the layouts of one pipeline rank (dp=2 of 2 ranks) so, and only
    them, and prices them from those times."""
    order: list[tuple[str, int]] = []
    layer = nn.Sequential(nn.Linear(4, 4))
    layer.register_forward_pre_hook(lambda module, _: order.append(("F", module[0].weight.data_ptr())))
    monkeypatch.setattr(measure, "flusher", lambda device: lambda: order.append(("flush", 0)))
    profile_layers(nn.Sequential(layer), torch.randn(2, 4), 2, repeats=1, device=torch.device("cpu"), warm=True)
    flushed = [i for i, (kind, _) in enumerate(order) if kind == "flush"]
    copy, timed = order[flushed[0] + 1], order[flushed[0] + 2]  # after the flush the copy's F, then the layer's
    assert copy[0] == timed[0] == "F" and copy[1] != timed[1]
    assert len(flushed) == 8 and all(order[i + 1] == copy for i in flushed)  # F, B, I, W: each run warm, twice
    assert {ptr for kind, ptr in order if kind == "F"} == {copy[1], timed[1]}

    calls: list[tuple[int, int, bool]] = []

    def measured(model: nn.Sequential, sample: torch.Tensor, rows: int, **kw: object) -> object:
        calls.append((rows, kw["tensor_parallel"], kw["warm"]))  # type: ignore[arg-type]
        real = profile_layers(model, sample, rows, **{**kw, "warm": False})  # type: ignore[arg-type]
        return dataclasses.replace(real, forward=tuple(f + (1.0 if kw["warm"] else 0.0) for f in real.forward))

    monkeypatch.setattr(planner_measure, "profile_layers", measured)
    x, y = data()
    result = tune(
        blocks(2),
        mse,
        x,
        2,
        target=y,
        schedules=["1f1b"],
        microbatches=[2],
        methods=("uniform",),
        checkpoint=["never"],
        repeats=1,
        allocator=False,
    )
    assert sorted(calls) == [(BATCH // 4, 1, True), (BATCH // 2, 1, False)]
    alone = [c.step_time for c in result.rows if c.data_parallel == 2]
    piped = [c.step_time for c in result.rows if c.data_parallel == 1]
    assert alone and piped and min(alone) > 2 * 2 * 1.0 > max(piped)  # 2 micro-batches of 2 layers, 1 s more each


def test_shards_measured_in_a_fresh_process_share_one_inside_one_process() -> None:
    """On a rank (schedule="auto" with tensor parallelism) each TP measurement runs in a fresh process: inside
    one_process() (tune's) they share one, started at the first and stopped at the end (one each took 18-23 s of
    spawns and imports for a 2-rank auto build)."""
    from pipeengine.planner import elsewhere as isolated

    arguments = dict(
        repeats=1,
        device=torch.device("cpu"),
        threads=1,
        loss=None,
        target=None,
        timed=True,
        allocator=False,
        compile=False,
        tensor_parallel=2,
        tp_plan=PLAN,
    )
    model, x = blocks(2, 16), torch.randn(BATCH, 16)
    with isolated.one_process():
        first = isolated.elsewhere(profile_layers, model, x, 4, arguments)
        process = isolated._SHARED["pool"]
        second = isolated.elsewhere(profile_layers, model, x, 2, arguments)
        assert isolated._SHARED["pool"] is process
    assert not isolated._SHARED and (first.rows, second.rows) == (4, 2) and first.tensor_parallel == 2


def test_a_refused_layout_says_why() -> None:
    x, y = data()
    narrow = {"*.0": ColwiseParallel(), "*.2": RowwiseParallel()}
    result = tune(
        blocks(2, 5),
        mse,
        x[:, :5].contiguous(),
        4,
        target=y[:, :5].contiguous(),
        tp_plan=narrow,
        schedules=["1f1b"],
        microbatches=[2],
        methods=("uniform",),
        checkpoint=["never"],
        repeats=1,
        allocator=False,
    )
    assert "cannot share equally" in result.refused["dp1 x pp1 x tp4"], result.refused  # 10 features over 4 ranks
    assert "the model has 2: use at most 2 pipeline ranks" in result.refused["dp1 x pp4 x tp1"]
    assert "refused dp1 x pp4 x tp1: 4 pipeline stages" in str(result)
    assert {c.tensor_parallel for c in result.rows} == {1, 2}
    with pytest.raises(ValueError, match=r"tensor parallelism runs DTensor collectives, which in-process ranks"):
        tune(blocks(), mse, x, 2, target=y, tp_plan=PLAN, data_parallel=1, tensor_parallel=2, backend="loopback")
    odd = tune(
        blocks(),
        mse,
        x[:6],
        4,
        target=y[:6],
        data_parallel=None,
        tp_plan=None,
        schedules=["1f1b"],
        microbatches=[1],
        checkpoint=["never"],
        repeats=1,
        allocator=False,
    )
    assert odd.refused["dp4 x pp1 x tp1"] == "the batch of 6 rows does not split equally into 4 replicas"


def test_mistaken_prices_limits_and_sizes_are_refused_with_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x, y = data()
    with pytest.raises(ValueError, match=r"product must divide world_size=4"):  # was "...this model: " and nothing
        tune(blocks(), mse, x, 4, target=y, tp_plan=PLAN, tensor_parallel=3)
    for limit in ("64MiB", 0, -5):
        with pytest.raises(ValueError, match=r"memory_limit must be a positive number of bytes per rank"):
            tune(blocks(), mse, x, 2, target=y, memory_limit=limit)  # type: ignore[arg-type]
    record = json.loads((Path(__file__).parents[1] / "calibration.json").read_text())
    for key, value, said in (
        ("processors", 0, "processors is 0: "),
        ("overhead", -1e-3, "overhead is -0.001"),
        ("overhead", float("nan"), "overhead is nan"),
    ):
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({**record, key: value}))
        with pytest.raises(ValueError, match=rf"{path.name} is refused: {said}.*--world-size N .* again"):
            calibration.load(path)
    with pytest.raises(ValueError, match=r"cannot be read \(IsADirectoryError"):
        calibration.load(tmp_path)
    from pipeengine.planner.cli import main

    with pytest.raises(SystemExit):  # one line, not two tracebacks from the launched rank
        main(["--calibrate", "--world-size", "1"], PipelineEngine)
    assert "error: --calibrate times messages and collectives between ranks: --world-size 2 or more, got 1" in (
        capsys.readouterr().err
    )
    # a file measured on 4 ranks, a plan for 2: tune says so, and how to measure for 2 (the tests' fixed prices
    # name no world size)
    (tmp_path / "four.json").write_text(json.dumps({**record, "world_size": 4}))
    with pytest.warns(UserWarning, match=r"prices measured on 4 .* --calibrate --world-size 2"):
        tune(
            blocks(2),
            mse,
            x,
            2,
            target=y,
            schedules=["1f1b"],
            microbatches=[2],
            checkpoint=["never"],
            repeats=1,
            allocator=False,
            prices=tmp_path / "four.json",
        )


def test_a_step_frame_posting_and_copying_are_priced_as_the_runtime_spends_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected prices: a step's frame by the layout's pipeline and replica sizes (unmeasured sizes scaled by their
    ranks less one); each post's host time; a sync's copies (an AR flattens before, copies back and divides after;
    FSDP copies in and out, holds its rank through its reduce-scatters and copies its gathered parameters)."""
    frame = {"pipeline": {2: 1.0, 4: 3.0}, "replicas": {2: 0.5}}
    priced = dataclasses.replace(PRICES, frame=frame, post=0.25, post_message=0.125, copy=1e-3)
    assert priced.frame_of(1, 1) == 0 and priced.frame_of(2, 4) == 3.5 and priced.frame_of(4, 2) == 1 + 0.5 * 3
    assert priced.frame_of(1, 8) == pytest.approx(3.0 * 7 / 3)
    profile = profile_layers(blocks(2, 16), torch.randn(BATCH, 16), 4, repeats=1, device=torch.device("cpu"))
    params = [float(sum(profile.parameter_bytes))]
    costs = profile.stage_costs([(0, 2)], prices=priced, data_parallel=2)
    assert (costs.post, costs.post_message, costs.sync_blocking) == (0.25, 0.125, False)
    assert costs.sync_host == [pytest.approx(1e-3 * params[0])]
    assert costs.all_reduce == [pytest.approx(PRICES.collective("all_reduce", 2, params[0]) + 2e-3 * params[0])]
    assert profile.stage_costs([(0, 2)], prices=priced).sync_host == [0.0]  # no replicas: no sync
    sharded = profile.stage_costs([(0, 2)], prices=priced, data_parallel=2, fsdp=True)
    assert sharded.sync_blocking and sharded.sync_host == [pytest.approx(1e-3 * params[0] * 1.5)]
    assert sharded.gather == [pytest.approx(2 * 0.5 + 1e-3 * params[0])]
    # FSDP2's first backward of a step makes every unit's whole gradient before it ends: at least that on top
    watched = profile_layers(
        blocks(2, 16), torch.randn(BATCH, 16), 4, repeats=1, device=torch.device("cpu"), allocator=True
    )
    firsts = [
        watched.stage_costs([(0, 2)], prices=PRICES, data_parallel=2, fsdp=sharding).memory.per_stage(1)[  # type: ignore[union-attr]
            "first_transient"
        ][0]
        for sharding in (False, True)
    ]
    assert firsts[1] == max(firsts[0], float(sum(watched.parameter_bytes))) > firsts[0]
    # what FSDP2 adds per unit (2 here): its hooks on each compute, and beyond each raw gather and reduce-scatter
    plain = profile.stage_costs([(0, 2)], prices=PRICES, data_parallel=2, fsdp=True)
    hooked = dataclasses.replace(PRICES, fsdp={"hooks": [0.5, 0.25], "gather": {2: 1.0}, "reduce": {4: 2.0}})
    extra = profile.stage_costs([(0, 2)], prices=hooked, data_parallel=2, fsdp=True)
    assert extra.forward == [pytest.approx(plain.forward[0] + 2 * 0.5)]  # type: ignore[index]
    assert extra.backward_input == [pytest.approx(plain.backward_input[0] + 2 * 0.25)]  # type: ignore[index]
    assert extra.gather == [pytest.approx(plain.gather[0] + 2 * 1.0)]  # type: ignore[index]
    assert extra.all_reduce == [pytest.approx(plain.all_reduce[0] + 2 * 2.0)]  # type: ignore[index]  # nearest: 4
    # a rank's peak holds one more of its largest transfer or tensor-parallel tensor (gloo may free one late)
    cut = [(0, 1), (1, 2)]
    assert profile.in_flight(cut) == profile.output[0] and profile.in_flight([(0, 2)]) == 0.0
    # with FSDP, or a unit's reduce-scatter input: its largest layer's gradients
    unit = float(max(profile.parameter_bytes))
    assert unit > profile.output[0] and profile.in_flight(cut, fsdp=True) == profile.in_flight([(0, 2)], True) == unit
    from pipeengine.planner import pricing

    program = build_schedule("1f1b", 2, 2)
    spec = pricing.Spec(program, profile, cut, 1, False, "never")
    plain_peaks = summarize(program, profile.stage_costs(cut, prices=PRICES, placement=program.placement))
    for buffered, late in ((True, profile.output[0]), (False, 0.0)):
        peaks = pricing.price(spec, PRICES, 2, buffered)[2]
        assert list(peaks) == [pytest.approx(p + late) for p in plain_peaks.required_memory]
    # the search's step is the simulated program's makespan and the frame around it: the same layers (measured once)
    # priced without a frame and with one over a pipeline of 2 take 7 s more each
    x, y = data()

    measured = {}
    monkeypatch.setattr(
        planner_measure,
        "profile_layers",
        lambda model, sample, rows, **kw: measured.setdefault(
            (rows, kw["tensor_parallel"], kw["warm"]), profile_layers(model, sample, rows, **kw)
        ),
    )
    record = json.loads((Path(__file__).parents[1] / "calibration.json").read_text())
    steps = []
    for pipeline in ({}, {"2": 7.0}):
        (tmp_path / "priced.json").write_text(json.dumps({**record, "frame": {"pipeline": pipeline}}))
        result = tune(
            blocks(2),
            mse,
            x,
            2,
            target=y,
            prices=tmp_path / "priced.json",
            schedules=["1f1b"],
            microbatches=[2],
            data_parallel=1,
            methods=("uniform",),
            checkpoint=["never"],
            repeats=1,
            allocator=False,
        )
        steps.append([c.step_time for c in result.rows])
    assert len(steps[0]) == 1 and steps[1] == [pytest.approx(t + 7.0) for t in steps[0]]
    # a file from an earlier pipeengine (no frame, posting or copying: format 1) is refused, saying so
    old = {k: v for k, v in record.items() if k not in ("format", "frame", "post", "copy", "fsdp")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"old.json is refused: it is of format 1, written by an earlier pipeengine"):
        calibration.load(tmp_path / "old.json")


def test_candidates_are_priced_on_forked_workers_in_order_and_as_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """pricing.in_parallel splits the work round-robin between this process and forked ones and gives it back in
    order; too little work is done here; a worker's failure is raised here. The search's rows are the same priced on
    2 workers as on 1 (the layers measured once)."""
    from pipeengine.planner import pricing

    def work(i: int) -> pricing.Priced:
        return float(i), 0.5, (float(os.getpid()),)

    forked = pricing.in_parallel(pricing.WORTH * 2, work, workers=2)
    assert [row[0] for row in forked] == list(range(pricing.WORTH * 2))
    assert [row[2][0] == os.getpid() for row in forked[:4]] == [True, False, True, False]  # here, the fork, ...
    assert {row[2][0] for row in pricing.in_parallel(10, work, workers=2)} == {os.getpid()}

    def broken(i: int) -> pricing.Priced:
        if i % 2:
            raise ZeroDivisionError(f"candidate {i}")
        return work(i)

    with pytest.raises(RuntimeError, match=r"(?s)on 2 workers failed: Traceback.*ZeroDivisionError: candidate 1"):
        pricing.in_parallel(pricing.WORTH * 2, broken, workers=2)

    measured: dict[tuple[int, int, bool], object] = {}
    monkeypatch.setattr(
        planner_measure,
        "profile_layers",
        lambda model, sample, rows, **kw: measured.setdefault(
            (rows, kw["tensor_parallel"], kw["warm"]), profile_layers(model, sample, rows, **kw)
        ),
    )
    monkeypatch.setattr(pricing, "WORTH", 8)
    x, y = data()
    rows = [
        tune(
            blocks(),
            mse,
            x,
            4,
            target=y,
            tp_plan=PLAN,
            microbatches=[1, 2],
            repeats=1,
            allocator=False,
            workers=workers,
        ).rows
        for workers in (1, 2)
    ]
    assert len(rows[0]) > 16 and rows[0] == rows[1]
