"""The memory model: a step worked by hand, the published activation-memory facts, and where it shows."""

import subprocess
import sys
from pathlib import Path

import pytest

from schedules import Costs, Instruction, Memory, build_schedule, parse, plot_timelines, simulate, state_bytes

GRID = [(p, m) for p in range(1, 7) for m in range(1, 17)]


def peaks(name: str, p: int, m: int, memory: Memory, chunks: int | None = None) -> list[float]:
    return simulate(build_schedule(name, p, m, chunks), Costs(memory=memory)).peak_memory


def test_a_1f1b_step_by_hand() -> None:
    """p=2, m=2, unit times (F=1, B=2). State 1000, activation 100, output 10, its gradient 5 (bytes).

    rank 0: 0F0 0SF0 0F1 0SF1+0RB0 0B0 0RB1 0B1      1000 +100 +100 (t=2) +5 recv buffer = 1205, then down
    rank 1: 1RF0 1F0 1RF1 1B0 1SB0 1F1 1B1 1SB1       1000 +10 -10+100 (t=2) +10 = 1110, then its gradients
    """
    memory = Memory(state=1000, activation=100, boundary=10, gradient=5)
    timeline = simulate(build_schedule("1f1b", 2, 2), Costs(memory=memory))
    assert timeline.peak_memory == [1205, 1110]
    assert timeline.peak_actions == [parse("0SF1+0RB0"), parse("1RF1")]
    assert [b for _, b, _ in timeline.memory[0]][-1] == 1000  # type: ignore[index]  # all freed but the state
    assert [b for _, b, _ in timeline.memory[1]][-1] == 1000  # type: ignore[index]
    # rank 1 holds its first gradient from 1B0's end (t=4) until 1SB0's send ends (t=4): sampled, then freed
    rank1 = [(t, b) for t, b, a in timeline.memory[1] if str(a) in ("1B0", "1SB0")]  # type: ignore[index]
    assert rank1[-1] == (4.0, 1010.0)


@pytest.mark.parametrize("p, m", GRID)
def test_gpipe_holds_m_on_every_rank_and_1f1b_p_minus_i_on_rank_i(p: int, m: int) -> None:
    """Unit sizes (one micro-batch's activation of one stage = 1): Huang et al. 2019; Narayanan et al. 2021."""
    assert peaks("gpipe", p, m, Memory()) == [m] * p
    assert peaks("1f1b", p, m, Memory()) == [min(p - i, m) for i in range(p)]


@pytest.mark.parametrize("p, m", GRID)
def test_zero_bubble_holds_1f1bs_peak_and_zb_v_spreads_it_over_every_rank(p: int, m: int) -> None:
    """Qi et al. 2023 (ZB-H1: the same peak as 1F1B) and 2024 (ZB-V: 1F1B's peak on every rank; a ZB-V chunk is
    half a stage of 1F1B, so its activation counts 1/2)."""
    one = max(peaks("1f1b", p, m, Memory()))
    h1 = peaks("zb-h1", p, m, Memory())
    assert max(h1) == one and all(0 < peak <= one for peak in h1)
    v = peaks("zb-v", p, m, Memory(activation=0.5))
    assert max(v) == one
    if m >= 2 * p:  # a full pipe: every rank at the peak
        assert v == [one] * p


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_at_unit_sizes_the_peak_is_the_most_micro_batches_in_flight(name: str) -> None:
    for p in (1, 2, 4):
        for m in (p, 2 * p, 3 * p):
            timeline = simulate(build_schedule(name, p, m), Costs(memory=Memory()))
            assert timeline.peak_memory == timeline.peak_inflight


def test_what_i_frees_and_what_w_keeps_under_a_split_backward() -> None:
    # rank 1 of ZB-H1 (p=2): 1F0 1I0 1F1 1I1 1W0 ...; I leaves 0.25 of the activation for W
    kept = simulate(build_schedule("zb-h1", 2, 4), Costs(memory=Memory(activation=1.0, after_input=0.25)))
    whole = simulate(build_schedule("zb-h1", 2, 4), Costs(memory=Memory(activation=1.0)))
    assert kept.peak_memory == [2.0, 1.25] and whole.peak_memory == [2.0, 2.0]  # rank 0 peaks before any I
    computes = [(str(a), b) for _, b, a in kept.memory[1] if isinstance(a, Instruction) and a.kind.is_compute]  # type: ignore[index]
    held = computes[:5]
    assert held == [("1F0", 1.0), ("1I0", 0.25), ("1F1", 1.25), ("1I1", 0.5), ("1W0", 0.25)]


def test_state_is_held_all_step_and_counts_the_optimizers_copies() -> None:
    assert state_bytes(4_000) == 4 * 4_000  # weights, gradients, and AdamW's two moments
    assert state_bytes(4_000, optimizer_copies=0) == 2 * 4_000  # plain SGD
    timeline = simulate(build_schedule("gpipe", 2, 2), Costs(memory=Memory(state=[7, 3], activation=0)))
    assert timeline.peak_memory == [7, 3] and all(b in (7, 3) for s in timeline.memory for _, b, _ in s)  # type: ignore[union-attr]


def test_a_memory_track_is_drawn_under_each_rank(tmp_path: Path) -> None:
    timeline = simulate(build_schedule("1f1b", 4, 8), Costs(memory=Memory()))
    figure = tmp_path / "memory.png"
    plot_timelines([timeline, simulate(build_schedule("1f1b", 4, 8))], str(figure))
    assert figure.read_bytes()[:4] == b"\x89PNG" and figure.stat().st_size > 20_000


def test_the_cli_prints_each_ranks_peak() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "schedules", "simulate", "1f1b", "-p", "4", "-m", "8", "--memory"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    assert "peak memory per rank: rank 0: 4 after 0F3, rank 1: 3 after 1F2, rank 2: 2 after 2F1, rank 3: 1" in (
        result.stdout
    )


def test_per_stage_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="Memory.activation has 3 values, the schedule has 2 stages"):
        simulate(build_schedule("1f1b", 2, 2), Costs(memory=Memory(activation=[1, 2, 3])))


def test_what_the_allocator_sees_beyond_the_ledger_is_counted() -> None:
    """Late gradients, the computes' transients (a first B apart), the all-reduce's buffers, the optimizer step."""
    from schedules import with_gradient_sync

    schedule = build_schedule("1f1b", 2, 2)
    plain = simulate(schedule, Costs(memory=Memory(state=4.0, activation=1.0)))
    late = simulate(schedule, Costs(memory=Memory(state=4.0, activation=1.0, grads_late=1.0)))
    assert [s[0][1] for s in late.memory] == [3.0, 3.0]  # the gradients are not there yet when the step starts
    assert [s[-1][1] for s in late.memory] == [s[-1][1] for s in plain.memory] == [4.0, 4.0]  # after the first B
    peaky = simulate(
        schedule, Costs(memory=Memory(state=4.0, activation=1.0, backward_transient=10.0, first_transient=20.0))
    )
    assert peaky.peak_memory == [max(plain.peak_memory[r], 4.0 + 1.0 * (2 - r) + 20.0) for r in range(2)]
    synced = simulate(with_gradient_sync(schedule), Costs(memory=Memory(state=4.0, activation=1.0, sync=5.0)))
    assert [s[-1][1] for s in synced.memory] == [9.0, 9.0]  # each stage's flat buffer, to the step's end
    stepped = simulate(schedule, Costs(memory=Memory(state=4.0, activation=1.0, optimizer=30.0)))
    assert stepped.optimizer_peak == [34.0, 34.0] and stepped.required_memory == [34.0, 34.0]
    assert plain.required_memory == plain.peak_memory  # no optimizer temporaries: the step's peak


def test_each_computes_transient_counts_once_over_its_own_run_by_hand() -> None:
    """One rank, two micro-batches, unit times. State 100, activation 10 (4 left by I), transients F 1000, B 3000,
    I 300, W 30, the first B (or W) 5000: each held from its compute's start to its end, on the level it started at,
    once; the first gradient compute's in place of its kind's.

    gpipe:  F0 100+1000, then +10 | F1 110+1000, +10 | B0 (first) 120+5000, -10 | B1 110+3000, -10
    zb-h1:  F0 100+1000, +10 | I0 110+300, 10->4 | W0 (first) 104+5000, -4 | F1 ... | W1 104+30, -4
    """
    memory = Memory(
        state=100,
        activation=10,
        after_input=4,
        transient=1000,
        backward_transient=3000,
        input_transient=300,
        weight_transient=30,
        first_transient=5000,
    )
    gpipe = simulate(build_schedule("gpipe", 1, 2), Costs(memory=memory))
    assert [(str(a), b) for _, b, a in gpipe.memory[0]][1:] == [  # type: ignore[index]
        ("0F0", 1100),
        ("0F0", 100),
        ("0F0", 110),
        ("0F1", 1110),
        ("0F1", 110),
        ("0F1", 120),
        ("0B0", 5120),
        ("0B0", 120),
        ("0B0", 110),
        ("0B1", 3110),
        ("0B1", 110),
        ("0B1", 100),
    ]
    zb = simulate(build_schedule("zb-h1", 1, 2), Costs(memory=memory))
    assert [(str(a), b) for _, b, a in zb.memory[0]][1:] == [  # type: ignore[index]
        ("0F0", 1100),
        ("0F0", 100),
        ("0F0", 110),
        ("0I0", 410),
        ("0I0", 110),
        ("0I0", 104),
        ("0W0", 5104),
        ("0W0", 104),
        ("0W0", 100),
        ("0F1", 1100),
        ("0F1", 100),
        ("0F1", 110),
        ("0I1", 410),
        ("0I1", 110),
        ("0I1", 104),
        ("0W1", 134),
        ("0W1", 104),
        ("0W1", 100),
    ]
    assert gpipe.peak_memory == [5120] and zb.peak_memory == [5104]


def test_what_fsdp_gathers_and_reduce_scatters_by_hand() -> None:
    """One rank, GPipe m=2, unit times, its gradients reduce-scattered (AR). Shards 100 (of which 5 gradients, made
    at the AR), activation 10; gathered 40 (held once more while the first F gathers them), whole gradients 40 from
    the first B; the AR holds 10 above its start, frees the whole tensors and keeps a unit's input (20) to the end.

    95 | F0 95+40+40 = 175, 135, +10 | F1 +10 | B0 +40-10 = 185 | B1 -10 | AR 175+10, 175, 175+5+20-80 = 120
    """
    from schedules import with_gradient_sync

    memory = Memory(
        state=100,
        activation=10,
        grads_late=5,
        gathered=40,
        gathered_grads=40,
        reduce_held=20,
        reduce_transient=10,
        gather_transient=40,
    )
    schedule = with_gradient_sync(build_schedule("gpipe", 1, 2))
    timeline = simulate(schedule, Costs(memory=memory, all_reduce=1))
    assert [(str(a), b) for _, b, a in timeline.memory[0]] == [  # type: ignore[index]
        ("None", 95),
        ("0F0", 175),
        ("0F0", 135),
        ("0F0", 145),
        ("0F1", 155),
        ("0B0", 185),
        ("0B1", 175),
        ("0AR1", 185),
        ("0AR1", 175),
        ("0AR1", 120),
    ]
    ledger = simulate(schedule, Costs(memory=memory.without_transients(), all_reduce=1))  # what a traced step sees
    assert [b for _, b, _ in ledger.memory[0]] == [95, 135, 135, 145, 155, 185, 175, 175, 175, 120]  # type: ignore[index]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved", "zb-v"])
def test_a_searchs_summary_has_the_simulated_step_and_peaks(name: str) -> None:
    """summarize (what a search prices: no spans, each rank's peak only) agrees with simulate's timeline, on ranks
    that share processors too."""
    from schedules.sim.simulation import summarize

    memory = Memory(
        state=1000,
        activation=100,
        boundary=10,
        gradient=5,
        transient=7,
        backward_transient=9,
        optimizer=30,
        grads_late=20,
    )
    for processors in (None, 1.5):
        for m in (3, 6):
            schedule = build_schedule(name, 3, m)
            costs = Costs(forward=1.0, backward=2.0, latency=0.25, memory=memory, processors=processors)
            timeline, summary = simulate(schedule, costs), summarize(schedule, costs)
            after = memory.optimizer_peak(schedule.placement)
            assert summary.makespan == pytest.approx(timeline.makespan)
            assert summary.required_memory == tuple(max(a, b) for a, b in zip(timeline.peak_memory, after, strict=True))


def test_a_memorys_table_is_made_once_per_stage_count() -> None:
    memory = Memory(activation=[1.0, 2.0])
    table = memory.per_stage(2)
    assert memory.per_stage(2) is table and table["activation"] == [1.0, 2.0] and table["after_input"] == [1.0, 2.0]
    assert memory.per_stage(2) is not Memory(activation=[1.0, 2.0]).per_stage(2)  # another Memory, its own
    with pytest.raises(ValueError, match="Memory.activation has 2 values, the schedule has 3 stages"):
        memory.per_stage(3)
