"""pytest -n N: a worker that runs out of tests takes some queued for another (xdist's worksteal), where xdist's
default (load) leaves them queued: the suite's long tests ended on one worker while the other idled for minutes.

A rank that launch starts as a process imports the test module its function is defined in, and with it pytest: about
80 ms of CPU a rank, where the rest of a test module costs a few. Where the tests run, the fork server the ranks start
from imports pytest once, beside what launch preloads (torch, pipeengine).

The planner's prices (pipeengine.planner.calibration) come from tests/calibration.json, not this machine's file:
schedule="auto" on gloo ranks would otherwise measure them (seconds) where none are kept, and keep them in the user's
home. A test of calibration itself points PIPEENGINE_CALIBRATION elsewhere."""

import os
import sys
from pathlib import Path

import pytest

os.environ["PIPEENGINE_CALIBRATION"] = str(Path(__file__).parent / "calibration.json")  # ranks inherit it


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
        config.option.dist = "worksteal"  # before xdist's own hook, which makes "no" "load" and keeps any other


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    launching = sys.modules.get("pipeengine.launcher.launch")  # imported by the test modules just collected
    if launching is None:
        return
    preload = getattr(launching, "PRELOAD", None)
    if not isinstance(preload, list):  # renamed: say so, rather than quietly slowing every rank
        raise pytest.UsageError("tests/conftest.py: pipeengine.launcher.launch.PRELOAD (a list) is gone; update it")
    if "pytest" not in preload:
        preload.append("pytest")
