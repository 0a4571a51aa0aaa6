"""Tensor parallel inside the pipeline: dp x pp x tp on one grid, each stage parallelized with torch's own
parallelize_module on its tensor-parallel sub-mesh, trained exactly like one process (real gloo processes: DTensor
collectives need torch.distributed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeengine import PipelineEngine, launch
from pipeengine.core.dtensors import settle, whole
from pipeengine.observe.allocator import AllocatorWatch
from pipeengine.observe.ledger import storage
from schedules import Costs, simulate
from tests.pipeengine import ranks
from tests.pipeengine.gpt import WIDTH
from tests.pipeengine.gpt import count_tokens as count
from tests.pipeengine.gpt import headwise_gpt as gpt  # the GPT laid out head by head, for tensor parallelism
from tests.pipeengine.gpt import one_process_loss as token_mean
from tests.pipeengine.gpt import tp_batch as batch
from tests.pipeengine.gpt import tp_plan as plan
from tests.pipeengine.gpt import whole_token_sum as token_sum
from tests.pipeengine.memory import ledger_costs
from tests.pipeengine.models import SEEDED
from tests.pipeengine.parity import (
    OneProcess,
    check_clipped,
    check_eval,
    check_weights,
    close,
    load_reference,
    save_reference,
    step_both,
    train_like_one_process,
)
from tests.pipeengine.ranks import on_ranks


def parity(
    schedule: str, data_parallel: int = 1, options: dict[str, object] | None = None, tied: bool = False, steps: int = 2
) -> None:
    """Loss, every gradient (gathered whole) and the weights after AdamW steps equal one process's token mean."""
    options = options or {}
    model = gpt(tied)
    one = OneProcess(model, token_mean)
    engine = PipelineEngine(
        model,
        token_sum,
        num_microbatches=4,
        schedule=schedule,
        data_parallel=data_parallel,
        tensor_parallel=2,
        tp_plan=plan(tied),
        loss_count=count,
        **options,
    )  # type: ignore[arg-type]
    assert engine.mesh is not None and engine.mesh.mesh_dim_names == ("dp", "pp", "tp")  # type: ignore[attr-defined]
    optimizers = (torch.optim.AdamW(engine.parameters(), lr=1e-2), torch.optim.AdamW(one.parameters(), lr=1e-2))
    what = f"tp=2 {schedule} dp={data_parallel} {options} tied={tied}"
    train_like_one_process(
        engine,
        one,
        optimizers,
        steps,
        what,
        lambda step: [batch(8, seed=10 * step + r) for r in range(data_parallel)],
    )
    check_weights(engine, one, f"{what} after {steps} steps")


def every_schedule() -> None:
    # tp=2 with each schedule, checkpointing, data parallelism and FSDP are pairs of the composition matrix
    # (tests/composition); here the GPT's tie on both sides of the vocabulary dim, as its plan shards it
    parity("zb-v", tied=True)  # the embedding and the head on rank 0 of the V: one tensor again after the transform
    parity("1f1b", tied=True)  # and on two ranks: summed over the holders, each shard with its own


def save_plain(directory: str) -> None:
    """tp=1 (in-process ranks): a step, then a checkpoint and the one-process reference beside it."""
    model = gpt()
    one = OneProcess(model, token_mean)
    engine = PipelineEngine(model, token_sum, num_microbatches=2, loss_count=count, partition=[2, 4])
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(one.parameters(), lr=1e-2)
    x, y = batch(8, seed=50)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    one.step([(x, y)])
    step_both(optimizer, reference_optimizer)
    engine.save(directory, optimizer)
    save_reference(directory, one, reference_optimizer)


def continue_from(directory: str, engine: PipelineEngine, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """Load a checkpoint and its reference; one more step of both must agree, AdamW's moments included."""
    engine.load(directory, optimizer)
    one = OneProcess(gpt(), token_mean)
    reference_optimizer = torch.optim.AdamW(one.parameters(), lr=1e-2)
    load_reference(directory, one, reference_optimizer)
    check_weights(engine, one, "after load")
    x, y = batch(8, seed=seed)
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    close(loss, one.step([(x, y)]), "loss after load")
    step_both(optimizer, reference_optimizer)
    check_weights(engine, one, "one step after load")


def around_the_engine(plain: str, sharded: str) -> None:
    """At tp=2: a tp=1 checkpoint loads and training goes on exactly; clipping equals torch's on one process; eval
    and a traced step (its timeline, its memory as ledger and allocator see it) work; then a checkpoint for tp=1.
    A tie whose holders are sharded on different dims is refused by every rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    every_schedule()
    collectives_in_a_watch()
    apart = {**plan(tied=True), "0.tokens": ColwiseParallel(), "*.out": ColwiseParallel(use_local_output=False)}
    with pytest.raises(
        ValueError,
        match=r"the weight tied as '0.tokens.weight' \(with \['5.out.weight'\]\) was "
        r"parallelized differently on the ranks that hold it: "
        r"\['\(Shard\(dim=0\),\)', '\(Shard\(dim=1\),\)'\]",
    ):
        PipelineEngine(gpt(tied=True), token_sum, num_microbatches=2, tensor_parallel=2, tp_plan=apart)
    engine = PipelineEngine(gpt(), token_sum, num_microbatches=4, tensor_parallel=2, tp_plan=plan(), loss_count=count)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    continue_from(plain, engine, optimizer, seed=51)
    one = OneProcess(gpt(), token_mean)  # one process at the same weights: every stage's state, whole tensors
    everyone = ranks.all_gather_object(engine.state_dict())
    one.seq.load_state_dict({k: v for state in everyone for k, v in state.items()})
    engine.zero_grad()
    x, y = batch(8, seed=52)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    one.step([(x, y)])
    for norm_type, max_norm in ((2.0, 0.05), (float("inf"), 0.01)):
        check_clipped(engine, one, max_norm, "tp=2", norm_type)
    check_eval(engine, one, x, "eval")
    with engine.tracing(optimizer):
        engine.train_step(x if engine.first else None, y if engine.last else None)
    timeline = engine.timeline()
    if ranks.rank() == 0:  # each rank's peak: the ledger's, and the allocator's, within 10% of the simulator's
        assert timeline is not None and timeline.spans and timeline.allocated_peak is not None
        ledger = simulate(engine.last_program, ledger_costs(timeline))  # type: ignore[arg-type]
        full = simulate(engine.last_program, Costs.from_timeline(timeline))  # type: ignore[arg-type]
        for rank in range(len(timeline.peak_memory)):  # the pipeline's ranks (tensor index 0)
            measured, allocated = timeline.peak_memory[rank], timeline.allocated_peak[rank]
            assert abs(ledger.peak_memory[rank] - measured) <= 0.10 * measured, (rank, ledger.peak_memory, measured)
            assert abs(full.peak_memory[rank] - allocated) <= 0.10 * allocated, (rank, full.peak_memory, allocated)
    optimizer.step()
    engine.save(sharded, optimizer)
    traced_row_then_column()
    traced_checkpointed_split_backward()
    gathered = ranks.all_gather_object(engine.state_dict())
    if ranks.rank() == 0:  # what the tp=1 ranks that load it must hold
        torch.save({"engine": {k: v for s in gathered for k, v in s.items()}}, Path(sharded) / "state.pt")


def collectives_in_a_watch() -> None:
    """The allocator's watch on CPU (torch's profiler): a collective launched in it is waited for in it. Gloo runs it
    on its own thread, which reports to the profiler on when it was launched: one still running when the profiler
    stopped corrupted memory (RowwiseParallel's output, in a traced step's first forward: 1 CI run in ~15 crashed).
    Left running, the watch waits for it; settled, it is waited for inside. The ledger reads an unwaited tensor's
    storage without waiting (a traced step waits where an untraced one does)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    ones = torch.ones(64)
    with AllocatorWatch(torch.device("cpu")):
        left = funcol.all_reduce(ones, "sum", dist.group.WORLD)
    assert left.completed and torch.equal(left.elem, torch.full((64,), 4.0)), "waited by the watch: the sum of 4"
    with AllocatorWatch(torch.device("cpu")) as watch:
        settled = funcol.all_reduce(ones * 2, "sum", dist.group.WORLD)
        assert not settled.completed
        storage(settled)  # the ledger's read: no wait
        assert not settled.completed
        settle([settled])
    assert settled.completed and torch.equal(settled.elem, torch.full((64,), 8.0))
    assert watch.peak >= 2 * 64 * 4, "the doubled input and the collective's output, as the allocator saw them"


def traced_checkpointed_split_backward() -> None:
    """zb-h1, checkpointed, a RowwiseParallel layer before a plain Linear in the second stage: the stage's I stops
    its recompute early, keeping the Rowwise output (a running collective) for W. A traced step measures it and
    trains like an untraced one (the watch once refused it, from a new user's probe)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def build() -> PipelineEngine:
        with SEEDED:
            torch.manual_seed(5)
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Linear(8, 4))
        return PipelineEngine(
            model,
            F.mse_loss,
            num_microbatches=2,
            schedule="zb-h1",
            checkpoint="always",
            tensor_parallel=2,
            tp_plan={"1": ColwiseParallel(), "3": RowwiseParallel()},
            partition=[1, 4],
        )

    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(6)), torch.randn(8, 4)
    plain, traced = build(), build()
    expected = plain.train_step(x if plain.first else None, y if plain.last else None)
    with traced.tracing():
        loss = traced.train_step(x if traced.first else None, y if traced.last else None)
    close(loss, expected, "zb-h1 checkpointed, traced: loss")
    grads = dict(plain.named_parameters())
    for name, param in traced.named_parameters():
        close(whole(param.grad), whole(grads[name].grad), f"zb-h1 checkpointed, traced: {name}")  # type: ignore[arg-type]
    assert ranks.rank() != 0 or traced.timeline() is not None


def traced_row_then_column() -> None:
    """A traced step where a ColwiseParallel layer saves for its backward what the RowwiseParallel before it made
    (an async collective's result inside a DTensor): measured like any other, its gradients those of an untraced
    step (the ledger once read that tensor's storage, which cannot be read, and every rank failed)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    with SEEDED:
        torch.manual_seed(3)
        layers = [nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)]
        model = nn.Sequential(*layers, nn.Linear(8, 8), nn.Linear(8, 1))
    styles = {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(), "5": RowwiseParallel()}
    engine = PipelineEngine(model, F.mse_loss, num_microbatches=2, tensor_parallel=2, tp_plan=styles, partition=[6, 2])
    # the report: each stage's world ranks (tp innermost) and a tensor-parallel rank's parameters: stage 0's four
    # Linears hold half their weights and column-split biases (72 each of 144 and 136), stage 1's are whole
    text = str(engine.partition)
    rows = [line.split()[:4] for line in text.splitlines()[1:4]]
    assert rows == [["stage", "ranks", "layers", "params"], ["0", "0-1", "0-5", "288"], ["1", "2-3", "6-7", "81"]], text
    assert f"tensor_parallel=2: params and memory are one tensor-parallel rank's (tp rank {engine.tp_rank}'s)" in text
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(4)), torch.zeros(4, 1)
    untraced = engine.train_step(x if engine.first else None, y if engine.last else None)
    grads = {name: whole(p.grad).clone() for name, p in engine.named_parameters()}  # type: ignore[arg-type]
    engine.zero_grad()
    with engine.tracing():
        traced = engine.train_step(x if engine.first else None, y if engine.last else None)
    close(traced, untraced, "row then column, traced: loss")
    for name, param in engine.named_parameters():
        close(whole(param.grad), grads[name], f"row then column, traced: {name}")  # type: ignore[arg-type]
    assert ranks.rank() != 0 or engine.timeline() is not None


def load_plain(sharded: str) -> None:
    """tp=1, another partition (in-process ranks): the tp=2 checkpoint holds whole tensors under the model's names."""
    engine = PipelineEngine(gpt(), token_sum, num_microbatches=2, loss_count=count, partition=[3, 3])
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    engine.load(sharded, optimizer)
    saved = torch.load(Path(sharded) / "state.pt", weights_only=False)["engine"]
    for name, value in engine.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert all(optimizer.state[p]["exp_avg"].shape == p.shape for p in engine.parameters())


@pytest.mark.timeout(300)
def test_pp2_tp2_trains_like_one_process_and_checkpoints_cross_tensor_parallel_sizes(tmp_path: Path) -> None:
    """Every schedule, checkpointing, ties (on one rank, and across two) on pp=2 x tp=2; a tp=1 checkpoint loads at
    tp=2 and one saved at tp=2 loads at tp=1 on another partition; clipping, eval and a traced step work."""
    from pipeengine import consolidate

    plain, sharded = str(tmp_path / "plain"), str(tmp_path / "sharded")
    launch(save_plain, 2, args=(plain,), timeout=60, in_process=True)
    launch(around_the_engine, 4, args=(plain, sharded), timeout=120)
    launch(load_plain, 2, args=(sharded,), timeout=60, in_process=True)
    state = consolidate(sharded)
    assert list(state) == list(gpt().state_dict()) and state["1.qkv.weight"].shape == (3 * WIDTH, WIDTH)


def refused(case: str) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    if case == "pattern":
        nowhere = {"*.nowhere": ColwiseParallel()}
        PipelineEngine(gpt(), token_sum, num_microbatches=2, tensor_parallel=2, tp_plan=nowhere)
    elif case == "in_process":
        PipelineEngine(gpt(), token_sum, num_microbatches=2, tensor_parallel=2, tp_plan=plan())
    elif case == "grid":
        PipelineEngine(gpt(), token_sum, num_microbatches=2, tensor_parallel=3, tp_plan=plan())
    else:  # stage 0 ends in a column shard: its output is this rank's part of what one process computes
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4))
        engine = PipelineEngine(
            model,
            nn.functional.mse_loss,
            num_microbatches=2,
            tensor_parallel=2,
            tp_plan={"1": ColwiseParallel()},
            partition=[2, 2],
        )
        x, y = torch.randn(4, 16), torch.randn(4, 4)
        engine.train_step(x if engine.first else None, y if engine.last else None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case, error",
    [
        ("pattern", r"tp_plan pattern '\*\.nowhere' matches no module of the model; its modules are named 0, 0\."),
        ("in_process", r"tensor_parallel=2 runs DTensor collectives, which need torch.distributed: in-process ranks"),
        ("grid", r"a world of 4 ranks does not split into data_parallel=1 equal pipelines of tensor_parallel=3"),
    ],
)
def test_what_tensor_parallelism_cannot_do_is_refused_naming_it(case: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        launch(refused, 4, args=(case,), timeout=30, in_process=True)


def flat_model_and_plan() -> tuple[nn.Sequential, dict[str, object]]:
    """Six layers, tensor-parallel pair by pair: the outputs of layers 0, 1, 3 and 4 are shards; the last layer
    holds the most parameters, so a partition by parameters alone cuts after layer 3 or 4."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    with SEEDED:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 64)
        )
    return model, {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(), "5": RowwiseParallel()}


def test_the_engines_own_partition_reads_which_layers_end_in_a_shard() -> None:
    """Read from the plan's styles (resolved names): column-wise to row-wise is sharded between, a layer with no
    style keeps what came in; a block whose last style is row-wise ends whole."""
    from pipeengine.construction.partition import solve
    from pipeengine.parallel.tensor import plan_matches, shards_output

    model, tp_plan = flat_model_and_plan()
    flags = shards_output(model, plan_matches(model, tp_plan))
    assert flags == [True, True, False, True, True, False]
    assert solve([1.0] * 6, 2, flags[:-1]) == [(0, 3), (3, 6)] and solve([1.0] * 6, 2) == [(0, 3), (3, 6)]
    assert solve([3.0, 1, 1, 1, 1, 1], 2, flags[:-1]) == [(0, 3), (3, 6)]  # unconstrained: [(0, 2), (2, 6)]
    assert shards_output(gpt(), plan_matches(gpt(), plan())) == [False] * len(gpt())  # each block ends row-wise
    # what a style says it leaves decides: a row-wise layer told to leave a sequence shard (sequence parallelism),
    # then a module told to leave its output whole
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, RowwiseParallel

    said = {
        "0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "2": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
    }
    assert shards_output(model, said) == [True, True, False, False, False, False]
    with pytest.raises(ValueError, match="3 stages, but the model can be cut into 2 at most"):
        solve([1.0] * 6, 3, flags[:-1])


@pytest.mark.timeout(120)
@on_ranks(4, timeout=90)
def test_the_engines_own_partition_never_ends_a_stage_on_a_shard() -> None:
    """The engine's own partition (no sample: by parameters) never ends a stage on a shard, and trains as one
    process does."""
    model, tp_plan = flat_model_and_plan()
    one = OneProcess(model, nn.functional.mse_loss)
    engine = PipelineEngine(model, nn.functional.mse_loss, num_microbatches=2, tensor_parallel=2, tp_plan=tp_plan)
    assert engine.bounds == [(0, 3), (3, 6)], engine.bounds  # by parameters alone: a cut after 3 or 4, a shard sent
    optimizers = (torch.optim.SGD(engine.parameters(), lr=0.1), torch.optim.SGD(one.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 16, generator=generator), torch.randn(4, 64, generator=generator)) for _ in range(2)]
    assert (
        train_like_one_process(
            engine, one, optimizers, 2, "the default partition around shards", lambda step: [data[step]]
        )
        > 0
    )


@pytest.mark.timeout(120)
def test_a_stage_that_ends_in_a_shard_is_refused_before_it_is_sent() -> None:
    with pytest.raises(
        Exception,
        match=r"stage 0 produced float32\[2, 8\].*expects float32\[2, 16\].*looks like "
        r"this rank's shard of the output",
    ):
        launch(refused, 4, args=("shard",), timeout=60)


def test_a_plan_without_tensor_parallelism_is_refused() -> None:
    from pipeengine import EngineConfig

    EngineConfig(schedule="auto", tensor_parallel=2, tp_plan=plan())  # the planner prices it (test_layout_planner)
    with pytest.raises(ValueError, match="tensor_parallel=1: nothing reads it"):
        EngineConfig(num_microbatches=2, tp_plan=plan())


def test_a_module_two_patterns_match_takes_the_later_patterns_style() -> None:
    from pipeengine.parallel.tensor import plan_matches

    generic, special = object(), object()
    resolved = plan_matches(gpt(), {"*.mlp.*": generic, "1.mlp.0": special})
    assert resolved["1.mlp.0"] is special and resolved["2.mlp.0"] is generic and resolved["1.mlp.2"] is generic
    resolved = plan_matches(gpt(), {"1.mlp.0": special, "*.mlp.*": generic})  # the other order: the generic wins
    assert resolved["1.mlp.0"] is generic
