"""Every compiler over the grid of sizes: validity, published bubble formulas, memory, docstring diagrams."""

import inspect
import textwrap

import pytest

from schedules import (
    Kind,
    Timeline,
    build_schedule,
    compile_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    validate,
    zb_h1,
    zb_v,
)

GRID = [(p, m, v) for p in range(1, 9) for m in range(1, 33) for v in range(1, 5)]


def defined(name: str, p: int, m: int, v: int) -> bool:
    if name == "interleaved":
        return m % p == 0
    return v == (2 if name == "zb-v" else 1)


def idle_times_denominator_equals(timeline: Timeline, p: int, numerator: int, denominator: int) -> bool:
    """bubble == numerator / denominator, exactly, in integers (unit costs give integral times)."""
    makespan = round(timeline.makespan)
    busy = round(sum(timeline.busy(r) for r in range(p)))
    return (p * makespan - busy) * denominator == numerator * p * makespan


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_every_defined_size_validates_and_meets_the_published_bubble(name: str) -> None:
    checked = 0
    for p, m, v in GRID:
        if not defined(name, p, m, v):
            with pytest.raises(ValueError, match=str(p) if name == "interleaved" else "chunks"):
                build_schedule(name, p, m, v)
            continue
        schedule = build_schedule(name, p, m, v)
        validate(schedule)
        timeline = simulate(schedule)
        # GPipe and 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v*m+p-1) (Narayanan et al., 2021)
        assert idle_times_denominator_equals(timeline, p, p - 1, v * m + p - 1), (name, p, m, v)
        checked += 1
    assert checked == {"gpipe": 256, "1f1b": 256, "interleaved": 340}[name]


@pytest.mark.parametrize("p, m", [(p, m) for p in range(1, 9) for m in range(1, 33)])
def test_peak_inflight_gpipe_holds_m_and_1f1b_holds_min_p_minus_i_m(p: int, m: int) -> None:
    assert simulate(build_schedule("gpipe", p, m)).peak_inflight == [m] * p
    assert simulate(build_schedule("1f1b", p, m)).peak_inflight == [min(p - i, m) for i in range(p)]


def test_interleaved_with_one_chunk_per_rank_keeps_the_1f1b_bubble() -> None:
    timeline = simulate(build_schedule("interleaved", 4, 8, 1))
    assert idle_times_denominator_equals(timeline, 4, 3, 11)


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid names: gpipe, 1f1b, interleaved, zb-h1, zb-v"):
        build_schedule("zigzag", 2, 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_sizes_must_be_positive_ints(bad: object) -> None:
    with pytest.raises(ValueError, match="positive int"):
        build_schedule("1f1b", bad, 4)  # type: ignore[arg-type]


def test_interleaved_error_says_what_m_to_use() -> None:
    with pytest.raises(ValueError, match="multiple of 4, got 6; use 4 or 8"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="multiple of 4, got 3; use 4"):
        build_schedule("interleaved", 4, 3, 2)


def test_compilers_emit_compute_only() -> None:
    for p, m, v in [(4, 8, 1), (4, 8, 2)]:
        schedule = compile_schedule("interleaved" if v > 1 else "1f1b", p, m, v)
        assert all(op.kind.is_compute for stream in schedule.instructions for op in stream)  # type: ignore[union-attr]


def test_interleaved_places_stage_k_on_rank_k_mod_p() -> None:
    schedule = build_schedule("interleaved", 3, 6, 4)
    assert schedule.placement == tuple(k % 3 for k in range(12))
    assert schedule.stages_of(1) == (1, 4, 7, 10)


@pytest.mark.parametrize(
    "compiler, schedule",
    [
        (gpipe, gpipe(4, 4)),
        (one_f_one_b, one_f_one_b(4, 5)),
        (interleaved_1f1b, interleaved_1f1b(2, 2, 2)),
        (zb_h1, zb_h1(3, 4)),
        (zb_v, zb_v(2, 4)),
    ],
)
def test_docstring_timing_diagram_is_what_the_simulator_draws(compiler: object, schedule: object) -> None:
    doc = inspect.getdoc(compiler) or ""
    drawn = textwrap.dedent(doc.split("::\n\n", 1)[1]).strip()
    assert drawn == simulate(schedule).diagram()  # type: ignore[arg-type]


def test_1f1b_rank_order_is_warmup_steady_cooldown() -> None:
    stream = [str(op) for op in one_f_one_b(4, 6).instructions[1]]
    assert stream == ["1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1F4", "1B2", "1F5", "1B3", "1B4", "1B5"]
    assert all(op.kind is Kind.FORWARD for op in one_f_one_b(4, 2).instructions[0][:2])  # type: ignore[union-attr]
