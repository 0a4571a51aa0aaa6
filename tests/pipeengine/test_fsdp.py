"""Sharded data parallel (FSDP2) inside the pipeline: each replica holds 1/dp of every stage's weights, gradients and
optimizer state; gradients reduce-scattered once per stage per step. Real gloo processes (FSDP2 needs
torch.distributed); dp=2 x pp=2 x tp=2 is in test_tensor_parallel.py."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine, consolidate, launch
from pipeengine.core.config import EngineConfig
from pipeengine.core.dtensors import local
from tests.pipeengine import ranks
from tests.pipeengine.gpt import tied_gpt, token_sum
from tests.pipeengine.models import MODELS, SEEDED, batch, mlp, mse
from tests.pipeengine.parity import (
    ATOL,
    RTOL,
    OneProcess,
    check_clipped,
    check_eval,
    check_weights,
    load_reference,
    save_reference,
    train_like_one_process,
)
from tests.pipeengine.ranks import on_ranks

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min", "dualpipe-v"]
DP = 2


def replica_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batch("mlp", 8, seed=100 * step + replica) for replica in range(DP)]


def sharded_parity(schedule: str, steps: int = 2, **options: object) -> PipelineEngine:
    """Loss, every gradient (gathered whole) and the weights after AdamW steps equal one process's."""
    build, loss_fn = MODELS["mlp"]
    model = build()
    one = OneProcess(model, loss_fn)
    engine = PipelineEngine(
        model, loss_fn, num_microbatches=4, schedule=schedule, data_parallel=DP, fsdp=True, **options
    )  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(one.parameters(), lr=1e-2)
    what = f"fsdp {schedule} {options}"
    train_like_one_process(engine, one, (optimizer, reference_optimizer), steps, what, replica_batches)
    check_weights(engine, one, f"{what} after {steps} steps")
    x, y = replica_batches(steps)[engine.dp_rank]
    engine.train_step(x if engine.first else None, y if engine.last else None)  # gradients, to see their shards
    for name, param in engine.named_parameters():  # each replica holds its part: parameter, gradient, moments
        rows = [len(part) for part in torch.arange(param.shape[0]).chunk(DP)] + [0] * DP  # dim 0, as torch.chunk
        held = rows[engine.dp_rank] * param[0].numel()
        assert local(param).numel() == held < param.numel(), (name, local(param).shape, param.shape)
        assert local(param.grad).numel() == held == local(optimizer.state[param]["exp_avg"]).numel(), name  # type: ignore[arg-type]
    return engine


@pytest.mark.timeout(240)
@on_ranks(4, timeout=200)
def test_dp2_pp2_trains_like_one_process_with_sharded_state() -> None:
    # fsdp with each schedule is a pair of the composition matrix (tests/composition); here the shards' sizes on a
    # schedule of each kind: one stage per rank, two (a V), and a split backward
    for schedule in ("gpipe", "interleaved", "dualpipe-v"):
        sharded_parity(schedule)
    sharded_parity("1f1b", checkpoint="always", reshard_after_forward=True)
    sharded_parity("zb-h1", reshard_after_forward=True)  # I names the gathered weights again, after they were freed
    reduce_scatters_once_per_step()
    clipping()


def reduce_scatters_once_per_step() -> None:
    """One reduce-scatter per FSDP unit (each layer with parameters) per step, after the stage's last backward (or
    last W), not one per micro-batch."""
    import torch.distributed as dist

    # what FSDP2's reduce-scatter calls: reduce_scatter_single (torch 2.13's DefaultReduceScatter), or
    # reduce_scatter_tensor (torch 2.11's, which has no reduce_scatter_single: seen on a lent GPU's)
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    original, calls = getattr(dist, name), []

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)

    setattr(dist, name, counted)
    try:
        for schedule in ("1f1b", "zb-h1"):
            build, loss_fn = MODELS["mlp"]
            engine = PipelineEngine(
                build(), loss_fn, num_microbatches=4, schedule=schedule, data_parallel=DP, fsdp=True
            )
            units = sum(1 for module in engine.stages.values() for layer in module if [*layer.parameters()])
            for step in range(2):
                calls.clear()
                x, y = replica_batches(step)[engine.dp_rank]
                engine.train_step(x if engine.first else None, y if engine.last else None)
                assert len(calls) == units, (schedule, step, len(calls), units)
    finally:
        setattr(dist, name, original)


def clipping() -> None:
    """clip_grad_norm_ over the shards (2-norm and inf-norm) equals torch's on one process; so does eval_step."""
    build, loss_fn = MODELS["mlp"]
    model = build()
    one = OneProcess(model, loss_fn)
    engine = PipelineEngine(model, loss_fn, num_microbatches=4, data_parallel=DP, fsdp=True)
    parts = replica_batches(0)
    x, y = parts[engine.dp_rank]
    for norm_type, max_norm in ((2.0, 0.05), (float("inf"), 0.01)):
        engine.zero_grad()
        one.seq.zero_grad()
        engine.train_step(x if engine.first else None, y if engine.last else None)
        one.step(parts)
        check_clipped(engine, one, max_norm, "fsdp", norm_type)
    check_eval(engine, one, x, "fsdp eval")  # forward only, on the shards gathered


@pytest.mark.timeout(180)
@on_ranks(4, timeout=150)
def test_memory_the_planner_and_the_refusals_every_rank_makes() -> None:
    """Memory, the planner, refusals that every rank makes alike (a tie across ranks and bf16 with FSDP: the
    composition matrix)."""
    memory()
    planned()
    with pytest.raises(ValueError, match="both on pipeline rank 0"):  # the V puts embedding and head on rank 0
        PipelineEngine(tied_gpt(), token_sum, num_microbatches=4, schedule="zb-v", data_parallel=DP, fsdp=True)
    odd = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double(), nn.Linear(4, 4), nn.Linear(4, 4))
    odd[1].bias = nn.Parameter(odd[1].bias.float())
    with pytest.raises(ValueError, match=r"layer 1 \(Linear\) holds parameters of dtypes \['float32', 'float64'\]"):
        PipelineEngine(odd, nn.functional.mse_loss, num_microbatches=2, data_parallel=DP, fsdp=True)


def planned() -> None:
    """schedule="auto" with fsdp=True: the planner prices the sharded state, and every rank builds its choice."""
    build, loss_fn = MODELS["mlp"]
    model = build()
    one = OneProcess(model, loss_fn)
    x = replica_batches(0)[0][0]
    engine = PipelineEngine(model, loss_fn, schedule="auto", sample=x, data_parallel=DP, fsdp=True)
    assert engine.tuned is not None and engine.tuned.fsdp and engine.config.fsdp
    optimizers = (torch.optim.AdamW(engine.parameters(), lr=1e-2), torch.optim.AdamW(one.parameters(), lr=1e-2))
    train_like_one_process(engine, one, optimizers, 1, "fsdp auto", replica_batches)


def trained(directory: str, steps: int = 2, **options: object) -> PipelineEngine:
    """Train an engine with ``options`` beside one process for ``steps`` steps, then save both (the reference as
    reference.pt, for the ranks that load)."""
    build, loss_fn = MODELS["mlp"]
    model = build()
    one = OneProcess(model, loss_fn)
    engine = PipelineEngine(model, loss_fn, num_microbatches=4, **options)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(one.parameters(), lr=1e-2)
    train_like_one_process(
        engine,
        one,
        (optimizer, reference_optimizer),
        steps,
        f"before saving {options}",
        lambda step: replica_batches(step)[: engine.data_parallel],
    )
    engine.save(directory, optimizer)
    save_reference(directory, one, reference_optimizer)
    return engine


def continues(directory: str, **options: object) -> None:
    """Another configuration (other weights to start) loads the checkpoint, AdamW's moments included, and trains on
    exactly as one process does."""
    build, loss_fn = MODELS["mlp"]
    engine = PipelineEngine(build(seed=7), loss_fn, num_microbatches=4, **options)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3)  # the checkpoint's lr (1e-2) must come back
    engine.load(directory, optimizer)
    one = OneProcess(build(), loss_fn)
    reference_optimizer = torch.optim.AdamW(one.parameters(), lr=1e-2)
    load_reference(directory, one, reference_optimizer)
    what = f"loaded into {options}"
    check_weights(engine, one, what)
    train_like_one_process(
        engine,
        one,
        (optimizer, reference_optimizer),
        1,
        what,
        lambda step: replica_batches(50 + step)[: engine.data_parallel],
    )
    check_weights(engine, one, f"{what}, one step on")


def checkpoints(sharded: str, plain: str) -> None:
    """fsdp=True at dp=2 saves its shards; dp=2 without fsdp and fsdp on another partition load them; a plain
    checkpoint (no fsdp) loads into fsdp. Every load trains on like one process."""
    trained(sharded, data_parallel=DP, fsdp=True, schedule="zb-h1")
    continues(sharded, data_parallel=DP, schedule="1f1b", partition=[3, 8])
    continues(sharded, data_parallel=DP, fsdp=True, schedule="gpipe", partition=[7, 4])
    ranks.barrier()
    trained(plain, data_parallel=DP, schedule="1f1b")
    continues(plain, data_parallel=DP, fsdp=True, schedule="zb-h1", partition=[4, 7])


def memory() -> None:
    """What each rank holds: weights, gradients and AdamW's moments halve with fsdp at dp=2 (measured from the
    tensors); the simulator fed the traced step's sizes predicts its peaks within 10%, with the parameters gathered
    from the first F and the whole gradients from the first B to the AR counted; so does the planner, from each
    layer measured alone."""
    from pipeengine.observe.allocator import training_bytes
    from pipeengine.tune import tune
    from schedules import Costs, simulate

    held = {}
    for options in ({}, {"fsdp": True}, {"fsdp": True, "reshard_after_forward": True}):
        with SEEDED:
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)])
        untouched = copy.deepcopy(model)  # the engine shards the model's own layers
        engine = PipelineEngine(model, nn.functional.mse_loss, num_microbatches=4, data_parallel=DP, **options)  # type: ignore[arg-type]
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3)
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
        engine.train_step(x if engine.first else None, x if engine.last else None)
        held[str(options)] = training_bytes(engine.parameters(), optimizer)  # weights, gradients (no moments yet)
        optimizer.step()
        optimizer.zero_grad()
        with engine.tracing(optimizer):
            engine.train_step(x if engine.first else None, x if engine.last else None)
        held[str(options)] += sum(
            local(v).numel() * v.element_size()
            for p in engine.parameters()
            for v in optimizer.state[p].values()
            if v.dim()
        )  # the moments
        timeline = engine.timeline()
        if timeline is not None:  # the ledger's peaks: deterministic (the allocator's, in benchmarks/memory.py)
            costs = Costs.from_timeline(timeline)
            assert costs.memory is not None
            predicted = simulate(engine.last_program, replace(costs, memory=costs.memory.without_transients()))  # type: ignore[arg-type]
            ratios = [p / a for p, a in zip(predicted.peak_memory, timeline.peak_memory, strict=True)]
            assert all(0.9 <= r <= 1.1 for r in ratios), (options, predicted.peak_memory, timeline.peak_memory)
            if options:  # each stage's AR keeps a unit's reduce-scatter input (a layer's whole gradients: 256 x 257
                unit = 256 * 257 * 4  # floats); its rise: that unit's shard and, as gloo lets buffers go late, every
                table = costs.memory.per_stage(len(engine.last_program.placement))  # type: ignore[union-attr]
                rise = unit / DP + 4 * unit  # unit's reduce-scatter buffer; its first F gathers the stage twice
                assert table["reduce_held"] == [unit] * 2 and table["reduce_transient"] == [rise] * 2, table
                assert table["gather_transient"] == table["gathered"] == [4 * unit] * 2, table
            if options == {"fsdp": True}:  # the planner, from each layer measured alone, against the traced step
                planned = tune(
                    untouched,
                    nn.functional.mse_loss,
                    x,
                    4,
                    target=x,
                    data_parallel=DP,
                    fsdp=True,
                    schedules=["1f1b"],
                    microbatches=[4],
                    methods=("uniform",),
                ).best
                traced = simulate(engine.last_program, costs).required_memory  # type: ignore[arg-type]
                ratios = [p / t for p, t in zip(planned.peak_memory, traced, strict=True)]
                assert planned.partition == (4, 4) and all(0.9 <= r <= 1.1 for r in ratios), (planned, traced)
    assert held["{'fsdp': True}"] * 2 == held["{}"] == held["{'fsdp': True, 'reshard_after_forward': True}"] * 2, held


def save_that_fails(directory: str) -> None:
    """Rank 1's shards fail to write during a second sharded checkpoint (a planted fault in DCP's file writer)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    build, loss_fn = MODELS["mlp"]
    engine = PipelineEngine(build(seed=7), loss_fn, num_microbatches=4, data_parallel=DP, fsdp=True)
    if ranks.rank() == 1:

        def broken(*args: object, **kwargs: object) -> object:
            raise OSError("disk full (planted)")

        FileSystemWriter.write_data = broken  # type: ignore[method-assign, assignment]
    engine.save(directory)


def test_options_fsdp_cannot_use_are_refused() -> None:
    with pytest.raises(ValueError, match=r"fsdp=True .* data_parallel=1: there is nothing to shard over"):
        EngineConfig(num_microbatches=2, fsdp=True)
    with pytest.raises(ValueError, match="without fsdp=True nothing is gathered"):
        EngineConfig(num_microbatches=2, data_parallel=2, reshard_after_forward=True)


def test_the_planner_prices_the_sharded_state_and_builds_it() -> None:
    """tune(fsdp=True): each candidate's state sharded over the replicas, with the gathered parameters and whole
    gradients during the step: less than the same candidate replicated, more than half of it; its choice builds
    with fsdp=True. Over 4 replicas: over 2, what this small model's state saves is about what the planner holds
    during the step (the gathered parameters and whole gradients from the first F to the AR, a late reduce-scatter
    input on gloo), within one layer's bytes of equal."""
    from pipeengine.tune import tune

    model, x = mlp(width=64), torch.randn(32, 64)
    y = torch.randn(32, 4)
    plain, sharded = (
        tune(
            model,
            mse,
            x,
            4,
            target=y,
            data_parallel=4,
            fsdp=fsdp,
            schedules=["1f1b", "zb-h1"],
            microbatches=[4],
            methods=("uniform",),
            checkpoint=["never"],
        )
        for fsdp in (False, True)
    )
    assert len(plain.rows) == len(sharded.rows) == 2
    for mine in sharded.rows:
        theirs = next(c for c in plain.rows if c.schedule == mine.schedule)
        assert all(t / 2 < m < t for m, t in zip(mine.peak_memory, theirs.peak_memory, strict=True)), (mine, theirs)
        assert mine.engine_kwargs()["fsdp"] is True and "fsdp" not in theirs.engine_kwargs()
    with pytest.raises(ValueError, match="fsdp=True shards the state over the data-parallel replicas"):
        tune(model, mse, x, 4, target=y, fsdp=True, data_parallel=1)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_a_backward_holds_the_larger_of_its_transient_and_a_units_gradients_by_hand(schedule: str) -> None:
    """The planner's FSDP memory (parallel.fsdp.priced): a B (gpipe) or W (zb-h1) holds the larger of its own
    transient and the largest unit's whole gradients, not their sum. One stage, one micro-batch, dp=2: parameters
    100 bytes, state 400 (with their gradients and AdamW's two moments), 200 on each replica; activation 100; B's
    (W's) transient 30; largest unit 80. F gathers the parameters (100) through a buffer of as much: 400, then
    200 + 100 + activation 100 = 400. B (W) holds max(30, 80) = 80 more: 480 (the sum would be 510). Its end lets
    the activation go and makes the whole gradients (100): 400. The AR holds a unit's shard more (80 / 2): 440. The
    peak: 480."""
    from pipeengine.parallel.fsdp import priced
    from schedules import Costs, Memory, build_schedule, simulate, with_gradient_sync

    transients = {"backward_transient": 30.0} if schedule == "gpipe" else {"weight_transient": 30.0}
    memory = priced(Memory(state=400.0, activation=100.0, **transients), [400.0], 2, 2, False, [80.0], False)
    step = with_gradient_sync(build_schedule(schedule, 1, 1))
    assert simulate(step, Costs(memory=memory)).peak_memory == [480.0]
    assert memory.backward_transient == memory.weight_transient == [80.0]


@pytest.mark.timeout(60)
@on_ranks(4, timeout=30, in_process=True)
def test_in_process_ranks_are_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"fsdp=True runs DTensor collectives.*in-process ranks"):
        PipelineEngine(mlp(), nn.functional.mse_loss, num_microbatches=2, data_parallel=2, fsdp=True)


@pytest.mark.timeout(240)
def test_checkpoints_each_rank_writes_its_shards_and_any_sharding_loads_them(tmp_path: Path) -> None:
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    launch(checkpoints, 4, args=(str(sharded), str(plain)), timeout=200)
    target = sharded / (sharded / "latest").read_text()
    assert json.loads((target / "meta.json").read_text())["format"] == 2
    assert len(list((target / "shards").glob("*.distcp"))) == 4  # every rank wrote its own shards
    assert not list(target.glob("part-*.pt"))
    reference = torch.load(sharded / "reference.pt", weights_only=False)["model"]
    state = consolidate(sharded)  # the plain nn.Sequential's state_dict, no ranks needed
    assert list(state) == list(reference)
    for name, value in reference.items():  # the engine trained like one process: the suite's fp32 tolerance
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    launch(continues, 2, args=(str(sharded),), timeout=60, in_process=True)  # dp=1, no processes
    with pytest.raises(OSError, match=r"rank 1: OSError: disk full \(planted\).*'latest' still points at checkpoint-1"):
        launch(save_that_fails, 4, args=(str(sharded),), timeout=60)
    assert (sharded / "latest").read_text() == target.name
    after = consolidate(sharded)
    assert all(torch.equal(state[name], after[name]) for name in state)
