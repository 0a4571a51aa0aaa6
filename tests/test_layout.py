"""The layout shows the design: each package's folders are layers, imports run one way, and no module imports
itself back through others (typing-only imports aside: they never run). The tests keep each test's body in the file
that names it, share helpers that import no test module, and run the one-process reference in one place."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest
import torch
from torch import nn

from tests.pipeengine.ranks import on_ranks

ROOT = Path(__file__).parent.parent

# lowest first: a module imports from its own folder or from folders strictly below it; "" is the package's top
LAYERS = {
    "schedules": [["ir"], ["proof"], ["sim"], ["passes"], ["compilers"], [""]],
    "pipeengine": [
        ["errors"],
        ["core"],
        ["comm"],
        ["launcher", "observe"],
        ["parallel"],
        ["step"],
        ["construction"],
        ["train", "hf"],
        ["planner"],
        [""],
    ],
}


def module_name(package: str, path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The modules of this project a file imports when it runs (at import time or in a function)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` blocks never run
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # a submodule imported by name
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def graph(package: str) -> dict[str, set[str]]:
    files = {module_name(package, p): p for p in (ROOT / package).rglob("*.py")}
    return {name: {m for m in imports(path) if m in files and m != name} for name, path in files.items()}


def folder(package: str, module: str) -> str:
    parts = module.split(".")[1:]
    if len(parts) > 1 or (parts and (ROOT / package / parts[0]).is_dir()):
        return parts[0]
    return "errors" if parts == ["errors"] else ""


@pytest.mark.parametrize("package", [*sorted(LAYERS), "tests"])
def test_no_module_imports_itself_back(package: str) -> None:
    edges = graph(package)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for child in sorted(edges[node]):
            if state.get(child) == 1:
                raise AssertionError(f"import circle: {' -> '.join(path[path.index(child) :] + [child])}")
            if child not in state:
                visit(child)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_imports_run_down_the_layers(package: str) -> None:
    rank = {name: level for level, names in enumerate(LAYERS[package]) for name in names}
    wrong = []
    for module, targets in graph(package).items():
        mine = folder(package, module)
        assert mine in rank, f"{module} is in folder {mine!r}, which no layer of {package} names"
        for target in targets:
            theirs = folder(package, target)
            if theirs != mine and rank[theirs] >= rank[mine] and not (mine == "" and theirs == ""):
                wrong.append(f"{module} ({mine or 'top'}) imports {target} ({theirs or 'top'})")
    assert not wrong, "\n".join(wrong)


def test_nothing_outside_the_planner_imports_it_and_importing_pipeengine_loads_none_of_it() -> None:
    """The planner (search, pricing, calibration, the CPU host model) sits above everything the engine runs: outside
    planner/ only the top's tune (its command) and auto (schedule="auto", asked inside a function) import it, and
    ``import pipeengine`` loads no planner module."""
    importers = sorted(
        module
        for module, targets in graph("pipeengine").items()
        if folder("pipeengine", module) != "planner"
        and any(folder("pipeengine", target) == "planner" for target in targets)
    )
    assert importers == ["pipeengine.auto", "pipeengine.tune"], importers
    auto = ast.parse((ROOT / "pipeengine" / "auto.py").read_text())
    at_top = [node for node in auto.body if isinstance(node, ast.Import | ast.ImportFrom)]
    assert not [ast.unparse(node) for node in at_top if "pipeengine.planner" in ast.unparse(node)]
    code = "import pipeengine, sys; print(sorted(m for m in sys.modules if m.startswith('pipeengine.planner')))"
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    assert run.stdout.strip() == "[]", run.stdout + run.stderr


def test_the_facade_reads_as_a_table_of_contents() -> None:
    """engine.py delegates each job to the module that owns it: at most 130 statements (117 now), counted from its
    syntax tree, so that the format's line breaks do not count."""
    tree = ast.parse((ROOT / "pipeengine" / "engine.py").read_text())
    assert sum(isinstance(node, ast.stmt) for node in ast.walk(tree)) <= 130


def _modules(package: str = "pipeengine") -> dict[str, ast.Module]:
    return {module_name(package, p): ast.parse(p.read_text()) for p in sorted((ROOT / package).rglob("*.py"))}


def test_gradient_syncs_are_asked_nothing_of_their_kind_outside_their_module() -> None:
    """One protocol (pipeengine.parallel.gradsync): no module tests which sync it holds; each sync's class is named
    only by its own module and the one that makes a rank's syncs (pipeengine.parallel)."""
    trees = _modules()
    homes = {}  # class -> the module defining it
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            if node.name == "GradientSync" or any(ast.unparse(base) == "GradientSync" for base in node.bases):
                homes[node.name] = module
    subclasses = set(homes)
    assert {"ReplicaMean", "ShardedReduce", "TieSum"} <= subclasses, sorted(subclasses)
    wrong = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2:
                named = {
                    n.id if isinstance(n, ast.Name) else n.attr
                    for n in ast.walk(node.args[1])
                    if isinstance(n, ast.Name | ast.Attribute)
                }
                for name in named & subclasses:
                    if homes.get(name) != module:
                        wrong.append(f"{module}: {ast.unparse(node)}")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeengine"):
                for alias in node.names:
                    if alias.name in subclasses - {"GradientSync"} and module != "pipeengine.parallel":
                        wrong.append(f"{module} imports {alias.name}")
    assert not wrong, "\n".join(wrong)


def test_the_step_path_runs_down_and_never_into_construction() -> None:
    """engine -> stepper -> executor -> mailbox -> transport: nothing a step runs imports the construction folder,
    directly or through another module; the program cache is the runtime's."""
    edges = graph("pipeengine")
    start = ["pipeengine.step.stepping", "pipeengine.train.tracing", "pipeengine.step.executor"]
    seen, todo = set(start), list(start)
    while todo:
        for child in edges[todo.pop()]:
            if child not in seen:
                seen.add(child)
                todo.append(child)
    assert {"pipeengine.step.mailbox", "pipeengine.step.stepping"} <= seen
    assert not [m for m in seen if folder("pipeengine", m) == "construction"], sorted(seen)
    programs = _modules()["pipeengine.step.stepping"]
    assert "Programs" in {node.name for node in ast.walk(programs) if isinstance(node, ast.ClassDef)}


STEP_FOLDERS = ("", "step", "core", "comm")  # an untraced step: the engine, the step folder, core/ and the transport


def entered(call: Callable[[], object]) -> set[str]:
    """The pipeengine modules whose functions ``call`` runs, on this thread."""
    found: set[str] = set()

    def watch(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and str(frame.f_globals.get("__name__", "")).startswith("pipeengine"):
            found.add(frame.f_globals["__name__"])

    sys.setprofile(watch)
    try:
        call()
    finally:
        sys.setprofile(None)
    return found


@on_ranks(2, in_process=True, timeout=60)
def test_an_untraced_step_stays_in_the_step_folder() -> None:
    """engine -> step/ -> transport: an untraced 1F1B training step on 2 ranks enters the engine, step/, core/ and
    comm/ alone (no tracing, no gradient-sync protocol without syncs, no FSDP without FSDP, no call back into the
    engine for its parameters, no autocast in full precision), at most 10 modules, the transport's included; a
    traced step enters the tracing (train/, observe/), so this check sees what it looks for."""
    from pipeengine import PipelineEngine

    torch.manual_seed(0)
    engine = PipelineEngine(
        nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), nn.functional.mse_loss, num_microbatches=2
    )
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    engine.train_step(x, y)  # the first step infers the boundaries and builds the program
    untraced = entered(lambda: engine.train_step(x, y))
    outside = sorted(m for m in untraced if folder("pipeengine", m) not in STEP_FOLDERS)
    assert not outside, f"an untraced step entered {outside}"
    assert len(untraced) <= 10, sorted(untraced)  # the transport's modules (comm/) too
    with engine.tracing():
        traced = entered(lambda: engine.train_step(x, y))
    assert {"pipeengine.train.tracing", "pipeengine.observe.trace"} <= traced


def test_the_step_folder_knows_fsdp_only_through_the_protocols_it_is_handed() -> None:
    """A sharded stage's gather and its forward's context come in as step.stage.Sharding (made by parallel.fsdp at
    construction), its gradient syncs as parallel.gradsync's protocol: no module of step/ imports parallel.fsdp."""
    edges = graph("pipeengine")
    step = [module for module in edges if folder("pipeengine", module) == "step"]
    assert step and not [module for module in step if "pipeengine.parallel.fsdp" in edges[module]]


# each parallelism's machinery (torch's modules for it) is imported by its own home alone
HOMES = {
    "torch.distributed.fsdp": "pipeengine.parallel.fsdp",
    "torch.distributed.tensor.parallel.parallelize_module": "pipeengine.parallel.tensor",
    "torch.distributed.device_mesh": "pipeengine.parallel.tensor",
    "torch.distributed.checkpoint": "pipeengine.parallel.fsdp_checkpoint",
}


def test_each_parallelism_has_one_home() -> None:
    wrong = []
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            found = []
            if isinstance(node, ast.ImportFrom) and node.module:
                found = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            for name in found:
                for machinery, home in HOMES.items():
                    if (name == machinery or name.startswith(machinery + ".")) and module != home:
                        wrong.append(f"{module} imports {name}: {home} owns it")
    assert not wrong, "\n".join(wrong)
    for folder_name in ("build",):  # a package folder named build/ is what packaging's .gitignore rule hides
        assert not (ROOT / "pipeengine" / folder_name).exists()


# ---- the tests' own layout

PARITY = "tests/pipeengine/parity.py"  # the one module that runs the one-process reference (see below)


def modules_with_tests() -> list[Path]:
    return sorted((ROOT / "tests").rglob("test_*.py"))


def launch_calls(tree: ast.AST, names: frozenset[str] = frozenset({"launch"})) -> list[ast.Call]:
    """The calls of launch in ``tree``: by any of ``names`` (launch, and what a file imports it as), or as an
    attribute (pipeengine.launch)."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id in names)
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "launch")
        )
    ]


def launched_function(call: ast.Call) -> ast.expr | None:
    """What a launch call runs: its first argument, or its fn=."""
    return call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "fn"), None)


def launched(tree: ast.AST) -> list[tuple[int, ast.expr]]:
    """(line, the function argument) of every launch(fn, ...) call in ``tree``."""
    return [(call.lineno, fn) for call in launch_calls(tree) if (fn := launched_function(call)) is not None]


def scripts(tree: ast.AST) -> list[tuple[int, ast.Module]]:
    """The Python scripts a test file writes out and runs (string constants that parse and call launch)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):  # an f-string: its placeholders stand for values
            text = "".join(v.value if isinstance(v, ast.Constant) else "None" for v in node.values)  # type: ignore[misc]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if "launch(" not in text:
            continue
        try:
            found.append((node.lineno, ast.parse(text)))
        except SyntaxError:
            continue
    return found


def test_every_launched_function_is_defined_in_the_test_file_that_launches_it() -> None:
    """A test's body, the function its ranks run, sits beside it in the file that names the test (shared helpers it
    calls may live elsewhere): launch(fn, ...) in tests/**/test_*.py names a function defined in that file (at its
    top, or in the test), and a script it writes out defines the function it launches or imports it from that file."""
    wrong = []
    for path in modules_with_tests():
        tree = ast.parse(path.read_text())
        here = module_name("tests", path)
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        for line, fn in launched(tree):
            if not (isinstance(fn, ast.Name) and fn.id in defined):
                wrong.append(f"{path.relative_to(ROOT)}:{line} launches {ast.unparse(fn)}, not defined in this file")
        for line, script in scripts(tree):
            own = {node.name for node in ast.walk(script) if isinstance(node, ast.FunctionDef)}
            own |= {
                alias.asname or alias.name
                for node in ast.walk(script)
                if isinstance(node, ast.ImportFrom) and node.module == here
                for alias in node.names
            }
            for _, fn in launched(script):
                if not (isinstance(fn, ast.Name) and fn.id in own):
                    wrong.append(
                        f"{path.relative_to(ROOT)}:{line}: its script launches {ast.unparse(fn)}, not "
                        f"imported from {here}"
                    )
    assert not wrong, "\n".join(wrong)


PATCHING = {"monkeypatch", "capsys", "capfd"}  # fixtures that change the pytest process a launch runs from


def test_a_test_that_only_launches_its_body_runs_it_under_on_ranks() -> None:
    """A test whose one launch, its last statement, runs a function of its file outside pytest.raises (and patches
    nothing of the pytest process around it) is what tests.pipeengine.ranks.on_ranks is for: its body under the
    decorator, one test, one function. launch stays where the launch is what is tested (its error), where a test
    launches several worlds, or works in the pytest process around the world. launch is found by any name the file
    imports it as, as the last statement or returned (a trailing pass aside), in a test function or a test class."""
    wrong = []
    for path in modules_with_tests():
        tree = ast.parse(path.read_text())
        top = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        names = frozenset({"launch"}) | {
            alias.asname
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipeengine")
            for alias in node.names
            if alias.name == "launch" and alias.asname
        }
        classes = [node.body for node in tree.body if isinstance(node, ast.ClassDef) and node.name.startswith("Test")]
        for test in [statement for body in (tree.body, *classes) for statement in body]:
            if not (isinstance(test, ast.FunctionDef) and test.name.startswith("test_")):
                continue
            calls = launch_calls(test, names)
            body = [statement for statement in test.body if not isinstance(statement, ast.Pass)]
            last = body[-1] if body else None
            only_last = len(calls) == 1 and isinstance(last, (ast.Expr, ast.Return)) and last.value is calls[0]
            fn = launched_function(calls[0]) if only_last else None
            if (
                isinstance(fn, ast.Name)
                and fn.id in top
                and not PATCHING & {argument.arg for argument in test.args.args}
            ):
                wrong.append(f"{path.relative_to(ROOT)}::{test.name} launches {fn.id}: use @on_ranks")
    assert not wrong, "\n".join(wrong)


@on_ranks(2, timeout=30)
def rank_one_fails() -> None:  # not a test: the one below runs it
    value = 10 * torch.distributed.get_rank()
    assert value == 0


@pytest.mark.timeout(60)
def test_a_failing_assert_on_a_process_rank_shows_its_values_as_pytest_does() -> None:
    """on_ranks imports the test module on a process rank with pytest's assert rewriting: the error names the values
    (a bare assert there would say only AssertionError)."""
    with pytest.raises(AssertionError, match=r"assert 10 == 0"):
        rank_one_fails()


def test_the_longest_tests_conftest_starts_first_exist() -> None:
    """tests/conftest.py's LONGEST (the tests started first, so that the workers end together): each entry names a
    test function that its file defines (a renamed test would silently lose its place, and the suite its balance)."""
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    (longest,) = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "LONGEST" for t in node.targets)
    ]
    names = ast.literal_eval(longest)
    assert names, "LONGEST is empty"
    missing = []
    for name in names:
        path, _, prefix = name.partition("::")
        defined = (
            []
            if not (ROOT / path).is_file()
            else [
                node.name
                for node in ast.walk(ast.parse((ROOT / path).read_text()))
                if isinstance(node, ast.FunctionDef)
            ]
        )
        if not any(test.startswith(prefix) for test in defined):
            missing.append(name)
    assert not missing, f"tests/conftest.py's LONGEST names tests that do not exist: {missing}"


def test_no_module_of_the_tests_imports_a_test_module() -> None:
    """Shared helpers (models, ranks, the parity module) are helper modules; a test module imports them, never
    another test module (nor does a helper)."""
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for module in sorted(imports(path))
        if module.split(".")[-1].startswith("test_")
    ]
    assert not wrong, "\n".join(wrong)


def autograd_calls(tree: ast.AST) -> list[int]:
    """Lines that run autograd's backward: x.backward(...), torch.autograd.backward(...), torch.autograd.grad(...)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = ast.unparse(node.func)
            if node.func.attr == "backward" or name.endswith(("autograd.grad", "autograd.backward")):
                lines.append(node.lineno)
    return lines


def test_one_parity_helper_runs_the_one_process_reference() -> None:
    """At most one parity helper: a reference for an engine's gradients runs autograd's backward on one process, and
    only tests/pipeengine/parity.py calls it (OneProcess); every other test compares against that."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path.relative_to(ROOT).as_posix() != PARITY
        for line in autograd_calls(ast.parse(path.read_text()))
    ]
    assert not wrong, "autograd's backward outside " + PARITY + " (a parity helper of its own):\n" + "\n".join(wrong)
    assert autograd_calls(ast.parse((ROOT / PARITY).read_text())), f"{PARITY} runs no reference"


def test_the_design_page_names_only_what_the_tree_holds() -> None:
    """docs/design.md's layers: each folder of its tree exists in its package, and each module it names (``x.py``)
    exists there or, with a path, at that path: a module renamed or removed shows here, not in a reader's search."""
    text = (ROOT / "docs" / "design.md").read_text()
    tree = text[text.index("```text\nschedules/") : text.index("tests/  benchmarks/  examples/")]
    package, missing = "", []
    for line in tree.splitlines()[1:]:
        top = re.match(r"^(\w+)/\s", line)
        sub = re.match(r"^  (\w+)/\s", line)
        if top:
            package = top.group(1)
            missing += [] if (ROOT / package).is_dir() else [f"{package}/"]
        elif sub and not (ROOT / package / sub.group(1)).is_dir():
            missing.append(f"{package}/{sub.group(1)}/")
    sources = {path.name for folder in ("pipeengine", "schedules") for path in (ROOT / folder).rglob("*.py")}
    for name in sorted(set(re.findall(r"[\w/]+\.py\b", text))):
        if not ((ROOT / name).is_file() if "/" in name else name in sources):
            missing.append(name)
    assert not missing, f"docs/design.md names what the tree does not hold: {missing}"
