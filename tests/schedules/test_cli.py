import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "schedules", *args], capture_output=True, text=True, timeout=60)


def test_show_prints_the_grid() -> None:
    result = run("show", "1f1b", "--ranks", "4", "--microbatches", "8")
    assert result.returncode == 0
    assert result.stdout == (Path(__file__).parent.parent / "golden" / "1f1b_p4_m8.txt").read_text()


def test_validate_and_simulate() -> None:
    result = run("validate", "interleaved", "-p", "4", "-m", "8", "-v", "2")
    assert result.returncode == 0 and result.stdout.startswith("valid: interleaved: 4 ranks")
    result = run("simulate", "gpipe", "-p", "4", "-m", "8", "--diagram")
    assert result.returncode == 0
    assert "bubble fraction 0.2727" in result.stdout and "rank 3: .   .   .   3F0" in result.stdout


def test_bad_input_exits_2_with_the_reason() -> None:
    result = run("show", "interleaved", "-p", "4", "-m", "6", "-v", "2")
    assert result.returncode == 2 and "multiple of 4, got 6" in result.stderr
    result = run("show", "nope", "-p", "4", "-m", "6")
    assert result.returncode == 2 and "unknown schedule 'nope'; valid names: gpipe, 1f1b" in result.stderr
    result = run("show", "1f1b", "-p", "4")
    assert result.returncode == 2 and "needs --ranks and --microbatches" in result.stderr


def test_each_schedule_runs_its_own_chunks_by_default() -> None:
    result = run("show", "zb-v", "-p", "2", "-m", "2")  # once refused: the CLI defaulted every schedule to 1 chunk
    assert result.returncode == 0 and "2 chunk(s) per rank, 4 stages" in result.stdout
    assert "2 chunk(s) per rank" in run("validate", "interleaved", "-p", "2", "-m", "4").stdout


def test_a_schedule_written_as_text_is_read_back_and_validated(tmp_path: Path) -> None:
    text = run("show", "1f1b", "-p", "2", "-m", "3", "--text").stdout
    assert text.splitlines()[:5] == ["schedule 1f1b", "ranks 2", "microbatches 3", "chunks 1", "placement 0 1"]
    path = tmp_path / "mine.txt"
    path.write_text(text)
    assert run("validate", str(path)).stdout.startswith("valid: 1f1b: 2 ranks, 3 micro-batches")
    path.write_text(text.replace("0B2", "0B1", 1))  # a user's slip: a backward twice
    result = run("validate", str(path))
    assert result.returncode == 1 and "each instruction appears exactly once" in result.stderr


def test_a_compute_only_file_is_lowered_as_the_engine_lowers_it(tmp_path: Path) -> None:
    path = tmp_path / "order.txt"
    path.write_text(run("show", "1f1b", "-p", "2", "-m", "4", "--compute-only", "--text").stdout)
    result = run("validate", str(path))  # once refused: "0SF0 is missing", while the engine lowered the same file
    assert result.returncode == 0 and result.stdout.startswith("valid: 1f1b: 2 ranks, 4 micro-batches"), result


def test_sizes_given_beside_a_file_that_fixes_its_own_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "mine.txt"
    path.write_text(run("show", "1f1b", "-p", "2", "-m", "4", "--text").stdout)
    result = run("validate", str(path), "-p", "4", "-m", "8")  # once ignored in silence
    assert result.returncode == 2
    assert "schedule file, which fixes its own sizes, but --ranks 4 (the file: 2), --microbatches 8" in result.stderr
    assert run("validate", str(path), "-p", "2").returncode == 0  # the same sizes: nothing to refuse


def test_plot_and_show_write_under_out_making_the_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process: plot without -o writes out/<schedule>.png, not the current folder's top; -o makes missing folders;
    both print the path they wrote. show --text prints, or writes to -o."""
    from schedules.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["plot", "1f1b", "-p", "2", "-m", "2"]) == 0
    assert capsys.readouterr().out == "wrote out/1f1b.png\n"
    assert (tmp_path / "out" / "1f1b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", "gpipe", "-p", "2", "-m", "2", "-o", "figures/new/g.png"]) == 0
    assert capsys.readouterr().out == "wrote figures/new/g.png\n" and (tmp_path / "figures/new/g.png").is_file()
    assert main(["show", "1f1b", "-p", "2", "-m", "3", "--text"]) == 0
    printed = capsys.readouterr().out
    assert main(["show", "1f1b", "-p", "2", "-m", "3", "--text", "-o", "out/mine/1f1b.txt"]) == 0
    assert capsys.readouterr().out == "wrote out/mine/1f1b.txt\n"
    assert (tmp_path / "out/mine/1f1b.txt").read_text() == printed and printed.startswith("schedule 1f1b\n")
    assert main(["plot", "out/mine/1f1b.txt"]) == 0  # a schedule file: named after it
    assert capsys.readouterr().out == "wrote out/1f1b.png\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures", "out"]  # nothing else at the top
    (tmp_path / "taken").write_text("a file")
    assert main(["show", "1f1b", "-p", "2", "-m", "3", "-o", "taken/grid.txt"]) == 2
    assert "error: " in capsys.readouterr().err
