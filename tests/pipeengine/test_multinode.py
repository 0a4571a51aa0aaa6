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
