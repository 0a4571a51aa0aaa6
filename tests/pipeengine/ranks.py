"""What a test worker needs of its world, in-process (loopback threads) or in real processes (torch.distributed)."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from pipeengine.comm.base import Transport
from pipeengine.comm.connect import connect
from pipeengine.comm.loopback import current

Test = TypeVar("Test", bound=Callable[..., None])


def world() -> Transport:
    """This rank's world: the thread's loopback world, else the default process group (on NCCL, the current CUDA
    device: a CUDA test's ranks join NCCL, which moves CUDA tensors only)."""
    return current() or connect(None, None, 60.0)


def rank() -> int:
    return world().rank


def size() -> int:
    return world().size


def all_gather_object(value: object) -> list[Any]:
    return world().all_gather_object(value, "a test's all_gather_object")


def barrier() -> None:
    world().barrier("a test's barrier")


def on_ranks(
    n: int | str, *, timeout: float = 120.0, in_process: bool = False, device: str | None = None
) -> Callable[[Test], Test]:
    """Run the decorated test's own body on each of ``n`` ranks, as torch's MultiProcessTestCase runs a test method:
    pytest calls the test here, which launches its body (real gloo processes, or ``in_process`` threads; ``device``:
    launch's, "cuda" for a GPU each) with the fixtures and parameters pytest gave it; a failure on any rank fails the
    test, naming the rank that caused it (pipeengine.launch), its asserts rewritten as pytest rewrites them (a failing
    one shows its values, on a process rank too). The body is the function under the decorator, in its
    test file, reached on each rank by its module and name::

        @on_ranks(2)
        def test_two_ranks_agree(tmp_path: Path) -> None:
            assert all_gather_object(rank()) == [0, 1]

    ``timeout`` is launch's: how long a rank may wait on its peers (a collective, a message) before the test fails
    naming it. A rank that hangs while no peer waits on it is bounded by the test's pytest-timeout mark: put one above
    the decorator. In-process ranks are threads of one process, sharing torch's default random generator: draw a
    test's data from a torch.Generator of its own.

    ``n`` a parameter's name: as many ranks as that parameter of the test says (one test over world sizes)::

        @pytest.mark.parametrize("world", [2, 4])
        @on_ranks("world")
        def test_every_rank_counts(world: int) -> None:
            assert size() == world
    """

    def decorate(body: Test) -> Test:
        if isinstance(n, str) and n not in inspect.signature(body).parameters:
            raise TypeError(f"on_ranks({n!r}): {body.__name__} has no parameter {n!r} to take the number of ranks from")

        @functools.wraps(body)
        def test(*args: Any, **kwargs: Any) -> None:
            from pipeengine import launch

            where = (body.__module__, body.__name__, args, kwargs)
            ranks = kwargs[n] if isinstance(n, str) else n
            launch(_body, ranks, args=where, timeout=timeout, in_process=in_process, device=device)

        return test  # type: ignore[return-value]

    return decorate


def _body(module: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """On a rank: the body under the test's decorator (functools.wraps keeps it as __wrapped__)."""
    getattr(_imported(module), name).__wrapped__(*args, **kwargs)


def _imported(name: str) -> ModuleType:
    """The test module, imported as pytest imports it: with its asserts rewritten, so that a failing assert on a
    process rank shows its values as it would in the pytest process (a thread rank finds the module pytest
    imported; pytest's rewriting is its own: _pytest.assertion.rewrite)."""
    from _pytest.assertion.rewrite import rewrite_asserts

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or spec.loader is None:
        return importlib.import_module(name)
    source = Path(spec.origin).read_bytes()
    tree = ast.parse(source, spec.origin)
    rewrite_asserts(tree, source, spec.origin)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(compile(tree, spec.origin, "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module
