"""README.md stays true: CI runs its Quickstart, and its commands exist."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def quickstart_lines() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md's Quickstart has no ```bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_ci_installs_and_tests_exactly_as_the_quickstart_says() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert quickstart_lines()[0] in ci
