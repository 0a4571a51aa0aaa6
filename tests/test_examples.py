"""Each example runs to completion in a reduced mode."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.timeout(120)
def test_quickstart_trains_and_prints_the_loss() -> None:
    command = [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(line.split()[3]) for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
