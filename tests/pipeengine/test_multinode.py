"""Two torchrun "nodes" on this machine (c10d rendezvous on 127.0.0.1, 2 processes each), as on two machines."""

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.pipeengine.parity import replicas_parity

ROOT = Path(__file__).parent.parent.parent

SCRIPT = """
from pipeengine import launch
from tests.pipeengine.test_multinode import two_replicas
if __name__ == "__main__":
    launch(two_replicas, 2)
"""


def two_replicas() -> None:
    """World 4 = 2 replicas of a 2-rank pipeline: each replica on one node, its gradients averaged across nodes."""
    replicas_parity("transformer", "1f1b", 2, 4, 8)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(240)
def test_two_torchrun_nodes_train_like_one_process(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    endpoint, run = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    nodes, logs = [], []
    for node in range(2):
        log = (tmp_path / f"node{node}.log").open("w")
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", run, str(script)]  # fmt: skip
        nodes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path))
        logs.append(log)
    try:
        codes = [node.wait(timeout=200) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
        for log in logs:
            log.close()
    output = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(2))
    assert codes == [0, 0], output


def resume_or_kill(directory: str, kill: bool) -> None:
    """4 steps of a 2-rank pipeline, a checkpoint after each, resumed from the latest; with ``kill``, the first
    attempt's rank 1 (the second node's) is SIGKILLed in step 2. Each start writes down the step it started from."""
    import signal

    import torch
    from torch.nn import functional as F

    from pipeengine import PipelineEngine, latest_checkpoint
    from tests.pipeengine import ranks
    from tests.pipeengine.models import batch, mlp

    engine = PipelineEngine(mlp(), F.mse_loss, num_microbatches=2)
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    start = engine.load(directory, optimizer)["step"] if latest_checkpoint(directory) else 0
    with open(f"{directory}/starts.{ranks.rank()}", "a") as out:
        out.write(f"{start}\n")
    for step in range(start, 4):
        if kill and step == 2 and ranks.rank() == 1 and start == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch("mlp", 4, seed=step)
        engine.train_step(x if engine.first else None, y if engine.last else None)
        optimizer.step()
        optimizer.zero_grad()  # a gradient is not kept in a checkpoint: a resumed step must not depend on one
        engine.save(directory, optimizer, step=step + 1)


def agents(tmp_path: Path, script: str, nnodes: str, extra: list[str]) -> list[subprocess.Popen[bytes]]:
    """Two torchrun agents on this machine, one process each, on a c10d rendezvous of their own."""
    (tmp_path / "train.py").write_text(script)
    endpoint, run = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    started = []
    for node in range(2):
        log = (tmp_path / f"node{node}.log").open("w")
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run, *extra,
                   str(tmp_path / "train.py")]  # fmt: skip
        started.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path))
        log.close()
    return started


def left_behind(tmp_path: Path) -> list[str]:
    """Processes still running this test's script (a rank or an agent)."""
    found = subprocess.run(["pgrep", "-af", str(tmp_path / "train.py")], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


@pytest.mark.timeout(240)
def test_two_torchrun_nodes_restart_together_after_a_rank_is_killed_and_resume(tmp_path: Path) -> None:
    """A rank of the second node SIGKILLed mid-training: torchrun restarts the ranks of both nodes (the healthy node's
    agent does not count the restart: the ranks agree on the attempt from the rendezvous round) and they resume from
    the latest checkpoint to the uninterrupted run's weights; nothing is left running."""
    import torch

    from pipeengine import consolidate, launch

    script = (f"from pipeengine import launch\nfrom tests.pipeengine.test_multinode import resume_or_kill\n"
              f"if __name__ == '__main__':\n    launch(resume_or_kill, 1, args=({str(tmp_path)!r}, True))\n"
              )  # fmt: skip
    nodes = agents(tmp_path, script, "2", ["--max-restarts", "2"])
    try:
        codes = [node.wait(timeout=200) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    output = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(2))
    assert codes == [0, 0], output
    assert [(tmp_path / f"starts.{r}").read_text().split() for r in range(2)] == [["0", "2"], ["0", "2"]], output
    assert not left_behind(tmp_path)
    reference = tmp_path / "reference"
    reference.mkdir()
    launch(resume_or_kill, 2, args=(str(reference), False), timeout=120)
    mine, theirs = consolidate(tmp_path), consolidate(reference)
    assert list(mine) == list(theirs)
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name  # the same computation in the same order, bit for bit
