"""What a new user ran into: refusals that stop silent wrong training, and errors that say what to do.

A test that runs on ranks runs its own body there (``on_ranks``: in-process ranks, or gloo processes
that import this module); the tests that call ``launch`` themselves test what the launch does.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeengine import EngineConfig, PipelineEngine, launch
from schedules import build_schedule
from tests.pipeengine import ranks
from tests.pipeengine.gpt import IGNORE, count_tokens, padded_batch, tied_gpt
from tests.pipeengine.models import batch, mlp, mse
from tests.pipeengine.ranks import on_ranks

ROOT = Path(__file__).parent.parent.parent


def refused_on_this_rank(build: object, pattern: str, error: type[BaseException] = ValueError) -> str:
    """Run ``build()``; it must raise ``error`` matching ``pattern`` here. Every rank calls it: none may hang."""
    with pytest.raises(error, match=pattern) as caught:
        build()  # type: ignore[operator]
    ranks.barrier()
    return str(caught.value)


# ---- 1. a mean-returning loss_fn with loss_count


def token_mean(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)  # a mean: wrong here


@pytest.mark.timeout(60)
@on_ranks(2, timeout=30, in_process=True)
def test_a_mean_loss_with_loss_count_is_refused_on_every_rank() -> None:
    engine = PipelineEngine(tied_gpt(), token_mean, num_microbatches=2, loss_count=count_tokens)
    x, y = padded_batch(4, seed=0, microbatches=2)  # the first micro-batch nearly all padding

    def step() -> None:
        engine.train_step(x if engine.first else None, y if engine.last else None)

    message = refused_on_this_rank(step, r"loss_fn must return the SUM .* a mean .*reduction='sum'")
    assert ranks.rank() == 1 or "rank 1 refused" in message  # the others repeat the last stage's error


# ---- 2. ranks that build different models


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["layers", "types", "weights"])
@on_ranks(2, timeout=30, in_process=True)
def test_ranks_that_built_different_models_are_refused_naming_the_ranks_and_the_layer(case: str) -> None:
    rank = ranks.rank()
    if case == "layers":  # rank 0 builds 4 layers, rank 1 five
        model = mlp(layers=2)[: 4 + rank]
        pattern = r"the ranks built different models \(their layer counts: \{0: 4, 1: 5\}\); the first layer that "
        pattern += r"differs is layer 4:\n  ranks \[0\]: no layer 4\n  ranks \[1\]: '4' = Linear"
    elif case == "types":
        model = mlp(layers=2)
        if rank == 1:
            model[1] = nn.ReLU()
        pattern = r"first layer that differs is layer 1:\n  ranks \[0\]: '1' = Tanh\(\).*\n  ranks \[1\]: '1' = ReLU"
    else:  # a seed forgotten on one rank
        model = mlp(seed=rank)
        pattern = r"layer 0:\n  ranks \[0\]: .*\n  ranks \[1\]: .*\nthe same layers with different weights: seed"
    refused_on_this_rank(lambda: PipelineEngine(model, mse, num_microbatches=2), pattern)


@pytest.mark.timeout(60)
@on_ranks(2, timeout=30)
def test_on_gloo_processes_a_rank_that_forgot_the_seed_is_refused_on_every_rank() -> None:
    if ranks.rank() == 0:
        torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    refused_on_this_rank(lambda: PipelineEngine(model, mse, num_microbatches=2), "different weights: seed every")


# ---- 2b. ranks given different options (issue 57, item 7)

ONE_RANK_DIFFERS = [  # (the option, rank 0's keywords, rank 1's, how each rank's value is shown)
    ("num_microbatches", {"num_microbatches": 2}, {"num_microbatches": 4}, ("2", "4")),
    ("schedule", {"schedule": "1f1b"}, {"schedule": "gpipe"}, ("'1f1b'", "'gpipe'")),
    ("schedule", {"schedule": "1f1b"}, {"schedule": "interleaved"}, ("'1f1b'", "'interleaved'")),
    ("schedule", {"schedule": "gpipe"}, {"schedule": "zb-v"}, ("'gpipe'", "'zb-v'")),
    ("chunks", {"schedule": "interleaved", "chunks": 2}, {"schedule": "interleaved", "chunks": 3}, ("2", "3")),
    ("loss_count", {}, {"loss_count": len}, ("None", "len")),
    ("precision", {}, {"precision": "bf16"}, ("'fp32'", "'bf16'")),
    ("checkpoint", {"checkpoint": "always"}, {}, ("'always'", "'never'")),
    ("data_parallel", {"data_parallel": 2}, {}, ("2", "1")),
    ("trace", {}, {"trace": True}, ("False", "True")),
]


@pytest.mark.timeout(60)
@on_ranks(2, timeout=20, in_process=True)
def test_ranks_given_different_options_are_refused_naming_the_option_and_each_ranks_value() -> None:
    """Each pair of options is refused at construction on both ranks, naming the option and each rank's value."""
    rank = ranks.rank()
    for option, mine, theirs, (value0, value1) in ONE_RANK_DIFFERS:
        options = {"num_microbatches": 4, **(mine if rank == 0 else theirs)}
        pattern = rf"{option} differs across ranks: rank 0: {re.escape(value0)}, rank 1: {re.escape(value1)}; "
        pattern += "every rank must pass the same engine options"
        refused_on_this_rank(lambda o=options: PipelineEngine(mlp(), mse, **o), pattern)


@pytest.mark.timeout(60)
@on_ranks(2, timeout=20, in_process=True)  # a refusal that hung or failed a step fails at the timeout
def test_options_that_mean_the_same_on_each_rank_are_not_refused_and_the_engine_trains() -> None:
    """precision None on one rank and 'fp32' on the other: the same option, so the engine builds and trains."""
    engine = PipelineEngine(mlp(), mse, num_microbatches=2, precision=[None, "fp32"][ranks.rank()])
    x, y = batch("mlp", 4, seed=0)
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    losses = ranks.all_gather_object(loss)  # every rank returns the step's loss
    assert losses[0] == losses[1] and 0 < losses[0] < float("inf"), losses


@pytest.mark.timeout(60)
@on_ranks(2, timeout=20)  # was built; its first step aborted a rank in gloo (SIGABRT)
def test_on_gloo_processes_different_microbatches_are_refused_not_aborted() -> None:
    options = {"num_microbatches": 2 * (1 + ranks.rank())}
    refused_on_this_rank(lambda: PipelineEngine(mlp(), mse, **options), r"num_microbatches differs across ranks")


# ---- 3. the in-process launch and the global random generator


BLOCKS = 60


def seeded_like_the_readme(path: str) -> None:
    torch.manual_seed(0)  # the README's pattern: seed, then build the model inside main
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(BLOCKS)])
    engine = PipelineEngine(model, mse, num_microbatches=4)
    torch.save(engine.state_dict(), f"{path}.{ranks.rank()}")


@pytest.mark.timeout(60)
def test_in_process_ranks_that_seed_then_build_get_the_seeded_model(tmp_path: Path) -> None:
    launch(seeded_like_the_readme, 4, args=(str(tmp_path / "state"),), timeout=30, in_process=True)
    torch.manual_seed(0)
    expected = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(BLOCKS)]).state_dict()
    held: dict[str, torch.Tensor] = {}
    for rank in range(4):
        held.update(torch.load(tmp_path / f"state.{rank}", weights_only=True))
    assert sorted(held) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(held[name], value), name


# ---- 7. Ctrl-C on an in-process launch

INTERRUPTED = """
import faulthandler, signal, sys, threading, time
import torch
from torch import nn
from pipeengine import PipelineEngine, launch

def main():
    torch.manual_seed(0)
    engine = PipelineEngine(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), nn.functional.mse_loss,
                            num_microbatches=4)
    x = torch.randn(16, 64)
    for step in range(10**9):
        engine.train_step(x, x)
        if step == 1:
            print("training", flush=True)

if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for every thread's stack if it hangs
    try:
        launch(main, 2, in_process=True)
    except KeyboardInterrupt:
        if sys.argv[1] == "raise":
            raise
        time.sleep(0.5)
        print("rank threads left:", [t.name for t in threading.enumerate() if t.name.startswith("pipeengine-rank")])
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("caller", ["raise", "catch"])
def test_ctrl_c_on_an_in_process_launch_stops_every_rank(caller: str, tmp_path: Path) -> None:
    import signal

    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    # Ctrl-C as at a terminal: SIGINT at its default in the child (Python installs KeyboardInterrupt only then), even
    # where this test runs with it ignored (a shell's background job, `pytest ... &`, ignores SIGINT; its children
    # inherit that, and a Ctrl-C never arrives)
    child = subprocess.Popen(
        [sys.executable, str(script), caller],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "training\n"
        child.send_signal(signal.SIGINT)
        try:
            out, err = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # still running: fail with where each of its threads is
            child.send_signal(signal.SIGUSR1)
            time.sleep(2)  # faulthandler writes the stacks
            child.kill()
            out, err = child.communicate(timeout=10)
            pytest.fail(f"60 s after Ctrl-C the program still ran; its threads were at:\n{err[-6000:]}")
    finally:
        child.kill()
    if caller == "raise":  # the KeyboardInterrupt reaches the caller, the ranks stopped first (see the note below)
        assert "KeyboardInterrupt" in err and child.returncode in (-signal.SIGINT, -signal.SIGABRT), err[-2000:]
    else:  # caught: every rank thread is gone, and the program goes on to end cleanly
        assert "terminate called" not in err and child.returncode == 0, (child.returncode, err[-2000:])
        assert "rank threads left: []" in out, out
    # Not held: an uncaught KeyboardInterrupt's exit can still end in SIGABRT ("terminate called without an active
    # exception") from a native thread at interpreter teardown, after every rank thread has ended: none in many quiet
    # runs, about 1 in 3 beside two CPU-bound processes. Not found yet.


# ---- 8. a failing loss_count


def failing_count(how: str) -> None:
    def count(target: torch.Tensor) -> object:
        if how == "raise":
            raise KeyError("the user's own failure in loss_count")
        return "abc"

    engine = PipelineEngine(
        mlp(), lambda out, y: F.mse_loss(out, y, reduction="sum"), num_microbatches=2, loss_count=count
    )
    x, y = batch("mlp", 4, seed=0)
    engine.train_step(x if engine.first else None, y if engine.last else None)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("in_process", [True, False])
def test_a_failing_loss_count_is_blamed_on_the_last_stage_with_the_users_line(in_process: bool) -> None:
    with pytest.raises(KeyError, match="the user's own failure in loss_count") as caught:
        launch(failing_count, 2, args=("raise",), timeout=30, in_process=in_process)
    notes = "\n".join(caught.value.__notes__)
    assert "rank 1 of 2 is the cause" in notes, notes
    assert 'raise KeyError("the user\'s own failure in loss_count")' in notes  # the user's line, from rank 1
    assert re.search(r"rank 0: Refused: rank 1 refused: KeyError", notes), notes


@pytest.mark.timeout(60)
def test_a_loss_count_that_returns_no_number_says_so() -> None:
    with pytest.raises(TypeError, match=r"loss_count\(target\) must return the number of units .* returned str 'abc'"):
        launch(failing_count, 2, args=("string",), timeout=30, in_process=True)


# ---- 9. schedule files and arguments nothing reads


@pytest.mark.timeout(60)
@on_ranks(2, timeout=30, in_process=True)
def test_a_schedule_that_says_no_gradient_where_one_is_needed_is_refused() -> None:
    schedule = build_schedule("1f1b", 2, 2).without_gradient({0})  # a file's 'no-gradient 0', compute only
    engine = PipelineEngine(mlp(), mse, num_microbatches=2, schedule=schedule)
    x, y = batch("mlp", 4, seed=0)
    refused_on_this_rank(
        lambda: engine.train_step(x if engine.first else None, y if engine.last else None),
        r"the schedule says boundary 0 \(between stages 0 and 1\) carries no gradient .* stages up "
        r"to 0 would never get a gradient",
    )


def test_options_nothing_would_read_are_refused() -> None:
    with pytest.raises(ValueError, match=r"chunks=2, but the schedule given runs 1 chunk\(s\) per rank"):
        EngineConfig(num_microbatches=2, schedule=build_schedule("1f1b", 2, 2), chunks=2)
    assert EngineConfig(num_microbatches=2, schedule=build_schedule("1f1b", 2, 2), chunks=1).chunks == 1
    with pytest.raises(
        ValueError,
        match=r"memory_limit= is the bound schedule='auto' plans under; with "
        r"schedule='1f1b' nothing reads it",
    ):
        EngineConfig(num_microbatches=2, schedule="1f1b", memory_limit=2**30)


# ---- 4, 5, 6. the planner


def test_the_planner_names_why_there_is_no_candidate() -> None:
    from pipeengine.tune import tune

    x = torch.randn(8, 16)
    with pytest.raises(
        ValueError,
        match=r"no layout of 16 ranks .* dp1 x pp16 x tp1: 16 pipeline stages need at least "
        r"16 layers, one per stage; the model has 11: use at most 11 pipeline ranks",
    ):
        tune(mlp(), mse, x, 16, data_parallel=1)
    with pytest.raises(ValueError, match=r"dp1 x pp2 x tp1: 2 pipeline stages need at least 2 layers.* model has 1"):
        tune(nn.Sequential(nn.Linear(16, 4)), mse, x, 2, data_parallel=1)
    for bad in ({"world_size": -2}, {"world_size": 0}, {"data_parallel": 0}, {"microbatches": [0]}):
        arguments = {"world_size": 2, **bad}
        with pytest.raises(ValueError, match=r"must be a positive int, got"):
            tune(mlp(), mse, x, **arguments)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tune plans an nn.Sequential .* got Linear"):
        tune(nn.Linear(16, 4), mse, x, 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"sample must be a batch: a tensor or a tuple of tensors \(not a list\)"):
        tune(mlp(), mse, [x], 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no candidate: .*interleaved: "):
        tune(mlp(), mse, torch.randn(3, 16), 2, schedules=["interleaved"], microbatches=[3], repeats=1)


def test_the_planners_choice_rebuilds_what_it_priced_with_data_parallelism() -> None:
    from pipeengine.tune import tune

    best = tune(mlp(), mse, torch.randn(16, 16), 4, data_parallel=2, schedules=["1f1b"], repeats=1).best
    kwargs = best.engine_kwargs()
    assert kwargs["data_parallel"] == 2 and len(kwargs["partition"]) == 2  # type: ignore[arg-type]

    def build() -> None:
        engine = PipelineEngine(mlp(), mse, **kwargs)  # type: ignore[arg-type]
        assert engine.data_parallel == 2 and engine.schedule.num_ranks == 2
        x, y = batch("mlp", 16, seed=0)
        engine.train_step(x if engine.first else None, y if engine.last else None)

    launch(build, 4, timeout=30, in_process=True)


def tied_embedding() -> nn.Sequential:
    """A tied embedding and head (20000 x 64, 5 MiB) around two small blocks: 4 layers."""
    torch.manual_seed(0)
    embed, head = nn.Embedding(2000, 64), nn.Linear(64, 2000, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, nn.Linear(64, 64), nn.Linear(64, 64), head)


def test_a_weight_tied_across_stages_of_one_rank_counts_once_in_the_planner() -> None:
    from pipeengine.planner.measure import profile_layers

    tokens = torch.randint(0, 2000, (8, 4))
    profile = profile_layers(tied_embedding(), tokens, 2, repeats=1, device=torch.device("cpu"))
    schedule = build_schedule("zb-v", 2, 4)  # stages 0 and 3 (the embedding, the head) both on rank 0
    bounds = [(0, 1), (1, 2), (2, 3), (3, 4)]
    state = profile.stage_costs(bounds, placement=schedule.placement).memory.state  # type: ignore[union-attr]
    tied_bytes, block = 2000 * 64 * 4, (64 * 64 + 64) * 4
    assert list(state) == [4 * tied_bytes, 4 * block, 4 * block, 0.0]  # weight, gradient, AdamW's two
    apart = profile.stage_costs(bounds, placement=(0, 0, 1, 1)).memory.state  # type: ignore[union-attr]
    assert list(apart) == [4 * tied_bytes, 4 * block, 4 * block, 4 * tied_bytes]  # on two ranks: a copy each
    from pipeengine.tune import tune

    planned = tune(tied_embedding(), None, tokens, 2, schedules=["zb-v"], microbatches=[4], repeats=1, allocator=False)
    # the tie held once, by rank 0: its weight, gradient and AdamW's two, and activations (twice would be 8 x)
    assert all(max(c.peak_memory) < 5 * tied_bytes for c in planned.rows if not c.fsdp), planned
    # dp2 with FSDP would put both ends of the tie, stages 0 and 1 of zb-v, on one rank: FSDP cannot shard a weight
    # two of a rank's stages share, so the planner offers no such row (the engine would refuse it) and says why
    assert not any(c.fsdp for c in planned.rows), planned
    assert any("both on pipeline rank 0" in why for why in planned.refused.values()), planned.refused


def test_the_planners_command_line_says_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeengine.tune import main

    problem = "tests.pipeengine.models:planning"
    # one micro-batch count: each planned run measures the layers at it alone (the default, every count dividing the
    # batch, is test_the_cli_plans_a_model_given_as_module_function's)
    one = ["--microbatches", "2"]
    assert main([problem, "--world-size", "2", "--schedules", "1f1b", "--memory-limit", "64MiB", *one]) == 0
    out = capsys.readouterr().out
    assert "best: PipelineEngine(model, loss_fn, **{'schedule': '1f1b'" in out
    assert out.startswith("memory limit 67,108,864 bytes (64.00 MiB) per rank\n") and "peak MiB/rank" in out
    for argv, said in [
        ([problem, "--world-size", "2", "--memory-limit", "-5MB"], "a memory limit must be positive, got '-5MB'"),
        ([problem, "--world-size", "2", "--memory-limit", "lots"], "'lots' is not a size"),
        (["tests.pipeengine.nowhere:planning", "--world-size", "2"], "cannot import module"),
        (["tests.pipeengine.models:nothing", "--world-size", "2"], "has no function 'nothing'"),
        (["tests.pipeengine.models:mlp", "--world-size", "2"], "must return (model, loss_fn, sample) or"),
    ]:
        with pytest.raises(SystemExit):
            main(argv)
        assert said in capsys.readouterr().err, argv
    assert main([problem, "--world-size", "0"]) == 2
    assert "world_size must be a positive int, got 0" in capsys.readouterr().err
    assert main([problem, "--world-size", "4", "--data-parallel", "2", "--schedules", "1f1b", *one]) == 0
    assert "'data_parallel': 2}" in capsys.readouterr().out  # the printed engine rebuilds what was priced
    assert main([problem, "--world-size", "4", "--data-parallel", "2", "--fsdp", "--schedules", "1f1b", *one]) == 0
    assert "'data_parallel': 2, 'fsdp': True}" in capsys.readouterr().out
    assert main([problem, "--world-size", "4", "--data-parallel", "1", "--fsdp"]) == 2
    assert "fsdp=True shards the state over the data-parallel replicas, but data_parallel=1" in capsys.readouterr().err


def test_small_sizes_print_in_units_that_show_them() -> None:
    from pipeengine.planner.result import _mb

    assert [_mb(x) for x in (100, 3 * 2**10, 20.1 * 2**20, 3 * 2**30)] == ["100 B", "3.0 KiB", "20.1 MiB", "3.00 GiB"]


def test_sizes_are_read_as_their_units_say_binary_or_si(capsys: pytest.CaptureFixture[str]) -> None:
    from argparse import ArgumentTypeError

    from pipeengine.planner.cli import SIZE_UNITS, main, parse_bytes

    sizes = {
        "64MiB": 64 * 2**20,
        "64mib": 64 * 2**20,
        "64M": 64 * 2**20,
        "64 MB": 64e6,
        "1.5KiB": 1536,
        "3KB": 3000,
        "2GiB": 2 * 2**30,
        "2GB": 2e9,
        "1T": 2**40,
        "1TiB": 2**40,
        "1TB": 1e12,
        "512B": 512,
        "512": 512,
        "1.5e9": 1.5e9,
    }
    assert {text: parse_bytes(text) for text in sizes} == sizes
    rule = "KiB, MiB, GiB and TiB (or K, M, G and T) are powers of 1024, KB, MB, GB and TB powers of 1000"
    for text in ("64MiBs", "64Mi", "64 iB", "lots"):
        with pytest.raises(ArgumentTypeError, match=re.escape(f"{text!r} is not a size") + ".*" + re.escape(rule)):
            parse_bytes(text)
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert f"--memory-limit MEMORY_LIMIT bytes per rank, with an optional unit, e.g. 512MiB ({SIZE_UNITS})" in shown
