"""The layout shows the design: each package's folders are layers, imports run one way, and no module imports
itself back through others (typing-only imports aside: they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

# lowest first: a module imports from its own folder or from folders strictly below it; "" is the package's top
LAYERS = {
    "schedules": [["ir"], ["proof"], ["sim"], ["passes"], ["compilers"], [""]],
    "pipeengine": [["errors"], ["core"], ["comm"], ["launcher", "observe"], ["runtime"], ["planner"], ["build"],
                   ["train", "hf"], [""]],  # fmt: skip
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


@pytest.mark.parametrize("package", sorted(LAYERS))
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


def test_the_facade_reads_as_a_table_of_contents() -> None:
    assert len((ROOT / "pipeengine" / "engine.py").read_text().splitlines()) < 200
