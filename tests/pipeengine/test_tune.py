"""The planner: every candidate priced and ranked, memory limits kept, its choice built and trained exactly."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine, launch
from pipeengine.planner.measure import profile_layers
from pipeengine.tune import Candidate, progress_printer, tune
from schedules import SCHEDULES, Costs, registration, simulate
from tests.pipeengine import ranks
from tests.pipeengine.memory import activation_heavy, step_then_trace, weight_heavy
from tests.pipeengine.models import batch, mlp, mse
from tests.pipeengine.parity import OneProcess, check_grads, close
from tests.pipeengine.ranks import on_ranks

ROOT = Path(__file__).parent.parent.parent


@pytest.fixture(scope="module")
def result():  # type: ignore[no-untyped-def]
    return tune(mlp(), mse, batch("mlp", 16, seed=0)[0], 2, data_parallel=1, checkpoint=["never"], repeats=1)


def test_every_candidate_is_a_valid_way_to_pipeline_the_model_ranked_fastest_first(result) -> None:  # type: ignore[no-untyped-def]
    rows = result.rows
    assert rows and [c.step_time for c in rows] == sorted(c.step_time for c in rows)
    assert {c.schedule for c in rows} == set(SCHEDULES)
    for c in rows:
        assert sum(c.partition) == 11 and len(c.partition) == 2 * c.chunks and all(n > 0 for n in c.partition)
        assert 16 % c.num_microbatches == 0 and len(c.peak_memory) == 2 and 0 <= c.bubble < 1
        record = registration(c.schedule)
        assert record.chunks is None or c.chunks in record.chunks
    assert len({(c.schedule, c.num_microbatches, c.chunks, c.partition) for c in rows}) == len(rows)  # no twins
    text = str(result)
    assert "candidates (priced in" in text and "step ms" in text and "no candidate was dropped" in text


def test_a_memory_limit_drops_what_passes_it_and_says_what_it_cost(result) -> None:  # type: ignore[no-untyped-def]
    peaks = sorted(max(c.peak_memory) for c in result.rows)
    limit = peaks[len(peaks) // 2]
    limited = tune(mlp(), mse, batch("mlp", 16, seed=0)[0], 2, memory_limit=limit, repeats=1)
    assert limited.rows and all(max(c.peak_memory) <= limit for c in limited.rows)
    assert limited.dropped and all(max(c.peak_memory) > limit for c in limited.dropped)
    count = len(limited.dropped)
    assert f"dropped {count} candidate{'s' if count != 1 else ''}" in limited.binding()
    # nothing fits 1 byte at any setting: one micro-batch count is measured (every count: the limited search's)
    nothing = tune(mlp(), mse, batch("mlp", 16, seed=0)[0], 2, memory_limit=1, repeats=1, microbatches=[2])
    least = r"no candidate fits memory_limit=1 B per rank: the least memory any needs is [0-9.]+ KiB"
    with pytest.raises(ValueError, match=least):
        _ = nothing.best


def test_an_unknown_schedule_or_a_micro_batch_count_that_fits_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'; valid names"):
        tune(mlp(), mse, torch.randn(16, 16), 2, schedules=["zigzag"])
    with pytest.raises(ValueError, match=r"no micro-batch count in \[3, 5\] divides a replica's batch \(\[8, 16\] "):
        tune(mlp(), mse, torch.randn(16, 16), 2, microbatches=[3, 5])


@pytest.mark.timeout(120)
@on_ranks(2, timeout=60, in_process=True)
def test_the_best_candidate_builds_an_engine_that_trains_like_one_process(result) -> None:  # type: ignore[no-untyped-def]
    """The planner's choice, built from its engine_kwargs, trains like one process."""
    choice: Candidate = result.best
    model = mlp()
    one = OneProcess(model, mse)
    engine = PipelineEngine(model, mse, **choice.engine_kwargs())  # type: ignore[arg-type]
    x, y = batch("mlp", 16, seed=1)
    close(engine.train_step(x if engine.first else None, y if engine.last else None), one.step([(x, y)]), "loss")
    check_grads(engine, one, f"the planner's choice {choice.engine_kwargs()}")


@pytest.mark.timeout(120)
@on_ranks(2, timeout=60, in_process=True)
def test_schedule_auto_tunes_on_the_first_rank_and_every_rank_builds_its_choice() -> None:
    model = mlp()
    one = OneProcess(model, mse)
    x, y = batch("mlp", 16, seed=1)
    engine = PipelineEngine(
        model, mse, schedule="auto", sample=x if ranks.rank() == 0 else None, memory_limit=2**30
    )  # the limit was refused once the choice replaced "auto"
    everyone = ranks.all_gather_object((engine.tuned, engine.num_microbatches, engine.partition.bounds))
    assert all(view == everyone[0] for view in everyone), everyone  # every rank built the same choice
    close(engine.train_step(x if engine.first else None, y if engine.last else None), one.step([(x, y)]), "loss")
    check_grads(engine, one, "schedule='auto'")
    assert engine.tuned.schedule in SCHEDULES and 16 % engine.num_microbatches == 0  # type: ignore[union-attr]


def without_sample() -> None:
    PipelineEngine(mlp(), mse, schedule="auto")


@pytest.mark.timeout(60)
def test_schedule_auto_without_a_sample_says_so_on_every_rank() -> None:
    with pytest.raises(ValueError, match=r"schedule='auto' could not tune on rank 0: .*needs sample="):
        launch(without_sample, 2, timeout=30, in_process=True)


def traced_step(kwargs: dict[str, object], path: str, weights: bool = False) -> None:
    """Rank 0 saves a traced AdamW step's measured peaks, the simulator's peaks fed its sizes, and those sizes
    (``weights``: of weight_heavy, else of activation_heavy)."""
    model = weight_heavy() if weights else activation_heavy()
    engine = PipelineEngine(model, nn.functional.mse_loss, **kwargs)  # type: ignore[arg-type]
    x, y = data(weights)
    optimizer = torch.optim.AdamW(engine.parameters())
    step_then_trace(engine, x, y, optimizer)
    from pipeengine.observe.allocator import AllocatorWatch, optimizer_step_peak

    shared = ranks.world().shared_clock  # in-process ranks share one process: the allocator cannot tell them apart
    stepped = (
        None
        if not AllocatorWatch.available(torch.device("cpu"), shared)
        else (optimizer_step_peak(optimizer, engine.parameters()))
    )
    stepped_everywhere = ranks.all_gather_object(stepped)
    timeline = engine.timeline()
    if timeline is not None:
        costs = Costs.from_timeline(timeline)
        Path(path).write_bytes(
            pickle.dumps(
                (
                    timeline.peak_memory,
                    simulate(engine.last_program, costs).peak_memory,
                    costs.memory,
                    timeline.allocated_peak,
                    stepped_everywhere,
                )
            )
        )


@pytest.mark.parametrize("reuse", [True, False])
def test_the_layers_are_timed_as_launchs_ranks_run_keeping_freed_memory(
    reuse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    monkeypatch.setattr("pipeengine.planner.search.keep_freed_memory", lambda: calls.append(True) or True)
    x = torch.randn(8, 16)
    tune(mlp(), None, x, 2, schedules=["1f1b"], microbatches=[2], repeats=1, reuse_memory=reuse)
    assert calls == ([True] if reuse else [])


@pytest.mark.timeout(120)
@on_ranks(2, timeout=60, in_process=True)
def test_each_layers_bytes_compose_into_what_the_engine_measures_per_stage(tmp_path: Path) -> None:
    """Bytes, not times: exact. A split backward's I lets go of what only nodes above W's restart points saved
    (each layer's Tanh output at the top of a stage, the loss's input), so after I a stage holds less than before."""
    x, y = torch.randn(2048, 16, generator=torch.Generator().manual_seed(0)), torch.randn(2048, 16)
    partition = [1, 2, 3, 2]
    traced_step({"schedule": "zb-v", "num_microbatches": 8, "partition": partition}, str(tmp_path / "sizes.pickle"))
    if ranks.rank() != 0:  # rank 0 saved the step's sizes
        return
    _, _, measured, *_ = pickle.loads((tmp_path / "sizes.pickle").read_bytes())
    profile = profile_layers(
        activation_heavy(), x, 256, repeats=1, device=torch.device("cpu"), loss=nn.functional.mse_loss, target=y
    )
    cuts = [0, 1, 3, 6, 8]
    composed = profile.stage_costs(list(zip(cuts, cuts[1:], strict=False)), buffered_sends=True).memory
    assert composed is not None
    for field in ("state", "activation", "after_input", "boundary", "gradient", "output_after_input"):
        assert list(getattr(composed, field)) == list(getattr(measured, field)), field
    for stage, (a, b) in enumerate(zip(cuts[1:-1], cuts[2:], strict=True), start=1):  # what I let go shows
        assert composed.after_input[stage] < composed.activation[stage] + sum(profile.kept[a:b])


@pytest.fixture
def choices() -> list[Candidate]:
    """The planner's candidates for activation_heavy on 2 ranks, chosen by their partitions, not their predicted
    times (which a loaded machine reorders): per schedule, the first cut by a method other than time."""
    x, y = data(False)
    planned = tune(activation_heavy(), nn.functional.mse_loss, x, 2, target=y, microbatches=[8], repeats=1)
    choices = []
    for schedule in ("1f1b", "zb-v"):
        mine = [c for c in planned.rows if c.schedule == schedule and set(c.methods) - {"time"}]
        choices.append(min(mine, key=lambda c: (c.chunks, c.partition)))
    return choices


@pytest.mark.timeout(180)
@on_ranks(2, timeout=60)
def test_the_planners_peaks_hold_against_the_allocator(choices: list[Candidate], tmp_path: Path) -> None:
    """Composed from each layer's bytes and what the allocator saw of its computes, the planner's figure per rank
    (the step's peak, or the optimizer step's after it) is within 10% of the allocator's on gloo processes (the
    candidates: the fixture's)."""
    paths = [str(tmp_path / f"peaks{index}.pickle") for index in range(len(choices))]
    traced_steps([c.engine_kwargs() for c in choices], paths)  # one process group
    if ranks.rank() != 0:  # rank 0 saved each step's peaks
        return
    for choice, path in zip(choices, paths, strict=True):
        *_, allocated, stepped = pickle.loads(Path(path).read_bytes())
        required = [max(a, b) for a, b in zip(allocated, stepped, strict=True)]
        for rank, (m, p) in enumerate(zip(required, choice.peak_memory, strict=True)):
            assert abs(p - m) <= 0.10 * m, (choice.engine_kwargs(), rank, p, m)


def traced_steps(every: list[dict[str, object]], paths: list[str], weights: bool = False) -> None:
    for kwargs, path in zip(every, paths, strict=True):
        traced_step(kwargs, path, weights)


def data(weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's batch and targets for weight_heavy (32 rows of 128) or activation_heavy (2048 of 16)."""
    rows, width = (32, 128) if weights else (2048, 16)
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, width, generator=generator), torch.randn(rows, width, generator=generator)


@pytest.mark.timeout(180)
def test_a_checkpointed_weight_pass_adds_each_gradient_as_b_does_and_the_planner_counts_it(tmp_path: Path) -> None:
    """A checkpointed stage's W (a split backward's) is one autograd call from its outputs, which adds each gradient
    to .grad as it is made, as B does (it once returned them all first, every gradient of the stage alive at once).
    On weight_heavy (4 layers a stage) the planner's figure per rank is within 3% of the allocator's."""
    x, y = data(True)
    for checkpoint in ("always", "never"):
        planned = tune(
            weight_heavy(),
            nn.functional.mse_loss,
            x,
            2,
            target=y,
            data_parallel=1,
            schedules=["zb-h1"],
            microbatches=[4],
            checkpoint=[checkpoint],
            methods=["uniform"],
            repeats=1,
        )
        (choice,) = planned.rows
        path = tmp_path / f"{checkpoint}.pickle"
        launch(traced_steps, 2, args=([choice.engine_kwargs()], [str(path)], True), timeout=60)
        *_, allocated, stepped = pickle.loads(path.read_bytes())
        required = [max(a, b) for a, b in zip(allocated, stepped, strict=True)]
        for rank, (m, p) in enumerate(zip(required, choice.peak_memory, strict=True)):
            assert abs(p - m) <= 0.03 * m, (checkpoint, rank, p, m)


@pytest.fixture
def dualpipe_v_choice() -> Candidate:
    """The planner's one candidate for weight_heavy on 4 ranks under DualPipeV, every stage checkpointed."""
    x, y = data(True)
    planned = tune(
        weight_heavy(),
        nn.functional.mse_loss,
        x,
        4,
        target=y,
        data_parallel=1,
        schedules=["dualpipe-v"],
        microbatches=[8],
        checkpoint=["always"],
        methods=["uniform"],
        repeats=1,
    )
    (choice,) = planned.rows
    return choice


@pytest.mark.timeout(120)
@on_ranks(4, timeout=60)
def test_a_checkpointed_forward_keeps_the_rng_state_and_the_planner_counts_it(
    dualpipe_v_choice: Candidate, tmp_path: Path
) -> None:
    """torch's checkpoint stashes the RNG state with each call (preserve_rng_state; on the CPU 5056 bytes, in the
    memory the allocator watches) until its backward: a DualPipeV rank of one small layer a stage holds about 9
    micro-batches' at its peak, 6.5% of the rank's figure, which the planner missed. Within 1% now."""
    choice, path = dualpipe_v_choice, tmp_path / "peaks.pickle"
    traced_steps([choice.engine_kwargs()], [str(path)], True)
    if ranks.rank() != 0:  # rank 0 saved the step's peaks
        return
    *_, allocated, stepped = pickle.loads(path.read_bytes())
    required = [max(a, b) for a, b in zip(allocated, stepped, strict=True)]
    for rank, (m, p) in enumerate(zip(required, choice.peak_memory, strict=True)):
        assert abs(p - m) <= 0.01 * m, (rank, p, m)


@pytest.mark.timeout(120)
def test_the_cli_plans_a_model_given_as_module_function() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeengine.tune",
            "tests.pipeengine.models:planning",
            "--world-size",
            "2",
            "--schedules",
            "1f1b",
            "zb-v",
        ],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr  # e.g. runpy's, were pipeengine to import the module first
    assert "Memory block" not in result.stderr, result.stderr  # torch's allocator, under the planner's watches
    # its progress: 5 micro-batch sizes, and 4 of them again warm for the layout of one pipeline rank (dp=2)
    assert "measuring 11 layers at 9 settings: 99/99\n" in result.stderr, result.stderr
    assert "candidates (priced in" in result.stdout and "best: PipelineEngine(model, loss_fn, **{'schedule':" in (
        result.stdout
    )


def test_the_first_stages_weight_pass_is_composed_as_its_whole_backward() -> None:
    """Its input needs no gradient, so its W is its whole backward in one autograd call, which adds each gradient
    to .grad as it is made, as B does: B's composition (a checkpointed stage's W alike); a later stage's W is W's
    composition. The optimizer step over several layers allocates what its largest layer's does."""
    from pipeengine.planner.transients import Allocation, optimizer, stage

    layer = Allocation(peak=(0.0, 10.0, 3.0, 4.0), end=(0.0, 1.0, 0.0, 0.0), first_peak=(10.0, 4.0), optimizer=8.0)
    first, later = stage([layer] * 3, 0, 3), stage([layer] * 4, 1, 4)
    assert first["weight_transient"] == first["backward_transient"] == 2 * 1.0 + 10.0  # two layers' ends below
    assert first["input_transient"] == 0.0
    assert later["weight_transient"] == 4.0 and later["input_transient"] == 3.0
    checkpointed = stage([layer] * 4, 1, 4, one_pass=True)  # layers 1-3
    assert checkpointed["weight_transient"] == checkpointed["backward_transient"] == 2 * 1.0 + 10.0
    assert optimizer([layer, layer, dataclasses.replace(layer, optimizer=2.0)]) == 8.0


def test_a_weight_pass_makes_one_layers_gradients_at_a_time() -> None:
    """W restarts at each node with weights; the gradients of one are added to .grad and let go before the next
    node's are made (bound to a name across the loop, two layers' were alive at once: 4 MiB more per W on the
    benchmark MLP). A Linear's are added by the matmul itself where .grad is held (addmm_), so a later
    micro-batch's W makes no layer's gradient at all; the first's makes each layer's .grad, one at a time."""
    from pipeengine.observe.allocator import AllocatorWatch
    from pipeengine.step.backward import backward_input

    torch.manual_seed(0)
    stage = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(3)])
    params = list(stage.parameters())
    peaks = []
    for _ in range(2):  # the second finds .grad: W adds to it, as every W after a stage's first does
        x = torch.randn(64, 256, requires_grad=True)
        out = stage(x)
        _, weight_pass = backward_input((out,), (torch.ones_like(out),), (x,), params)
        del out
        with AllocatorWatch(torch.device("cpu")) as watch:
            weight_pass.run()
        del weight_pass
        peaks.append(watch.peak)
    one_layer = 256 * 256 * 4
    assert 3 * one_layer <= peaks[0] < 4 * one_layer, peaks  # the three .grad made, each kept
    assert peaks[1] < one_layer, peaks


class _LogsWhileProfiled(nn.Module):
    """Writes torch's line on a free the allocator cannot size (``line``) to fd 2 while a profiler records, as torch
    does (at the first such free of a process and every 1000th after), and a line of its own."""

    line = b""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
            os.write(2, self.line + b"the layer's own line, watched\n")
        return self.linear(x)


def test_tune_says_how_far_the_measuring_is_and_no_profiler_line_reaches_the_user(
    capfd: pytest.CaptureFixture[str], recwarn: pytest.WarningsRecorder
) -> None:
    from pipeengine.observe.allocator import UNKNOWN_FREE, AllocatorWatch

    for _ in range(50):  # torch's own line: frees it cannot size in a watch (some addresses it still knows)
        before = [torch.empty(1) for _ in range(1000)]
        with AllocatorWatch(torch.device("cpu")):
            before.clear()
        said = capfd.readouterr().err
        if said:
            break
    assert UNKNOWN_FREE.decode() in said, said
    _LogsWhileProfiled.line = said.encode()
    calls: list[tuple[int, int, int]] = []
    model = nn.Sequential(_LogsWhileProfiled(), nn.ReLU(), nn.Linear(4, 2))
    tune(
        model,
        mse,
        torch.randn(4, 4),
        2,
        data_parallel=1,
        schedules=["1f1b"],
        microbatches=[1, 2],
        repeats=1,
        progress=lambda *done: (calls.append(done), progress_printer()(*done)),
    )
    assert calls == [(done, 3, 2) for done in range(7)]  # 3 layers at 2 settings (micro-batch sizes), a call after each
    err = capfd.readouterr().err
    assert UNKNOWN_FREE.decode() not in err, err
    assert [line for line in err.splitlines() if line != "the layer's own line, watched"] == [
        f"measuring 3 layers at 2 settings: {done}/6" for done in range(7)
    ], err
    assert err.count("the layer's own line, watched\n") >= 2, err  # its computes watched at each size: passed on
    assert not recwarn.list, [str(w.message) for w in recwarn.list]
    lines = io.StringIO()  # not a terminal: a line at the start, at each tenth of the way, at the end
    printer = progress_printer(lines)
    for done in range(25):
        printer(done, 8, 3)
    shown = [0, 3, 5, 8, 10, 12, 15, 17, 20, 22, 24]
    assert lines.getvalue().splitlines() == [f"measuring 8 layers at 3 settings: {d}/24" for d in shown]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()  # one line, rewritten in place
    printer = progress_printer(terminal)
    for done in range(3):
        printer(done, 2, 1)
    said = "measuring 2 layers at 1 setting"
    assert terminal.getvalue() == f"\r{said}: 0/2\r{said}: 1/2\r{said}: 2/2\n"
