"""Reliability: frozen stages train, the right rank is blamed, every wait is bounded, mismatched calls are
refused, and no rank outlives its launcher. Times are asserted only as generous bounds on stopping."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pipeengine import LaunchError, PeerError, PipelineEngine, ReplicaLoader, launch
from pipeengine.comm.calls import CallMismatch
from tests.pipeengine import ranks
from tests.pipeengine.models import SEEDED, mlp, mse
from tests.pipeengine.parity import OneProcess, check_grads, check_weights, close, step_both
from tests.pipeengine.processes import alive, descendants
from tests.pipeengine.ranks import on_ranks

ROOT = Path(__file__).parent.parent.parent


class Detach(nn.Module):
    """Passes its input on without its gradient: the stages before it learn nothing from the loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


def frozen_model(how: str, num_stages: int) -> tuple[nn.Sequential, list[int]]:
    """An MLP of one Linear+Tanh pair per stage (and a head); the first half of the stages frozen or cut off."""
    with SEEDED:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(num_stages):
            layers += [nn.Linear(16, 16), nn.Tanh()]
        layers.append(nn.Linear(16, 4))
    cut = max(1, num_stages // 2)  # stages [0, cut) need no gradient
    if how == "frozen":
        for layer in layers[: 2 * cut]:
            layer.requires_grad_(False)
    elif how == "detached":
        layers.insert(2 * cut, Detach())  # the last layer of stage cut-1
    counts = [2] * num_stages
    counts[-1] += 1  # the head
    if how == "detached":
        counts[cut - 1] += 1
    return nn.Sequential(*layers), counts


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"])
@pytest.mark.parametrize("how", ["frozen", "detached"])
@pytest.mark.parametrize("world", [2, 4])
@on_ranks("world", timeout=60, in_process=True)
def test_stages_that_need_no_gradient_train_like_one_process(world: int, schedule: str, how: str) -> None:
    """Stages that need no gradient train like one process: the others match it, theirs get no gradient."""
    steps = 3
    chunks = 2 if schedule in ("interleaved", "zb-v") else 1
    model, counts = frozen_model(how, world * chunks)
    one = OneProcess(model, mse)
    m = 2 * world
    engine = PipelineEngine(model, mse, num_microbatches=m, schedule=schedule, chunks=chunks, partition=counts)
    trainable = [p for p in engine.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2) if trainable else None
    reference_optimizer = torch.optim.AdamW([p for p in one.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * m, 16, generator=generator), torch.randn(2 * m, 4, generator=generator)
        loss = engine.train_step(x if engine.first else None, y if engine.last else None)
        close(loss, one.step([(x, y)]), f"{schedule} {how} step {step}: loss")
        # frozen, or before the cut: no gradient on either side
        check_grads(engine, one, f"{schedule} {how} step {step}", without_grad="none or zero")
        step_both(optimizer, reference_optimizer)
    check_weights(engine, one, f"{schedule} {how}: after {steps} steps")


@pytest.mark.timeout(120)
@on_ranks(2, timeout=60)  # once: IndexError: list index out of range
def test_the_frozen_first_stage_of_the_issue_trains_on_real_ranks() -> None:
    """The issue's case: 4 Linear(8, 8), the first two frozen, partition [2, 2], one train_step."""
    with SEEDED:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    one = OneProcess(model, mse)
    engine = PipelineEngine(model, mse, num_microbatches=2, partition=[2, 2])
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 8)
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    close(loss, one.step([(x, y)]), "loss")
    check_grads(engine, one, "the frozen first stage", without_grad="none")


def under_inference_mode() -> None:
    engine = PipelineEngine(mlp(), mse, num_microbatches=2)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    with torch.inference_mode():
        engine.train_step(x if engine.first else None, y if engine.last else None)


@pytest.mark.timeout(60)
def test_train_step_under_inference_mode_is_refused_by_every_rank() -> None:
    with pytest.raises(ValueError, match=r"train_step ran under torch.inference_mode\(\).*use eval_step") as caught:
        launch(under_inference_mode, 2, timeout=30, in_process=True)
    notes = "\n".join(caught.value.__notes__)  # both refused it; either may be reported first
    assert re.search(r"rank [01]: ValueError: step refused by rank 0: train_step ran under", notes), notes


def write_pid_and_train_forever(folder: str, workers: int = 0) -> None:
    """Each rank trains a few steps on batches from ``workers`` DataLoader workers, leaves its pid in ``folder`` (it
    is mid-training now, done with the launcher's store), then trains until something stops it."""
    engine = PipelineEngine(mlp(), mse, num_microbatches=2)
    samples = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 4))  # an epoch outlasts the test: no new workers
    batches = iter(ReplicaLoader(samples, 4, num_workers=workers))
    for step in itertools.count():
        x, y = next(batches)
        engine.train_step(x if engine.first else None, y if engine.last else None)
        if step == 3:
            Path(folder, f"rank{ranks.rank()}.pid").write_text(str(os.getpid()))


LAUNCHER = """
import sys
from pipeengine import launch
from tests.pipeengine.test_reliability import write_pid_and_train_forever
if __name__ == "__main__":
    launch(write_pid_and_train_forever, 2, args=(sys.argv[1], int(sys.argv[2])))
"""


CASES = [("launch", signal.SIGKILL, 1), ("launch", signal.SIGTERM, 0), ("torchrun", signal.SIGKILL, 1)]


@pytest.mark.timeout(180)
def test_ranks_and_helpers_stop_when_their_launcher_is_killed_mid_training(tmp_path: Path) -> None:
    """Killed a few steps into training: every rank, what it started (a DataLoader worker, and under launch the fork
    server that started it) and, under launch, the fork server the ranks started from and multiprocessing's
    resource tracker are gone within seconds (a rank once kept the fork server alive through its keep-alive pipe,
    and the fork server's death is what signals the ranks). A killed torchrun agent (its ranks' parent) once left
    them training. A worker costs a fork server importing the script (and torch) in each launch rank: in one case.
    The three cases run side by side, each its own launcher, its own folder and its own processes."""
    script = tmp_path / "train.py"
    script.write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launchers, folders, helpers = [], [], [set[int]() for _ in CASES]
    try:
        for index, (runner, _, workers) in enumerate(CASES):
            folders.append(tmp_path / f"{index}-{runner}")
            folders[-1].mkdir()
            command = [sys.executable, str(script), str(folders[-1]), str(workers)]
            if runner == "torchrun":
                command[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
            launchers.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 150
        waiting = set(range(len(CASES)))
        while waiting:  # each case's ranks 4 steps into training: then its launcher is killed
            for index in sorted(waiting):
                runner, sig, _ = CASES[index]
                launcher = launchers[index]
                assert launcher.poll() is None and time.monotonic() < deadline, f"{runner}'s ranks did not start"
                if len(list(folders[index].glob("rank*.pid"))) < 2:
                    continue
                pids = {int(path.read_text()) for path in folders[index].glob("rank*.pid")}
                helpers[index] = descendants(launcher.pid)
                assert pids <= helpers[index] and len(helpers[index]) >= 4, (runner, pids, helpers[index])
                os.kill(launcher.pid, sig)
                waiting.discard(index)
            time.sleep(0.2)
        for index, (runner, sig, _) in enumerate(CASES):
            launchers[index].wait(30)
            deadline = time.monotonic() + 10  # the kernel signals each rank as its parent exits
            while any(alive(pid) for pid in helpers[index]) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = {
                pid: Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:80]
                for pid in helpers[index]
                if alive(pid)
            }
            assert not left, f"outlived their {runner} killed by {sig.name}: {left}"
    finally:
        for launcher in launchers:
            launcher.kill()
        for pid in set().union(*helpers):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def loads_then_dies_once(folder: str) -> None:
    """Each rank reads a batch and writes down the processes below it; the first time through a DataLoader worker,
    then rank 1 is killed (SIGKILL) and rank 0 fails waiting for it; the second time in the rank itself."""
    first = not Path(folder, f"first.{ranks.rank()}").exists()
    batches = iter(ReplicaLoader(TensorDataset(torch.arange(8)), 2, num_workers=1 if first else 0))
    next(batches)
    below = " ".join(str(pid) for pid in descendants(os.getpid()))
    Path(folder, f"{'first' if first else 'again'}.{ranks.rank()}").write_text(below)
    if first:
        ranks.barrier()  # both wrote theirs down
        if ranks.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        ranks.barrier()  # rank 0: PeerError


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_the_processes_a_rank_started_end_with_it_however_it_ends(tmp_path: Path) -> None:
    """The DataLoader worker (and the fork server it started from) of a killed rank and of a failed one: neither is
    left once launch returns. They once ran forever (the fork server stayed up for the worker holding its keep-alive
    pipe, the worker for its parent, the fork server)."""

    def written() -> set[int]:
        return {int(pid) for path in tmp_path.glob("*.[01]") for pid in path.read_text().split()}

    try:
        launch(loads_then_dies_once, 2, args=(str(tmp_path),), max_restarts=1, timeout=60)
        pids = written()
        assert len(pids) >= 2, pids  # a worker per rank, at least
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:80] for pid in pids if alive(pid)}
        assert not left, f"outlived the rank that started them: {left}"
    finally:
        for pid in written():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def dies_between_steps(how: str, timeout: float) -> None:
    """Rank 1 leaves the run after a train_step, before clip_grad_norm_: exits (code 1 or 0) or hangs."""
    engine = PipelineEngine(mlp(), mse, num_microbatches=2, timeout=timeout)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    engine.train_step(x if engine.first else None, y if engine.last else None)
    if ranks.rank() == 1:
        if how == "exit 1":
            os._exit(1)
        if how == "exit 0":
            os._exit(0)
        time.sleep(3600)  # hangs
    engine.clip_grad_norm_(1.0)
    engine.train_step(x if engine.first else None, y if engine.last else None)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "how, fate",
    [
        ("exit 1", "exited with code 1 without a report"),
        ("exit 0", "exited with code 0 without a report"),
        ("hang", "was still running"),
    ],
)
def test_a_rank_that_leaves_between_steps_is_the_cause_and_every_wait_is_bounded(how: str, fate: str) -> None:
    started = time.monotonic()
    # a hung rank 1 is the only one left once rank 0 gives up: no need to wait long for it
    grace = 1.0 if how == "hang" else 3.0
    with pytest.raises(LaunchError, match=rf"rank 1 {fate}") as caught:
        # the process group's own timeout is 600 s: only the engine's timeout (3 s) can stop rank 0 in time
        launch(dies_between_steps, 2, args=(how, 3.0), timeout=600, grace=grace)
    text = str(caught.value)
    assert "rank 1 of 2 is the cause" in text
    assert "rank 0: PeerError: " in text  # what rank 0 saw is a lost peer, not the cause
    assert time.monotonic() - started < 150  # far below the process group's 600 s
    assert not multiprocessing.active_children()


def mismatched(case: str) -> None:
    """Ranks that call different things: every rank is told what each one called."""
    engine = PipelineEngine(mlp(), mse, num_microbatches=2, timeout=30)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    if case == "eval vs train":
        if ranks.rank() == 0:
            engine.eval_step(x)
        else:
            engine.train_step(None, y)
    elif case == "save on rank 0 only":
        if ranks.rank() == 0:
            engine.save("unused")
        engine.train_step(x if engine.first else None, y if engine.last else None)
    else:
        raise AssertionError(case)


@pytest.mark.timeout(120)
def test_ranks_that_call_different_things_are_all_told_what_each_called() -> None:
    with pytest.raises(CallMismatch, match=r"rank 0 called eval_step \(call 1\), rank 1 called train_step \(call 1\)"):
        launch(mismatched, 2, args=("eval vs train",), timeout=30, in_process=True)


@pytest.mark.timeout(120)
def test_a_save_on_one_rank_only_is_refused_at_once_on_real_ranks() -> None:
    started = time.monotonic()
    with pytest.raises(CallMismatch, match=r"rank 0 called save \(call 1\), rank 1 called train_step \(call 1\)") as e:
        launch(mismatched, 2, args=("save on rank 0 only",), timeout=600)
    assert re.search(r"rank [01]: CallMismatch", "\n".join(e.value.__notes__))  # both refused it, neither waited
    assert time.monotonic() - started < 90


def test_a_lost_peer_is_a_peer_error() -> None:
    assert issubclass(PeerError, Exception) and issubclass(CallMismatch, Exception)
