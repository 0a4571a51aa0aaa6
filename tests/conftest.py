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


# the longest tests (each 7 s or more on this machine, most launching 4 ranks or torchrun): started first, so that
# the two workers end together instead of one running a long test alone at the end (a longest-first schedule)
LONGEST = (
    "tests/pipeengine/test_layout_planner.py::test_every_layout_row_builds_and_trains_like_one_process_on_4_gloo_ranks",
    "tests/pipeengine/test_composition.py::test_every_configuration_trains_like_one_process_or_is_refused_with_its",
    "tests/pipeengine/test_compile.py::test_compiled_stages_under_every_schedule_and_every_feature_equal_one_process",
    "tests/pipeengine/test_launch.py::test_under_torchrun_launch_joins_its_group_and_max_restarts_resumes",
    "tests/pipeengine/test_multinode.py::test_two_torchrun_nodes_train_like_one_process",
    "tests/test_examples.py::test_train_gpt_trains_samples_and_a_killed_rank_restarts_to_the_uninterrupted_weights",
    "tests/pipeengine/test_tune.py::test_the_cli_plans_a_model_given_as_module_function",
    "tests/pipeengine/test_layout_planner.py::test_calibration_keeps_its_file_and_the_planner_reads_it",
    "tests/pipeengine/test_reliability.py::test_ranks_and_helpers_stop_when_their_launcher_is_killed_mid_training",
    "tests/test_examples.py::test_finetune_hf_trains_and_writes_what_from_pretrained_loads_and_generate_hf_generates",
    "tests/test_benchmarks.py::test_vs_torch_tp_checks_equal_losses_and_reports_a_ratio_and_peaks",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(
        key=lambda item: next((rank for rank, name in enumerate(LONGEST) if item.nodeid.startswith(name)), len(LONGEST))
    )  # stable: every other test keeps its place
    launching = sys.modules.get("pipeengine.launcher.launch")  # imported by the test modules just collected
    if launching is None:
        return
    preload = getattr(launching, "PRELOAD", None)
    if not isinstance(preload, list):  # renamed: say so, rather than quietly slowing every rank
        raise pytest.UsageError("tests/conftest.py: pipeengine.launcher.launch.PRELOAD (a list) is gone; update it")
    if "pytest" not in preload:
        preload.append("pytest")
