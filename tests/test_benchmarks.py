"""Every benchmark runs end to end in a tiny configuration (its figures are not checked here)."""

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
TINY = ["--width", "64", "--layers", "4", "--batch", "16"]


def bench(script: str, *args: str, out: Path) -> str:
    """Run a benchmark's main() with these arguments in this process (its ranks from this process's fork server,
    which imported torch once: a fresh interpreter and fork server per script cost seconds of CPU each); what it
    prints is returned. Its modules are imported afresh, reading PIPEENGINE_BENCH_OUT anew."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    os.environ["PIPEENGINE_BENCH_OUT"] = str(out)
    modules = [importlib.import_module(name) for name in ("common", Path(script).stem)]
    for module in modules:
        importlib.reload(module)
    printed = io.StringIO()
    argv = sys.argv
    sys.argv = [script, *args]
    try:
        with contextlib.redirect_stdout(printed):
            modules[-1].main()
    finally:
        sys.argv = argv
    return printed.getvalue()


@pytest.mark.timeout(300)
def test_vs_torch_reports_a_ratio_per_schedule(tmp_path: Path) -> None:
    # torch's several-stage API (interleaved: torch 2.11's zb-v fails on gloo, see vs_torch.py)
    schedules = ["interleaved"]
    out = bench(
        "vs_torch.py",
        *TINY,
        "--microbatches",
        "4",
        "--rounds",
        "1",
        "--steps",
        "1",
        "--schedules",
        *schedules,
        out=tmp_path,
    )
    rows = json.loads((tmp_path / "vs_torch.json").read_text())
    assert [r["schedule"] for r in rows] == schedules and "-> " in out
    # well-formed figures: which is faster is the benchmark's to measure, never a test's to assert
    assert all(r["ours_ms"] > 0 and r["torch_ms"] > 0 and r["single_process_ms"] > 0 for r in rows)
    assert all(r["no_overhead_ms"] > 0 for r in rows)
    assert all(r["speedup_vs_torch"] == pytest.approx(r["torch_ms"] / r["ours_ms"]) for r in rows)
    assert all(r["bound_vs_torch"] == pytest.approx(r["torch_ms"] / r["no_overhead_ms"]) for r in rows)


@pytest.mark.timeout(300)
def test_split_size_sweeps_and_draws(tmp_path: Path) -> None:
    bench("split_size.py", *TINY, "--microbatches", "4", "--steps", "1", "--schedules", "1f1b", out=tmp_path)
    rows = json.loads((tmp_path / "split_size.json").read_text())
    assert [r["microbatches"] for r in rows] == [4]
    assert (tmp_path / "split_size.png").stat().st_size > 10_000 and (tmp_path / "split_size.csv").exists()


@pytest.mark.timeout(300)
def test_schedules_and_overhead(tmp_path: Path) -> None:
    bench(
        "compare_schedules.py",
        *TINY,
        "--ranks",
        "2",
        "--microbatches",
        "4",
        "--steps",
        "1",
        "--schedules",
        "zb-h1",
        out=tmp_path,
    )
    assert len(json.loads((tmp_path / "schedules.json").read_text())) == 1 and (tmp_path / "schedules_p2.png").exists()
    out = bench("overhead.py", *TINY, "--microbatches", "4", "--steps", "2", "--schedules", "1f1b", out=tmp_path)
    row = json.loads((tmp_path / "overhead.json").read_text())[0]
    assert "us/instruction" in out and row["ratio"] > 0 and row["replay_ratio"] > 0


@pytest.mark.timeout(60)
def test_schedule_scale_runs_small() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "schedule_scale.py"), "1f1b", "4", "8", "1"],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=ROOT,
    )
    assert result.returncode == 0 and "total median" in result.stdout, result.stderr


@pytest.mark.timeout(300)
def test_memory_reports_the_ledger_the_allocator_and_the_prediction_of_every_rank(tmp_path: Path) -> None:
    bench(
        "memory.py",
        "--models",
        "activations",
        "--scale",
        "8",
        "--microbatches",
        "4",
        "--ranks",
        "2",
        "--checkpoint",
        "never",
        "--schedules",
        "1f1b",
        out=tmp_path,
    )
    (row,) = json.loads((tmp_path / "memory.json").read_text())
    assert row["schedule"] == "1f1b" and row["ranks"] == 2 and row["model"] == "activations"
    assert len(row["ledger"]) == len(row["allocator"]) == len(row["predicted"]) == len(row["state"]) == 2
    assert all(m > s > 0 for m, s in zip(row["ledger"], row["state"], strict=True))  # state, and more on top
    assert all(a >= g for a, g in zip(row["allocator"], row["ledger"], strict=True))  # it sees all the ledger does
    text = (tmp_path / "memory.txt").read_text()
    assert (tmp_path / "memory.png").stat().st_size > 10_000 and "ledger / allocator / predicted" in text


@pytest.mark.timeout(300)
def test_tune_measures_the_planners_choices_and_draws_the_frontier(tmp_path: Path) -> None:
    out = bench(
        "tune.py",
        "--models",
        "mlp",
        "--width",
        "64",
        "--measured",
        "4",
        "--rounds",
        "1",
        "--microbatches",
        "2",
        "4",
        out=tmp_path,
    )
    report = json.loads((tmp_path / "tune_mlp.json").read_text())
    rows = report["rows"]
    assert len(rows) == 4 and [r["predicted_rank"] for r in rows][:3] == [0, 1, 2]  # the top 3, then one more
    assert all(r["measured_ms"] > 0 and r["measured_peak_mb"] > 0 for r in rows)
    fastest = min(r["measured_ms"] for r in rows)
    assert report["slower"] == pytest.approx(rows[0]["measured_ms"] / fastest - 1)
    assert "the measured best is #" in out and (tmp_path / "tune_mlp.png").stat().st_size > 10_000


@pytest.mark.timeout(120)
def test_tune_search_times_the_search_per_world_size(tmp_path: Path) -> None:
    bench("tune_search.py", "--layers", "1", "--world-sizes", "2", "3", "--repeats", "1", out=tmp_path)
    rows = json.loads((tmp_path / "tune_search.json").read_text())
    assert [r["world_size"] for r in rows] == [2, 3] and all(r["layers"] == 3 for r in rows)
    assert all(r["candidates"] > 0 and r["search_s"] > 0 and r["measure_s"] > 0 for r in rows)


@pytest.mark.skipif(
    not (ROOT.parent / "shared" / "data" / "megatron_sc21_table1.csv").exists(),
    reason="the published figures (shared/data) are not beside this checkout",
)
def test_cluster_plan_prices_rows_of_megatrons_table_beside_the_paper(tmp_path: Path) -> None:
    bench("cluster_plan.py", "--rows", "1", "5", out=tmp_path)
    rows = json.loads((tmp_path / "cluster_plan.json").read_text())
    assert [(r["gpus"], r["layout"].split(" b=")[0]) for r in rows] == [(32, "tp1 pp1 dp32"), (512, "tp8 pp2 dp32")]
    assert all(
        r["predicted_tflops"] > 0 and abs(r["error"] - (r["predicted_tflops"] / r["paper_tflops"] - 1)) < 1e-3
        for r in rows
    )


@pytest.mark.timeout(300)
def test_vs_torch_tp_checks_equal_losses_and_reports_a_ratio_and_peaks(tmp_path: Path) -> None:
    out = bench(
        "vs_torch_tp.py",
        "--schedules",
        "1f1b",
        "--width",
        "64",
        "--blocks",
        "2",
        "--batch",
        "8",
        "--microbatches",
        "2",
        "--rounds",
        "1",
        "--steps",
        "1",
        out=tmp_path,
    )
    (row,) = json.loads((tmp_path / "vs_torch_tp.json").read_text())
    assert row["schedule"] == "1f1b" and row["ratio"] > 0 and "x   peak MiB per rank" in out
    assert len(row["ours_peak_mib"]) == len(row["torch_peak_mib"]) == 4


@pytest.mark.timeout(300)
def test_vs_torch_fsdp_checks_equal_losses_and_reports_a_ratio_and_peaks(tmp_path: Path) -> None:
    out = bench(
        "vs_torch_fsdp.py",
        "--schedules",
        "1f1b",
        "--modes",
        "fsdp",
        "--width",
        "64",
        "--batch",
        "16",
        "--rounds",
        "1",
        "--steps",
        "1",
        out=tmp_path,
    )
    (row,) = json.loads((tmp_path / "vs_torch_fsdp.json").read_text())
    assert row["schedule"] == "1f1b" and row["fsdp"] and row["ratio"] > 0 and "x   peak MiB per rank" in out
    assert len(row["ours_peak_mib"]) == len(row["torch_peak_mib"]) == 4


@pytest.mark.timeout(300)
def test_compile_reports_eager_against_compiled_stages_and_the_compile_time(tmp_path: Path) -> None:
    # aot_eager: the report's logic is tested, not inductor's C++ compiler (test_compile runs inductor)
    out = bench(
        "compile.py",
        "--ranks",
        "2",
        "--schedules",
        "zb-h1",
        "--width",
        "32",
        "--blocks",
        "1",
        "--batch",
        "4",
        "--microbatches",
        "2",
        "--rounds",
        "1",
        "--steps",
        "1",
        "--backend",
        "aot_eager",
        out=tmp_path,
    )
    (row,) = json.loads((tmp_path / "compile.json").read_text())
    assert row["schedule"] == "zb-h1" and row["ranks"] == 2 and row["backend"] == "aot_eager" and "-> " in out
    assert (
        row["eager_ms"] > 0
        and row["compiled_ms"] > 0
        and row["ratio"] == pytest.approx(row["eager_ms"] / row["compiled_ms"])
    )


@pytest.mark.timeout(120)
def test_checkpoint_reports_the_stall_of_a_background_save_against_a_synchronous_one(tmp_path: Path) -> None:
    out = bench("checkpoint.py", "--width", "64", "--layers", "2", "--batch", "8", "--rounds", "1", out=tmp_path)
    (row,) = json.loads((tmp_path / "checkpoint.json").read_text())
    assert "of the synchronous save" in out and row["rounds"] == 1 and row["format"] == "whole tensors (pp=2)"
    # AdamW's two moments beside each weight: 3 x (2 x (64 x 64 + 64)) floats
    assert row["state_mib"] == pytest.approx(3 * 2 * (64 * 64 + 64) * 4 / 2**20)
    assert row["sync_save_ms"] > 0 and row["background_stall_ms"] > 0 and row["stall_fraction"] > 0


@pytest.mark.timeout(300)
def test_tune_layout_times_layouts_over_the_ranking_at_calibrated_prices(tmp_path: Path) -> None:
    prices = Path(__file__).parent / "calibration.json"  # calibrating is test_calibration's
    out = bench("tune_layout.py", "--quick", "--prices", str(prices), "--final", "1", "--contend", "100", out=tmp_path)
    report = json.loads((tmp_path / "tune_layout.json").read_text())
    rows = report["rows"]
    assert len(rows) == 2 and rows[0]["predicted_rank"] == 0  # the predicted best, and the best of another layout
    assert len({(r["data_parallel"], r["pipeline"], r["tensor_parallel"], r["fsdp"]) for r in rows}) == 2
    assert all(r["data_parallel"] * r["pipeline"] * r["tensor_parallel"] == 4 for r in rows)
    assert all(r["predicted_ms"] > 0 and r["measured_ms"] > 0 for r in rows)
    assert all(r["predicted_peak_mib"] > 0 and len(r["measured_peaks_mib"]) == 4 for r in rows)
    assert all(r["error"] == pytest.approx(r["measured_ms"] / r["predicted_ms"] - 1) for r in rows)
    # every row measured within 100x of the fastest (both) ran the final round too: 2 steps each
    assert all(r["contender"] and len(r["measured_steps_ms"]) == 2 for r in rows) and report["final_rounds"] == 1
    # the prices are the calibration file's, not the built-in constants
    assert report["prices_calibrated"] and report["calibration"] == str(prices) and str(prices) in report["prices"]
    assert report["search_seconds"]["4"] > 0
    assert 0 < report["kept"] <= report["candidates"] and "median" in out
    assert (tmp_path / "tune_layout.png").stat().st_size > 10_000
    table = (tmp_path / "tune_layout.md").read_text().splitlines()  # the docs' table: a header, then each row
    assert len(table) == 2 + len(rows) and table[2].startswith(f"| 0 | {rows[0]['layout']} | {rows[0]['schedule']} |")


def test_tune_layout_times_the_best_of_every_layout_and_of_every_schedule_in_the_best_layout() -> None:
    """tune_layout.chosen: the predicted best, the best of each other layout, the best of each other schedule in the
    best's layout, the next two, then rows spread down the rest; none slower than ``slowest`` x the best."""
    from types import SimpleNamespace

    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    tune_layout = importlib.import_module("tune_layout")
    named = [
        ("pp4", "zb-h1"),
        ("pp4", "zb-h1"),
        ("pp4", "1f1b"),
        ("pp4", "zb-h1"),
        ("dp2", "gpipe"),
        ("pp4", "gpipe"),
        ("pp4", "1f1b"),
        ("dp2", "1f1b"),
        ("tp4", "gpipe"),
        ("pp4", "gpipe"),
        ("dp2", "gpipe"),
        ("tp4", "1f1b"),
        ("tp4", "gpipe"),
    ]
    rows = [
        SimpleNamespace(layout=layout, schedule=schedule, step_time=1.0 + i)
        for i, (layout, schedule) in enumerate(named)
    ]
    picked = tune_layout.chosen(SimpleNamespace(rows=rows), 8, 12.0)  # type: ignore[arg-type]
    # best 0; other layouts 4 (dp2), 8 (tp4); other schedules of pp4 2 (1f1b), 5 (gpipe); next 1; spread 3, 11 (12 is
    # slower than 12 x the best)
    assert [rows.index(row) for row in picked] == [0, 1, 2, 3, 4, 5, 8, 11]
    assert [rows.index(row) for row in tune_layout.chosen(SimpleNamespace(rows=rows), 3, 12.0)] == [0, 4, 8]  # type: ignore[arg-type]


def test_split_backward_times_f_b_and_i_plus_w_per_stage(tmp_path: Path) -> None:
    bench("split_backward.py", "--rounds", "1", "--models", "mlp", out=tmp_path)
    (row,) = json.loads((tmp_path / "split_backward.json").read_text())
    assert row["stage"] == "mlp" and row["w_roots"] == 4  # W restarts at each Linear of the stage
    assert row["w_calls"] == 0  # and computes each from what the Linear saved, re-entering autograd for none
    assert all(row[key] > 0 for key in ("F", "B", "I", "W", "W one call", "I bare"))
    assert row["split_over_whole"] == pytest.approx((row["I"] + row["W"]) / row["B"], rel=1e-2)


def test_zero_bubble_times_the_schedules_alternating_against_1f1b(tmp_path: Path) -> None:
    bench(
        "zero_bubble.py",
        "--ranks",
        "2",
        "--rounds",
        "2",
        "--steps",
        "1",
        "--width",
        "32",
        "--layers",
        "4",
        "--batch",
        "16",
        "--microbatches",
        "4",
        out=tmp_path,
    )
    rows = json.loads((tmp_path / "zero_bubble.json").read_text())
    assert [row["schedule"] for row in rows] == ["1f1b", "zb-h1", "zb-v"]
    baseline = rows[0]["step_ms"]
    assert rows[0]["speed_over_1f1b"] == 1.0 and all(row["step_ms"] > 0 for row in rows)
    assert all(row["speed_over_1f1b"] == pytest.approx(baseline / row["step_ms"], rel=1e-2) for row in rows)
