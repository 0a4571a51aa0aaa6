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


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_schedules_and_partition_snippets_run() -> None:
    snippets = [
        block
        for block in code_blocks("python")
        if block.startswith(("from schedules", "import torch\nfrom torch import nn\nfrom pipeengine import plan"))
    ]
    assert len(snippets) == 2
    for snippet in snippets:
        exec(compile(snippet, "README.md", "exec"), {})


def test_the_schedules_commands_run(tmp_path: Path) -> None:
    import shlex
    import subprocess
    import sys

    commands = [
        line.split("#")[0].strip()
        for block in code_blocks("bash")
        for line in block.splitlines()
        if line.startswith("python -m schedules")
    ]
    assert len(commands) >= 4
    for command in commands:  # in order, in one folder: a file one writes, the next reads
        line = shlex.quote(sys.executable) + command.removeprefix("python")
        result = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert result.returncode == 0, (command, result.stderr)


def test_the_pictures_it_shows_exist() -> None:
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (ROOT / "README.md").read_text())
    assert pictures and all((ROOT / picture).is_file() for picture in pictures), pictures
