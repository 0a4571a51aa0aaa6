"""Measured timelines: one span per instruction, waits apart, one clock for all ranks, and plots of them."""

import json
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeengine import PipelineEngine, launch
from schedules import (
    Costs,
    Instruction,
    Schedule,
    Span,
    Timeline,
    build_schedule,
    forward_only,
    ops_of,
    peer,
    plot_timelines,
    receives_first,
    replay,
    simulate,
)
from tests.pipeengine import ranks


def traced_steps(path: str, schedule: str, microbatches: int) -> None:
    """A warm-up step, then one traced train step and one traced eval step; rank 0 pickles the timelines."""
    torch.manual_seed(0)  # compute (~2 ms a stage per micro-batch) well above per-message overheads
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(8)])
    engine = PipelineEngine(
        model, nn.functional.mse_loss, num_microbatches=microbatches, schedule=schedule, partition="uniform"
    )
    x, y = torch.randn(64 * microbatches, 512), torch.randn(64 * microbatches, 512)
    engine.train_step(x, y)
    assert engine.timeline() is None  # not traced
    with engine.tracing():
        engine.train_step(x, y)
        train = engine.timeline()
        engine.eval_step(x)
        evaluation = engine.timeline()
    engine.train_step(x, y)
    assert engine.timeline() is evaluation  # tracing is off again: the last traced step stays
    if ranks.rank() == 0:
        with open(path, "wb") as out:
            pickle.dump((engine.schedule, train, evaluation), out)
    else:
        assert train is None and evaluation is None


def traced_run(path: Path, in_process: bool) -> tuple[Schedule, Timeline, Timeline]:
    launch(traced_steps, 2, args=(str(path), "gpipe", 4), timeout=60, in_process=in_process)
    with path.open("rb") as data:
        return pickle.load(data)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[Schedule, Timeline, Timeline]:
    """Two real gloo ranks: two clocks, aligned by ping-pong."""
    return traced_run(tmp_path_factory.mktemp("trace") / "timelines.pickle", in_process=False)


@pytest.fixture(scope="module")
def traced_in_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Schedule, Timeline, Timeline]:
    """Two threads: one clock, so every inequality between their spans holds exactly."""
    return traced_run(tmp_path_factory.mktemp("trace") / "timelines.pickle", in_process=True)


@pytest.mark.timeout(120)
def test_one_span_per_executed_instruction_and_per_rank_spans_do_not_overlap(traced: tuple) -> None:
    schedule, train, evaluation = traced
    for timeline, run in ((train, schedule), (evaluation, forward_only(schedule))):
        run = receives_first(run)  # on gloo every recv of a step is posted at its start
        assert 0 < timeline.clock_error  # two clocks: aligned to within half a ping
        assert timeline.measured and timeline.unit == "s"
        for rank in range(2):
            mine = sorted((s for s in timeline.spans if s.rank == rank), key=lambda s: s.start)
            executed = [s.action for s in mine if not s.wait]
            assert sorted(map(str, executed)) == sorted(map(str, run.instructions[rank]))
            assert all(s.start < s.end for s in mine)
            assert all(a.end <= b.start for a, b in zip(mine, mine[1:], strict=False))


@pytest.mark.timeout(120)
def test_waits_are_their_own_spans_and_every_recv_ends_after_its_send_was_posted(traced: tuple) -> None:
    _, train, _ = traced
    posted: dict[Instruction, float] = {}
    for span in train.spans:
        if not span.wait and not span.is_compute:
            for op in ops_of(span.action):
                posted[op] = span.start
    waits = [s for s in train.spans if s.wait and s.action.kind.is_recv]  # type: ignore[union-attr]
    assert waits  # rank 1 waits for activations, rank 0 for gradients
    for wait in waits:
        send = peer(wait.action)  # type: ignore[arg-type]
        # causality on one clock, to the alignment's own error on each of the two ranks
        assert wait.end >= posted[send] - 2 * train.clock_error - 1e-9, (wait, posted[send], train.clock_error)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["traced", "traced_in_process"])
def test_a_replayed_step_keeps_each_measured_compute_and_ends_no_later(
    where: str, request: pytest.FixtureRequest
) -> None:
    schedule, train, _ = request.getfixturevalue(where)
    replayed = replay(schedule, train)
    for rank in range(2):
        ran, again = train.compute_spans(rank), replayed.compute_spans(rank)
        assert [s.action for s in again] == [s.action for s in ran]
        assert [s.duration for s in again] == pytest.approx([s.duration for s in ran])
    # the replay drops only what is not compute (posting, message time, bookkeeping): no longer than the
    # step, up to each rank's clock alignment (exactly, on the one clock of in-process ranks)
    assert max(train.busy(r) for r in range(2)) <= replayed.makespan
    assert replayed.makespan <= train.makespan + 2 * train.clock_error + 1e-9


def test_the_simulator_fed_a_steps_costs_predicts_its_bubble_exactly() -> None:
    """The trace maths with injected costs: a 'measured' step that ran exactly as the model says (uneven
    stages, a message time) gives back its costs, and the simulator fed them predicts its bubble."""
    schedule = build_schedule("gpipe", 3, 4)
    costs = Costs(forward=[1.0, 2.0, 1.5], backward=[2.0, 4.0, 3.0])
    ran = simulate(schedule, costs)
    ran = Timeline(ran.num_ranks, ran.spans, unit="s", measured=True)
    recovered = Costs.from_timeline(ran)
    assert recovered.forward == [1.0, 2.0, 1.5] and recovered.backward == [2.0, 4.0, 3.0]
    assert simulate(schedule, recovered).bubble_fraction == pytest.approx(ran.bubble_fraction, abs=1e-12)
    assert 0 < ran.bubble_fraction < 1


@pytest.mark.timeout(120)
def test_in_process_ranks_trace_one_span_per_instruction_on_one_clock(traced_in_process: tuple) -> None:
    schedule, train, evaluation = traced_in_process
    assert train.clock_error == 0.0  # threads read one clock
    for timeline, run in ((train, schedule), (evaluation, forward_only(schedule))):
        for rank in range(2):  # the loopback runs the lowered streams (as NCCL does)
            executed = [s.action for s in timeline.spans if s.rank == rank and not s.wait]
            assert sorted(map(str, executed)) == sorted(map(str, run.instructions[rank]))


@pytest.mark.timeout(120)
def test_plot_and_chrome_trace_of_a_measured_step(traced: tuple, tmp_path: Path) -> None:
    schedule, train, _ = traced
    predicted = simulate(schedule, Costs.from_timeline(train))
    assert predicted.unit == "s"  # the measured costs' seconds: one time axis, in ms
    figure = tmp_path / "measured.png"
    plot_timelines([train, predicted], str(figure), titles=["measured", "predicted"])
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000
    trace = tmp_path / "trace.json"
    train.to_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    assert len(events) == 3 * train.num_ranks + len(train.spans)
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1} and all(e["dur"] >= 0 for e in spans)


def test_costs_from_a_timeline_are_medians_per_kind_and_stage() -> None:
    from schedules import parse

    spans = [
        Span(0, parse("0F0"), 0, 1),
        Span(0, parse("0F1"), 1, 4),
        Span(0, parse("0F2"), 4, 6),
        Span(1, parse("1F0"), 2, 4),
        Span(1, parse("1B0"), 4, 9),
        Span(0, parse("0B0"), 9, 12),
        Span(0, parse("0RB0"), 6, 9, wait=True),
    ]
    costs = Costs.from_timeline(Timeline(2, spans))
    assert costs.forward == [2, 2] and costs.backward == [3, 5]


SETUP_ENDS: dict[int, float] = {}  # rank -> when its traced step's setup ended (threads: one clock)


def a_late_rank_traced(path: str) -> None:
    """The first traced step, rank 1 slow to set its tracing up: each rank's clock zero, and when the setups ended."""
    torch.manual_seed(0)
    engine = PipelineEngine(
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
        nn.functional.mse_loss,
        num_microbatches=2,
        schedule="1f1b",
    )
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    engine.train_step(x, y)
    with engine.tracing():
        engine.train_step(x, y)
    tracer = engine._tracing._tracer
    zeros = ranks.all_gather_object(tracer.origin)
    if ranks.rank() == 0:
        with open(path, "wb") as out:
            pickle.dump((engine.timeline(), zeros, dict(SETUP_ENDS)), out)


@pytest.mark.timeout(60)
def test_a_traced_step_starts_when_every_rank_has_set_its_tracing_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeline shows the step, not its setup: a rank measuring its stages (the first traced step) or starting
    the allocator's watch late does not leave the others' work drawn alone ahead of it (the README's first picture
    was the setup's skew, the step in its last 2%). Ordering on in-process ranks' one clock, no duration asserted."""
    import time

    from pipeengine.train.tracing import Tracing

    measure = Tracing._stage_sizes

    def slow_on_rank_1(self: Tracing, *args: object) -> object:
        sizes = measure(self, *args)  # type: ignore[arg-type]
        if self._pipeline.rank == 1:
            time.sleep(0.2)
        SETUP_ENDS[self._pipeline.rank] = time.perf_counter()
        return sizes

    monkeypatch.setattr(Tracing, "_stage_sizes", slow_on_rank_1)
    path = tmp_path / "late.pickle"
    launch(a_late_rank_traced, 2, args=(str(path),), timeout=45, in_process=True)
    with path.open("rb") as data:
        timeline, zeros, ends = pickle.load(data)
    ready = max(ends.values())  # the last rank's setup ended
    assert timeline.clock_error == 0.0 and len(ends) == 2
    assert min(zeros) >= ready  # every rank's clock zero after every rank's setup
    assert zeros[0] + timeline.start >= ready  # nothing drawn before the last rank was ready
