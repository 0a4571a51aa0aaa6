"""README.md and docs/ stay true: every code block runs (tests/docs_blocks.py says how), the site builds strictly, its
pictures exist, and CI installs exactly as the README says."""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from pipeengine import launch
from tests.docs_blocks import CONTEXTS, ROOT, Block, every_block, finetuned, pages

BLOCKS = [block for block in every_block() if block.language in ("python", "bash")]
SKIPS = {  # each block not run, by page: the reason is in the page
    "docs/getting-started.md": 2,  # the Quickstart's install line (checked against .ci/run below); the CUDA install
    "docs/guides/launching.md": 2,  # torchrun's own command line; two machines
    "README.md": 1,  # the developer's commands: pytest -n 2 (CI), mkdocs build (below), ruff and mypy
}


def kind(block: Block) -> str:
    assert block.directive, f"{block.name}: a ```{block.language} block needs a <!-- test: ... --> line before it"
    return block.directive.split()[0]


def of(kind_: str) -> list[Block]:
    return [block for block in BLOCKS if kind(block) == kind_]


def ids(blocks: list[Block]) -> list[str]:
    return [block.name for block in blocks]


def test_every_block_says_how_it_is_tested_and_only_the_known_ones_are_skipped() -> None:
    languages = {block.language for block in every_block()}
    assert languages <= {"python", "bash", "text"}, languages
    kinds = {kind(block) for block in BLOCKS}  # each asserts its directive
    assert kinds <= {"run", "in-process", "in", "skip"} | {k for k in kinds if k.startswith("tests/")}, kinds
    skipped: dict[str, int] = {}
    for block in of("skip"):
        assert len(block.directive.split()) > 4, f"{block.name}: say why it is not run"  # type: ignore[union-attr]
        skipped[str(block.path.relative_to(ROOT))] = skipped.get(str(block.path.relative_to(ROOT)), 0) + 1
    assert skipped == SKIPS


def test_ci_installs_and_tests_exactly_as_the_readme_and_getting_started_say() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    readme = next(block for block in BLOCKS if block.path.name == "README.md" and block.language == "bash")
    started = next(block for block in of("skip") if block.path.name == "getting-started.md")
    assert readme.code.splitlines()[0] in ci
    assert started.code.strip() == readme.code.splitlines()[0]


@pytest.mark.parametrize("block", of("run"), ids=ids(of("run")))
def test_a_block_runs_as_it_is(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # examples.train_gpt:planning
    if block.language == "python":
        exec(compile(block.code, block.name, "exec"), {"__name__": "__doc__"})
        return
    commands = [line.split("  #")[0].strip() for line in block.code.splitlines() if line.strip()]
    assert all(command.startswith("python -m ") for command in commands), commands
    for command in commands:  # in order, in one folder: a file one writes, the next reads
        module, *argv = shlex.split(command)[2:]
        monkeypatch.setattr(sys, "argv", [module, *argv])
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exited, warnings.catch_warnings():
            warnings.filterwarnings("ignore", "'pipeengine.tune' found in sys.modules", RuntimeWarning)  # imported
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            raise SystemExit(0)
        assert exited.value.code in (0, None), (command, exited.value.code)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", of("in-process"), ids=ids(of("in-process")))
def test_a_program_runs_on_in_process_ranks(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeengine

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pipeengine, "launch", functools.partial(launch, in_process=True, timeout=60))
    exec(compile(block.code, block.name, "exec"), {"__name__": "__main__"})


def run_fragments(codes: list[str], context: str, folder: str) -> None:
    """On each rank: every fragment in turn, each in a fresh CONTEXT, in ``folder`` (what they write lands there)."""
    import os

    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)  # a launched rank starts where the fork server did: what a fragment writes goes here
    for number, code in enumerate(codes):
        names = CONTEXTS[context]()
        exec(compile(code, f"<{context} fragment {number}>", "exec"), names)


FRAGMENTS = [block for block in of("in") if block.directive != "in gloo" and block.directive != "in finetuned"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", FRAGMENTS, ids=ids(FRAGMENTS))
def test_a_fragment_runs_on_two_in_process_ranks(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    context = block.directive.split()[1]  # type: ignore[union-attr]
    assert context in CONTEXTS, f"{block.name}: no context {context!r}; tests/docs_blocks.py has {sorted(CONTEXTS)}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    launch(run_fragments, 2, args=([block.code], context, str(tmp_path)), in_process=True, timeout=60)


@pytest.mark.timeout(180)
def test_the_tensor_parallel_and_fsdp_fragments_run_on_two_gloo_ranks(tmp_path: Path) -> None:
    """DTensor and FSDP2 need torch.distributed: one launch of real ranks runs them all, one after another."""
    codes = [block.code for block in of("in") if block.directive == "in gloo"]
    assert len(codes) >= 2
    launch(run_fragments, 2, args=(codes, "gloo", str(tmp_path)), timeout=120)


def test_generating_from_a_finetuned_folder_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # finetune_hf imports train_gpt, as a script's neighbour
    monkeypatch.syspath_prepend(str(ROOT))
    (block,) = [block for block in of("in") if block.directive == "in finetuned"]
    names = finetuned(tmp_path / "finetuned")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.code, block.name, "exec"), names)
    assert out.getvalue().startswith("def "), out.getvalue()


TESTED = [block for block in BLOCKS if kind(block).startswith("tests/")]


@pytest.mark.parametrize("block", TESTED, ids=ids(TESTED))
def test_a_block_run_by_a_named_test_is_what_that_test_runs(block: Block) -> None:
    file, name = block.directive.split("::")  # type: ignore[union-attr]
    source = (ROOT / file).read_text()
    assert name in {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}, name
    ci = (ROOT / ".ci" / "run").read_text()
    for line in block.code.splitlines():
        line = line.split("  #")[0].strip()
        if not line or line in ci:
            continue
        include = re.fullmatch(r'--8<-- "(.+)"', line)
        if include:
            assert (ROOT / include.group(1)).is_file() and Path(include.group(1)).stem in source, line
            continue
        words = shlex.split(line)
        assert words[0] == "python" and words[1].startswith("examples/"), f"{block.name}: {line}"
        assert Path(words[1]).stem in source, f"{file} does not run {words[1]}"
        for word in words[2:]:
            if word.startswith("--"):
                assert f'"{word}"' in source, f"{file} never passes {word} (from {block.name})"


def test_the_pictures_they_show_exist() -> None:
    for page in pages():
        pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text())
        assert all((page.parent / picture).is_file() for picture in pictures), (page, pictures)


def test_the_readme_is_short_and_links_every_guide() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    guides = {f"docs/{page.relative_to(ROOT / 'docs')}" for page in pages()[1:] if "bench" not in page.parts}
    linked = set(re.findall(r"\]\((docs/[^)#]+)\)", readme))
    assert guides <= linked, guides - linked


def test_the_layout_planners_table_is_the_benchmarks() -> None:
    """The README's and docs/benchmarks.md's table of measured layouts is what benchmarks/tune_layout.py wrote."""
    table = (ROOT / "docs" / "bench" / "tune_layout.md").read_text()
    assert table in (ROOT / "README.md").read_text() and table in (ROOT / "docs" / "benchmarks.md").read_text()


@pytest.mark.timeout(120)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=110, env={"NO_MKDOCS_2_WARNING": "1",
                           "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "guides" / "schedules" / "index.html").is_file()


def test_the_home_page_leads_to_what_a_new_user_looks_for_first() -> None:
    """The site's first page links each of these (mkdocs --strict checks that the links and anchors exist)."""
    home = (ROOT / "docs" / "index.md").read_text()
    wanted = {
        "install on CPU or GPU": "getting-started.md#install",
        "feed data to each replica": "guides/fsdp.md#replicas-of-the-pipeline",
        "log throughput, memory and the bubble": "recipes.md#a-training-loop",
        "resume after a crash": "guides/checkpoints.md",
        "read the grid notation": "guides/schedules.md",
    }
    for need, page in wanted.items():
        row = next((line for line in home.splitlines() if need in line), None)
        assert row is not None and f"]({page})" in row, (need, page, row)


def test_the_readme_says_the_bubble_its_api_screen_leaves_to_the_schedule() -> None:
    """The bubble the README tells a reader of its API screen to expect: its schedule's own (as
    ``python -m schedules simulate`` prints it) for the ranks and micro-batches the block runs, computed here."""
    from schedules import build_schedule, simulate

    readme = (ROOT / "README.md").read_text()
    block = next(block for block in BLOCKS if block.path.name == "README.md" and kind(block) == "in-process")
    said = re.search(r"The schedule alone leaves ([\d.]+)% \(`python -m schedules simulate (\S+) -p (\d+) -m (\d+)`",
                     readme)  # fmt: skip
    assert said is not None, "the README's API screen says no bubble to expect"
    figure, schedule, ranks, microbatches = said.groups()
    assert f'schedule="{schedule}"' in block.code and f"nprocs={ranks}" in block.code, (schedule, ranks)
    assert f"num_microbatches={microbatches}" in block.code, microbatches
    bubble = simulate(build_schedule(schedule, int(ranks), int(microbatches))).bubble_fraction
    assert figure == f"{bubble:.1%}"[:-1], (figure, bubble)
