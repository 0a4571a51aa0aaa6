"""A rank that launch starts as a process imports the test module its function is defined in, and with it pytest:
about 80 ms of CPU a rank, where the rest of a test module costs a few. Where the tests run, the fork server the
ranks start from imports pytest once, beside what launch preloads (torch, pipeengine).

pytest -n N runs the tests as pyproject's addopts say (--dist loadgroup: a composition world's configurations on one
worker), the longest first (LONGEST).

The planner's prices (pipeengine.planner.calibration) come from tests/calibration.json, not this machine's file:
schedule="auto" on gloo ranks would otherwise measure them (seconds) where none are kept, and keep them in the user's
home. A test of calibration itself points PIPEENGINE_CALIBRATION elsewhere."""

import os
import sys
from pathlib import Path

import pytest

os.environ["PIPEENGINE_CALIBRATION"] = str(Path(__file__).parent / "calibration.json")  # ranks inherit it


# the longest tests (each 6 s or more on this machine, most launching 4 ranks or torchrun; a composition world's
# configurations run together): started first, so that the two workers end together instead of one running a long
# test alone at the end (a longest-first schedule). tests/test_layout.py checks that each names a test that exists.
LONGEST = (
    "tests/pipeengine/test_composition.py::test_each_configuration_trains_like_one_process_or_is_refused_with_its",
    "tests/pipeengine/test_compile.py::test_compiled_stages_under_every_schedule_and_every_feature_equal_one_process",
    "tests/pipeengine/test_multinode.py::test_with_elastic_nodes_the_job_goes_on_from_the_last_checkpoint_on_the_node_",
    "tests/pipeengine/test_multinode.py::test_two_torchrun_nodes_restart_together_after_a_rank_is_killed_and_resume",
    "tests/pipeengine/test_multinode.py::test_two_torchrun_nodes_train_like_one_process",
    "tests/pipeengine/test_reliability.py::test_ranks_and_helpers_stop_when_their_launcher_is_killed_mid_training",
    "tests/test_examples.py::test_train_gpt_trains_samples_and_a_killed_rank_restarts_to_the_uninterrupted_weights",
    "tests/pipeengine/test_calibration.py::test_calibration_keeps_its_file_and_the_planner_reads_it",
    "tests/pipeengine/test_launch.py::test_under_torchrun_launch_joins_its_group_and_max_restarts_resumes",
    "tests/test_examples.py::test_finetune_hf_trains_and_writes_what_from_pretrained_loads_and_generate_hf_generates",
    "tests/pipeengine/test_dry_run.py::test_a_1024_rank_llama_shaped_world_builds_and_steps_the_first_last_stage_and",
    "tests/pipeengine/test_tensor_parallel.py::test_pp2_tp2_trains_like_one_process_and_checkpoints_cross_tensor_para",
    "tests/pipeengine/test_layout_planner.py::test_every_layout_row_builds_and_trains_like_one_process_on_4_gloo_ranks",
    "tests/pipeengine/test_tune.py::test_the_cli_plans_a_model_given_as_module_function",
    "tests/pipeengine/test_reliability.py::test_the_processes_a_rank_started_end_with_it_however_it_ends",
    "tests/pipeengine/test_resume.py::test_replicas_fsdp_and_tp_resume_exactly_and_another_layout_reads_the_same_samp",
    "tests/pipeengine/test_launch.py::test_a_script_without_a_main_guard_gets_multiprocessings_own_explanation",
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
