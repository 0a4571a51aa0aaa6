"""Reliability: frozen stages train, the right rank is blamed, every wait is bounded, mismatched calls are
refused, and no rank outlives its launcher. Times are asserted only as generous bounds on stopping."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeengine import LaunchError, PeerError, launch
from pipeengine.comm.calls import CallMismatch
from tests.pipeengine import reliability_workers as workers

ROOT = Path(__file__).parent.parent.parent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"])
@pytest.mark.parametrize("how", ["frozen", "detached"])
def test_stages_that_need_no_gradient_train_like_one_process(schedule: str, how: str) -> None:
    for ranks in (2, 4):
        launch(workers.frozen_parity, ranks, args=(schedule, how), timeout=60, in_process=True)


@pytest.mark.timeout(120)
def test_the_frozen_first_stage_of_the_issue_trains_on_real_ranks() -> None:
    launch(workers.reproduction, 2, timeout=60)  # once: IndexError: list index out of range


@pytest.mark.timeout(60)
def test_train_step_under_inference_mode_is_refused_by_every_rank() -> None:
    with pytest.raises(ValueError, match=r"train_step ran under torch.inference_mode\(\).*use eval_step") as caught:
        launch(workers.under_inference_mode, 2, timeout=30, in_process=True)
    notes = "\n".join(caught.value.__notes__)  # both refused it; either may be reported first
    assert re.search(r"rank [01]: ValueError: step refused by rank 0: train_step ran under", notes), notes


LAUNCHER = """
import sys
from pipeengine import launch
from tests.pipeengine import reliability_workers
if __name__ == "__main__":
    launch(reliability_workers.write_pid_and_train_forever, 2, args=(sys.argv[1],))
"""


def alive(pid: int) -> bool:
    """Running, and not a zombie (a container's init may not reap the ranks it inherits)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = set(), [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.add(child)
            frontier.append(child)
    return found


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_and_helpers_stop_when_their_launcher_is_killed_mid_training(sig: signal.Signals, tmp_path: Path) -> None:
    """Killed a few steps into training: every rank, the fork server they started from and multiprocessing's
    resource tracker are gone within seconds (a rank once kept the fork server alive through its keep-alive pipe,
    and the fork server's death is what signals the ranks)."""
    script = tmp_path / "train.py"
    script.write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stderr=subprocess.DEVNULL)
    helpers: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*.pid"))) < 2:  # both ranks are 4 steps into training
            assert launcher.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        pids = {int(path.read_text()) for path in tmp_path.glob("rank*.pid")}
        helpers = descendants(launcher.pid)
        assert pids <= helpers and len(helpers) >= 4, (pids, helpers)  # the fork server and the resource tracker
        os.kill(launcher.pid, sig)
        launcher.wait(30)
        deadline = time.monotonic() + 10  # the kernel signals each rank as the fork server exits
        while any(alive(pid) for pid in helpers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:80] for pid in helpers
                if alive(pid)}  # fmt: skip
        assert not left, f"outlived their launcher killed by {sig.name}: {left}"
    finally:
        launcher.kill()
        for pid in helpers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how, fate", [("exit 1", "exited with code 1 without a report"),
                                       ("exit 0", "exited with code 0 without a report"),
                                       ("hang", "was still running")])  # fmt: skip
def test_a_rank_that_leaves_between_steps_is_the_cause_and_every_wait_is_bounded(how: str, fate: str) -> None:
    started = time.monotonic()
    # a hung rank 1 is the only one left once rank 0 gives up: no need to wait long for it
    grace = 1.0 if how == "hang" else 3.0
    with pytest.raises(LaunchError, match=rf"rank 1 {fate}") as caught:
        # the process group's own timeout is 600 s: only the engine's timeout (3 s) can stop rank 0 in time
        launch(workers.dies_between_steps, 2, args=(how, 3.0), timeout=600, grace=grace)
    text = str(caught.value)
    assert "rank 1 of 2 is the cause" in text
    assert "rank 0: PeerError: " in text  # what rank 0 saw is a lost peer, not the cause
    assert time.monotonic() - started < 150  # far below the process group's 600 s
    assert not multiprocessing.active_children()


@pytest.mark.timeout(120)
def test_ranks_that_call_different_things_are_all_told_what_each_called() -> None:
    with pytest.raises(CallMismatch, match=r"rank 0 called eval_step \(call 1\), rank 1 called train_step \(call 1\)"):
        launch(workers.mismatched, 2, args=("eval vs train",), timeout=30, in_process=True)


@pytest.mark.timeout(120)
def test_a_save_on_one_rank_only_is_refused_at_once_on_real_ranks() -> None:
    started = time.monotonic()
    with pytest.raises(CallMismatch, match=r"rank 0 called save \(call 1\), rank 1 called train_step \(call 1\)") as e:
        launch(workers.mismatched, 2, args=("save on rank 0 only",), timeout=600)
    assert re.search(r"rank [01]: CallMismatch", "\n".join(e.value.__notes__))  # both refused it, neither waited
    assert time.monotonic() - started < 90


def test_a_lost_peer_is_a_peer_error() -> None:
    assert issubclass(PeerError, Exception) and issubclass(CallMismatch, Exception)
