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
    codes, output = finished(agents(tmp_path, SCRIPT, "2", [], per_node=2), tmp_path)
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


def agents(
    tmp_path: Path,
    script: str,
    nnodes: str,
    extra: list[str],
    per_node: int = 1,
    new_session: bool = False,
    conf: str = "",
) -> list[subprocess.Popen[bytes]]:
    """Two torchrun agents on this machine, ``per_node`` processes each, on a c10d rendezvous of their own, the first
    hosting its store (``conf``: more of its --rdzv-conf). The second starts first and waits for the store, so both
    join the first round together. ``new_session``: each agent leads a process group of its own, which a test can
    kill whole, as a machine going down."""
    (tmp_path / "train.py").write_text(script)
    endpoint, run = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    import torch

    if torch.__version__ < "2.13":  # its rendezvous fails a node made rank 0 (docs/guides/checkpoints.md, elastic)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    started: dict[int, subprocess.Popen[bytes]] = {}
    for node in (1, 0):
        log = (tmp_path / f"node{node}.log").open("w")
        hosting = ",".join(filter(None, [conf, f"is_host={'true' if node == 0 else 'false'}"]))
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            str(per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            run,
            "--rdzv-conf",
            hosting,
            *extra,
            str(tmp_path / "train.py"),
        ]
        started[node] = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=new_session
        )
        log.close()
    return [started[0], started[1]]


def finished(nodes: list[subprocess.Popen[bytes]], tmp_path: Path) -> tuple[list[int], str]:
    """Each agent's exit code (any still running after 200 s is killed) and the end of their logs."""
    try:
        codes = [node.wait(timeout=200) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    return codes, "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(len(nodes)))


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

    script = (
        f"from pipeengine import launch\nfrom tests.pipeengine.test_multinode import resume_or_kill\n"
        # device="cpu": two nodes of one rank on one machine; with a GPU there, launch's default would put both
        # ranks on it (NCCL refuses that: seen on a lent GPU)
        f"if __name__ == '__main__':\n    launch(resume_or_kill, 1, args=({str(tmp_path)!r}, True), device='cpu')\n"
    )
    codes, output = finished(agents(tmp_path, script, "2", ["--max-restarts", "2"]), tmp_path)
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


def elastic(directory: str, steps: int) -> None:
    """``steps`` steps of a 2-stage pipeline whose replicas follow the world (dp = world / 2), the global batch split
    among them, a checkpoint after each, resumed from the latest; each start writes down the world and the step."""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    from pipeengine import PipelineEngine, latest_checkpoint
    from tests.pipeengine.models import batch, mlp

    dp = dist.get_world_size() // 2
    engine = PipelineEngine(mlp(), F.mse_loss, num_microbatches=2, data_parallel=dp)
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    start = engine.load(directory, optimizer)["step"] if latest_checkpoint(directory) else 0
    with open(f"{directory}/starts.{dist.get_rank()}", "a") as out:
        out.write(f"{dist.get_world_size()}:{start}\n")
    for step in range(start, steps):
        x, y = batch("mlp", 8, seed=step)
        mine = slice(engine.dp_rank * 8 // dp, (engine.dp_rank + 1) * 8 // dp)
        engine.train_step(x[mine] if engine.first else None, y[mine] if engine.last else None)
        optimizer.step()
        optimizer.zero_grad()
        engine.save(directory, optimizer, step=step + 1)
        time.sleep(0.3)  # a step long enough for the test to kill a node mid-training


@pytest.mark.timeout(240)
def test_with_elastic_nodes_the_job_goes_on_from_the_last_checkpoint_on_the_node_left(tmp_path: Path) -> None:
    """--nnodes 1:2, two nodes of 2 ranks (dp2 x pp2): the second node's agent and ranks killed for good mid-training
    (its process group, as a machine going down), the first node's ranks restart alone (dp1 x pp2) from the last
    checkpoint, which loads into the smaller layout, and finish; their weights are those of the same two layouts
    run one after the other from the same checkpoint; nothing is left running."""
    import signal
    import time

    import torch

    from pipeengine import consolidate, launch

    script = (
        f"from pipeengine import launch\nfrom tests.pipeengine.test_multinode import elastic\n"
        f"if __name__ == '__main__':\n    launch(elastic, 2, args=({str(tmp_path)!r}, 6))\n"
    )
    fast = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"  # a dead node seen
    nodes = agents(tmp_path, script, "1:2", ["--max-restarts", "2"], per_node=2, new_session=True, conf=fast)
    try:
        started = time.monotonic()
        while not (tmp_path / "latest").exists() or (tmp_path / "latest").read_text() < "checkpoint-3":
            assert time.monotonic() - started < 120 and nodes[0].poll() is None, "the job did not reach step 3"
            time.sleep(0.1)
        os.killpg(nodes[1].pid, signal.SIGKILL)  # the second machine goes down
        code = nodes[0].wait(timeout=150)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    output = (tmp_path / "node0.log").read_text()[-4000:]
    assert code == 0, output
    first = [(tmp_path / f"starts.{r}").read_text().split() for r in range(2)]
    resumed = int(first[0][1].split(":")[1])  # the step the first node's ranks resumed from, in a world of 2
    assert first == [["4:0", f"2:{resumed}"]] * 2 and resumed >= 3, (first, output)
    assert not left_behind(tmp_path)
    reference = tmp_path / "reference"
    reference.mkdir()
    launch(elastic, 4, args=(str(reference), resumed), timeout=120)  # the same layouts, one after the other
    launch(elastic, 2, args=(str(reference), 6), timeout=120)
    mine, theirs = consolidate(tmp_path), consolidate(reference)
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
