"""README.md and docs/ stay true: every code block runs (tests/docs_blocks.py says how), the site builds strictly, its
pictures exist, and CI installs exactly as the README says."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import io
import json
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
from tests.pipeengine.ranks import on_ranks

BLOCKS = [block for block in every_block() if block.language in ("python", "bash")]
SKIPS = {  # each block not run, by page: the reason is in the page
    "docs/getting-started.md": 2,  # the Quickstart's install line (checked against .ci/run below); the CUDA install
    "docs/guides/launching.md": 3,  # torchrun's own command line; two machines; a dry run through the environment
    "docs/guides/layout.md": 1,  # a hardware description measured on GPUs (test_cuda runs it on one)
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
    assert kinds <= {"run", "in-process", "in", "skip", "is"} | {k for k in kinds if k.startswith("tests/")}, kinds
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
@on_ranks(2, timeout=120)
def test_the_tensor_parallel_and_fsdp_fragments_run_on_two_gloo_ranks(tmp_path: Path) -> None:
    """DTensor and FSDP2 need torch.distributed: one launch of real ranks runs them all, one after another."""
    codes = [block.code for block in of("in") if block.directive == "in gloo"]
    assert len(codes) >= 2
    run_fragments(codes, "gloo", str(tmp_path))


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
        words = shlex.split(line)
        assert words[0] == "python" and words[1].startswith("examples/"), f"{block.name}: {line}"
        assert Path(words[1]).stem in source, f"{file} does not run {words[1]}"
        for word in words[2:]:
            if word.startswith("--"):
                assert f'"{word}"' in source, f"{file} never passes {word} (from {block.name})"


def test_no_page_needs_the_site_to_read_right() -> None:
    """GitHub shows a page as it is: no include markers (pymdownx.snippets's); a program shown whole is a copy of
    its file, kept equal here (tests/test_examples.py runs the file)."""
    for page in pages():
        assert "--8<--" not in page.read_text(), f"{page.relative_to(ROOT)}: GitHub shows an include marker raw"
    copies = {block.name: block.directive.split()[1] for block in BLOCKS if kind(block) == "is"}  # type: ignore[union-attr]
    assert {"examples/train_loop.py", "examples/generate_hf.py"} <= set(copies.values()), copies
    examples = (ROOT / "tests" / "test_examples.py").read_text()
    for block in of("is"):
        file = copies[block.name]
        assert block.code == (ROOT / file).read_text(), f"{block.name} is no longer {file}: copy the file in again"
        assert f'"{Path(file).stem}"' in examples, f"tests/test_examples.py does not run {file}"


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


PLANNER = json.loads((ROOT / "docs" / "bench" / "tune_layout.json").read_text())  # the committed run's figures


def test_the_layout_planners_table_is_the_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's and docs/benchmarks.md's table of measured layouts is what benchmarks/tune_layout.py wrote, and
    docs/bench/tune_layout.md is the table of the committed run's json."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    table = (ROOT / "docs" / "bench" / "tune_layout.md").read_text()
    assert table == importlib.import_module("tune_layout").markdown(PLANNER["rows"])
    assert table in (ROOT / "README.md").read_text() and table in (ROOT / "docs" / "benchmarks.md").read_text()


def planner_figures() -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """Each figure the docs quote from the layout planner's benchmark: the ways a page words it (patterns over the
    page's text, its lines joined; a pattern's groups are the figures, each the first of those expected) and what
    the committed docs/bench/tune_layout.json says they are, as the pages round them."""
    run, rows, searched = PLANNER, PLANNER["rows"], PLANNER["search_seconds"]
    best, ratios = rows[0], [row["measured_peak_mib"] / row["predicted_peak_mib"] for row in rows]
    *others, last = [str(row["predicted_rank"]) for row in rows if row["contender"]]
    held = r"\*\*{}\*\*: held in this run \({}([\d.]+)%\)"  # docs/benchmarks.md's targets
    return {
        "rows timed": (
            [r"(\d+) of (\d+) (?:priced )?layouts built and timed", r"(\d+) candidates spread over the ranking"],
            (str(len(rows)), str(run["candidates"])),
        ),
        "predicted best": (
            [r"predicted best \(([\w-]+), (\[[\d, ]+\])\)"],
            (best["schedule"].upper(), str(best["partition"])),
        ),
        "best slower": (
            [
                r"predicted best[^.;]*? measured ([\d.]+)% slower than the measured best",
                held.format("The predicted best within 5% of the measured best", r"\+"),
            ],
            (f"{run['predicted_best_slower'] * 100:.1f}",),
        ),
        "median error": (
            [r"median step-time error was ([\d.]+)%", held.format("Median step-time error under 10%", "")],
            (f"{run['median_abs_error'] * 100:.1f}",),
        ),
        "largest error": ([r"\(largest:? ([\d.]+)%"], (f"{max(abs(row['error']) for row in rows) * 100:.0f}",)),
        "search": (
            [r"([\d.]+) s for 4 ranks(?:,? and |, \d+ candidates; )([\d.]+) s for 8"],
            (f"{searched['4']:.2f}", f"{searched['8']:.2f}"),
        ),
        "calibrating": ([r"tune_layout_calibration\.json`, ([\d.]+) s"], (f"{run['calibration_seconds']:.1f}",)),
        "measuring": ([r"after ([\d.]+) s measuring the layers"], (f"{run['measure_seconds']:.1f}",)),
        "peaks": ([r"measured / predicted ([\d.]+) to ([\d.]+)"], (f"{min(ratios):.3f}", f"{max(ratios):.3f}")),
        "limit": ([r"([\d.]+) MiB per rank, (\d+) kept"], (f"{run['memory_limit_mib']:.1f}", str(run["kept"]))),
        "contenders": ([r"here predicted ranks ([\d, ]+ and \d+)\)"], (f"{', '.join(others)} and {last}",)),
    }


QUOTING = {  # the pages that quote the planner's benchmark, and the figures each must quote
    "README.md": {"rows timed", "predicted best", "best slower", "median error", "largest error", "search"},
    "docs/benchmarks.md": {
        "rows timed",
        "best slower",
        "median error",
        "search",
        "calibrating",
        "measuring",
        "limit",
        "contenders",
    },
    "docs/guides/layout.md": {
        "rows timed",
        "best slower",
        "median error",
        "largest error",
        "search",
        "measuring",
        "peaks",
    },
}


@pytest.mark.parametrize("page", sorted(QUOTING))
def test_a_planner_figure_a_page_quotes_is_the_committed_runs(page: str) -> None:
    """Every figure of the layout planner's benchmark that README.md, docs/benchmarks.md or the layout guide quotes
    equals docs/bench/tune_layout.json's (the run whose table and plot are committed beside it); none goes unquoted.
    Earlier runs are docs/benchmarks.md's table of runs, in other words."""
    text = " ".join((ROOT / page).read_text().split())
    quoted = set()
    for figure, (patterns, expected) in planner_figures().items():
        for pattern in patterns:
            for match in re.finditer(pattern, text):
                quoted.add(figure)
                got = match.groups()
                assert got == expected[: len(got)], f"{page} quotes {figure} {got}: the committed run's is {expected}"
    assert QUOTING[page] <= quoted, f"{page} no longer quotes {QUOTING[page] - quoted} as tests/test_docs.py reads it"


@pytest.mark.timeout(120)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "guides" / "schedules.html").is_file()
    # browsable from disk: every link of every page (its navigation included) names a file, not a folder
    for page in set(tmp_path.rglob("*.html")) - {tmp_path / "404.html"}:  # 404.html: a server's, its links absolute
        links = re.findall(r'(?:href|src)="([^"]+)"', page.read_text())
        local = [link.split("#")[0].split("?")[0] for link in links if ":" not in link and not link.startswith("#")]
        folders = [link for link in local if link and not (page.parent / link).is_file()]
        assert local and not folders, (page.relative_to(tmp_path), folders)


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
    said = re.search(
        r"The schedule alone leaves ([\d.]+)% \(`python -m schedules simulate (\S+) -p (\d+) -m (\d+)`", readme
    )
    assert said is not None, "the README's API screen says no bubble to expect"
    figure, schedule, ranks, microbatches = said.groups()
    assert f'schedule="{schedule}"' in block.code and f"nprocs={ranks}" in block.code, (schedule, ranks)
    assert f"num_microbatches={microbatches}" in block.code, microbatches
    bubble = simulate(build_schedule(schedule, int(ranks), int(microbatches))).bubble_fraction
    assert figure == f"{bubble:.1%}"[:-1], (figure, bubble)
