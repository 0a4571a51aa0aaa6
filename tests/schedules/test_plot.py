"""Plots and Chrome traces of simulated timelines (no torch)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from schedules import Timeline, build_schedule, plot_timelines, simulate

PNG = b"\x89PNG\r\n\x1a\n"


def test_several_schedules_on_one_time_axis(tmp_path: Path) -> None:
    timelines = [simulate(build_schedule(name, 4, 8, v)) for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]]
    path = tmp_path / "three.png"
    plot_timelines(timelines, str(path))
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 20_000


def test_plot_needs_a_timeline(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one timeline"):
        plot_timelines([], str(tmp_path / "none.png"))


def test_chrome_trace_has_a_process_per_rank_and_an_event_per_span(tmp_path: Path) -> None:
    timeline = simulate(build_schedule("1f1b", 3, 4))
    path = tmp_path / "trace.json"
    timeline.to_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert names == ["rank 0", "rank 1", "rank 2"]
    assert len([e for e in events if e["ph"] == "X"]) == len(timeline.spans)
    forward = next(e for e in events if e.get("name") == "1F0")
    assert forward["ts"] == 1000.0 and forward["dur"] == 1000.0  # 1 cost unit is drawn as 1 ms


def test_the_plot_command_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "1f1b.png"
    command = [
        sys.executable,
        "-m",
        "schedules",
        "plot",
        "1f1b",
        "--ranks",
        "4",
        "--microbatches",
        "8",
        "-o",
        str(path),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert path.read_bytes()[:8] == PNG


def test_the_legend_says_which_shade_is_which_chunk(tmp_path: Path) -> None:
    figure = plot_timelines([simulate(build_schedule("interleaved", 2, 4, 2))], str(tmp_path / "chunks.png"))
    labels = [text.get_text() for legend in figure.legends for text in legend.get_texts()]
    assert "a rank's first chunk (full shade)" in labels and "its later chunks (lighter)" in labels, labels
    figure = plot_timelines([simulate(build_schedule("1f1b", 2, 4))], str(tmp_path / "one.png"))
    labels = [text.get_text() for legend in figure.legends for text in legend.get_texts()]
    assert not any("chunk" in label for label in labels), labels  # one chunk per rank: no shades to explain


def test_a_measured_memory_track_labels_its_peak_in_mib(tmp_path: Path) -> None:
    from schedules import Costs, Memory

    simulated = simulate(build_schedule("1f1b", 2, 2), Costs(memory=Memory(activation=3 * 2**20)))
    in_seconds = dataclasses.replace(simulated, unit="s")  # as a measured step (or one simulated from it) is drawn
    figure = plot_timelines([in_seconds], str(tmp_path / "memory.png"))
    labels = {text.get_text() for axis in figure.axes for text in axis.texts if text.get_text().startswith("peak ")}
    assert labels == {"peak 6.0 MiB", "peak 3.0 MiB"}, labels  # bytes / 2**20, as binary units are written


def measured_and_predicted() -> tuple[Timeline, Timeline]:
    """A 'measured' step (seconds, bytes), as pipeengine's trace makes one, and the simulator fed its costs."""
    from schedules import Costs, Memory

    schedule = build_schedule("1f1b", 2, 4)
    ran = simulate(schedule, Costs(forward=[0.002, 0.003], backward=[0.004, 0.006], memory=Memory(activation=3e5)))
    measured = dataclasses.replace(ran, unit="s", measured=True, label="1f1b measured")
    return measured, simulate(schedule, Costs.from_timeline(measured))


def test_a_timeline_simulated_from_measured_costs_is_in_their_seconds() -> None:
    measured, predicted = measured_and_predicted()
    assert predicted.unit == "s" and predicted.makespan == pytest.approx(measured.makespan)
    assert simulate(build_schedule("1f1b", 2, 4)).unit == ""  # unit costs: cost units


def test_measured_and_predicted_are_drawn_in_one_unit_ms_and_mib_on_one_time_axis(tmp_path: Path) -> None:
    measured, predicted = measured_and_predicted()
    figure = plot_timelines([measured, predicted], str(tmp_path / "both.png"), titles=["measured", "predicted"])
    axes = figure.axes
    assert axes[-1].get_xlabel() == "time (ms)"
    titles = [axis.get_title(loc="left") for axis in axes]
    assert all(title.endswith(" ms") for title in titles), titles
    assert axes[0].get_xlim() == axes[1].get_xlim() == pytest.approx((0, 1e3 * measured.makespan))
    peaks = [text.get_text() for axis in axes for text in axis.texts if text.get_text().startswith("peak ")]
    assert len(peaks) == 4 and all(peak.endswith(" MiB") for peak in peaks), peaks  # never raw bytes


def test_timelines_in_seconds_and_in_cost_units_are_not_drawn_on_one_axis(tmp_path: Path) -> None:
    measured, _ = measured_and_predicted()
    with pytest.raises(ValueError, match="one time unit"):
        plot_timelines([measured, simulate(build_schedule("1f1b", 2, 4))], str(tmp_path / "mixed.png"))
