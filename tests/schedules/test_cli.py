import subprocess
import sys
from pathlib import Path


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
    assert result.returncode == 2 and "invalid choice" in result.stderr
