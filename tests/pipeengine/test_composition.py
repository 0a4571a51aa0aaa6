"""The composition matrix (tests/composition): every pair of feature levels that can go together, in configurations
checked against one process; the refused pairs asserted refused. Configurations share a world: one launch per world
size and kind of rank (threads where nothing needs torch.distributed)."""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

import pytest

from pipeengine import launch
from tests.composition import Config, matrix
from tests.composition.harness import build, engine_for, run
from tests.pipeengine import ranks

pytest.importorskip("transformers")
# imported here, before any launch, so that the ranks' fork server imports the Llama once for all (launch's PRELOAD)
importlib.import_module("transformers.models.llama.modeling_llama")


@functools.cache
def worlds() -> dict[str, tuple[bool, int, list[Config], list[tuple[Config, str]]]]:
    """The configurations by world (kind of rank, size), those that run and those refused: one launch each, so that
    the ranks start once and a region compiled by one configuration serves the next that compiles it (dynamo's
    cache is per process). Found at collection (pytest_generate_tests), not at import: each rank imports this
    module, and the matrix costs most of a second of CPU."""
    named: dict[str, tuple[bool, int, list[Config], list[tuple[Config, str]]]] = {}

    def world(config: Config) -> tuple[bool, int, list[Config], list[tuple[Config, str]]]:
        kind = "processes" if config.processes else "threads"
        return named.setdefault(f"{kind}-{config.world}", (config.processes, config.world, [], []))

    found = matrix()
    for config in found.running:
        world(config)[2].append(config)
    for config, message in found.refused:
        world(config)[3].append((config, message))
    return named


def ident(config: Config) -> str:
    """A configuration's name, from its levels alone: stable when others are added, removed or reordered."""
    c = config
    return (
        f"{c.schedule}-{c.data}-tp{c.tp}-tie_{c.tie}-{c.loss}-acc{c.accumulate}-{c.precision}-ckpt_{c.checkpoint}"
        f"-{c.after}-{c.model}-compile_{c.compile}"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each configuration its own test id (its world's name, then its levels), the configurations of a world in one
    xdist group: the world starts once, on one worker, for all its configurations that were selected."""
    if metafunc.function is test_each_configuration_trains_like_one_process_or_is_refused_with_its_message:
        params = [
            pytest.param(name, ident(config), id=f"{name}:{ident(config)}", marks=pytest.mark.xdist_group(name))
            for name, (_, _, configs, refusals) in sorted(worlds().items())
            for config in [*(c for c, _ in refusals), *configs]
        ]
        metafunc.parametrize("world_name, config_id", params)


def every(configs: list[Config], refusals: list[tuple[Config, str]], directory: str) -> None:
    """The refusals first (each on every rank), then each configuration against one process; each one done on every
    rank is written down (rank 0 appends its name to ``directory``/done) before the next starts."""
    done = Path(directory) / "done"
    for config, message in refusals:
        with pytest.raises(ValueError, match=message):
            engine_for(config, build(config))
        _done(done, config)
    for config in configs:
        try:
            run(config, f"{directory}/{ident(config)}")
        except Exception as error:
            error.add_note(f"in the composition matrix's configuration {ident(config)}")
            raise
        _done(done, config)


def _done(path: Path, config: Config) -> None:
    ranks.barrier()
    if ranks.rank() == 0:
        with path.open("a") as file:
            file.write(ident(config) + "\n")


_OUTCOMES: dict[str, dict[str, str]] = {}  # world -> configuration -> "" (passed) or why it failed


def outcomes(name: str, session: pytest.Session, directory: Path) -> dict[str, str]:
    """Run the world's selected configurations (once per worker: the first of its tests asks) and say how each did:
    those done on every rank passed; the one it stopped at failed with the error; any after it did not run. A world
    that fails after its last configuration (its ranks' exit) fails that configuration."""
    found = _OUTCOMES.get(name)
    if found is not None:
        return found
    selected = {
        item.callspec.params["config_id"]
        for item in session.items
        if hasattr(item, "callspec") and item.callspec.params.get("world_name") == name
    }
    processes, world, configs, refusals = worlds()[name]
    configs = [c for c in configs if ident(c) in selected]
    refusals = [(c, message) for c, message in refusals if ident(c) in selected]
    error = ""
    try:
        launch(every, world, args=(configs, refusals, str(directory)), timeout=360, in_process=not processes)
    except Exception as raised:  # noqa: BLE001  (reported by the configuration it stopped at)
        error = f"{type(raised).__name__}: {raised}\n" + "\n".join(getattr(raised, "__notes__", []))
    done = set((directory / "done").read_text().split()) if (directory / "done").exists() else set()
    order = [ident(c) for c, _ in refusals] + [ident(c) for c in configs]
    stopped = next((cid for cid in order if cid not in done), None)
    if stopped is None and error and order:  # every configuration done, the world failed after: not passed over
        stopped, error = order[-1], f"the world failed after its last configuration: {error}"
        done.discard(stopped)
    found = {
        cid: "" if cid in done else error if cid == stopped else f"not run: {stopped} of this world failed first"
        for cid in order
    }
    _OUTCOMES[name] = found
    return found


@pytest.mark.timeout(400)
def test_each_configuration_trains_like_one_process_or_is_refused_with_its_message(
    world_name: str, config_id: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One configuration of the matrix against one process (or refused with its documented message). Its world
    runs every selected configuration of it in one launch, on the first of their tests: `pytest -k` one id and
    only that configuration runs."""
    failed = outcomes(world_name, request.session, tmp_path_factory.mktemp(world_name))[config_id]
    if failed:
        pytest.fail(failed, pytrace=False)


def test_the_matrix_is_its_committed_table() -> None:
    """tests/composition/matrix.txt is the matrix as python -m tests.composition --pairs prints it: a change of
    factors, levels or refusals shows in a review as a diff of that file (regenerate it with that command)."""
    import contextlib
    import io
    import sys

    from tests.composition.__main__ import main

    printed = io.StringIO()
    argv = sys.argv
    sys.argv = ["tests.composition", "--pairs"]
    try:
        with contextlib.redirect_stdout(printed):
            main()
    finally:
        sys.argv = argv
    committed = (Path(__file__).parents[1] / "composition" / "matrix.txt").read_text()
    assert printed.getvalue() == committed, "run: python -m tests.composition --pairs > tests/composition/matrix.txt"


def test_the_matrix_covers_every_pair_that_can_go_together_as_the_design_page_says() -> None:
    found = matrix()
    assert found.covered == found.possible > 500 and len(found.running) < 80
    readme = (Path(__file__).parents[2] / "docs" / "design.md").read_text()
    assert f"pairs covered: {found.covered} of {found.possible}\n{len(found.running)} configurations run" in readme
    assert sum(len(refusals) for *_, refusals in worlds().values()) == len(found.refused) > 0


DEFECTS_OF_CROSSINGS = {  # defects once found where features crossed, each the levels that together made it
    "accumulation x a tie x replicas": {"accumulate": {2}, "tie": {"across"}, "data": {"dp2"}},
    "accumulation x a tie x FSDP": {"accumulate": {2}, "tie": {"across"}, "data": {"fsdp", "fsdp-reshard"}},
    "accumulation x replicas x loss_count": {"accumulate": {2}, "loss": {"sum"}, "data": {"dp2"}},
    "replicas' batch norms x eval": {"model": {"mlp"}, "data": {"dp2", "fsdp", "fsdp-reshard"}, "after": {"eval"}},
    "replicas' batch norms x a checkpoint": {"model": {"mlp"}, "data": {"dp2", "fsdp"}, "after": {"reload"}},
    "eval x FSDP": {"data": {"fsdp", "fsdp-reshard"}, "after": {"eval"}},
    "save_pretrained x tensor parallel": {"tp": {2}, "after": {"hf-export"}},
    "save_pretrained x FSDP": {"data": {"fsdp", "fsdp-reshard"}, "after": {"hf-export"}},
    "fp16 x tensor parallel": {"precision": {"fp16"}, "tp": {2}},
    "fp16 x FSDP": {"precision": {"fp16"}, "data": {"fsdp", "fsdp-reshard"}},
    "tracing x tensor parallel": {"after": {"trace"}, "tp": {2}},
    "the user's profiler x tracing (processes)": {"after": {"trace"}, "data": {"fsdp", "fsdp-reshard"}},
    "compile x a split backward": {"compile": {"on"}, "schedule": {"zb-h1", "zb-v", "v-half", "v-min", "dualpipe-v"}},
}


@pytest.mark.parametrize("defect", sorted(DEFECTS_OF_CROSSINGS))
def test_each_crossing_that_once_failed_is_in_a_configuration(defect: str) -> None:
    wanted = DEFECTS_OF_CROSSINGS[defect]
    held = [c for c in matrix().running if all(getattr(c, name) in levels for name, levels in wanted.items())]
    assert held, f"no configuration of the matrix holds {defect}: {wanted}"
