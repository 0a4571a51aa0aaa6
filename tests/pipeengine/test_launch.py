"""launch: N local ranks with a process group, errors re-raised with their rank, or torchrun's group joined."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeengine import launch
from tests.pipeengine import ranks
from tests.pipeengine.ranks import on_ranks

ROOT = Path(__file__).parent.parent.parent


def report_world(path: str) -> None:
    """Write this rank's view of the world to a file per rank."""
    import torch
    import torch.distributed as dist

    with open(f"{path}.{dist.get_rank()}", "w") as out:
        out.write(f"{dist.get_rank()} {dist.get_world_size()} {dist.get_backend()} {torch.get_num_threads()}")


def report_world_late(path: str) -> None:
    """report_world from a thread still running when this returns, then " atexit" from an atexit handler."""
    import atexit
    import threading
    import time

    import torch
    import torch.distributed as dist

    name = f"{path}.{dist.get_rank()}"
    line = f"{dist.get_rank()} {dist.get_world_size()} {dist.get_backend()} {torch.get_num_threads()}"

    def late() -> None:
        time.sleep(0.3)
        with open(name, "w") as out:
            out.write(line)

    def at_exit() -> None:
        with open(name, "a") as out:
            out.write(" atexit")

    threading.Thread(target=late).start()  # not a daemon: the rank's exit waits for it, as Python's does
    atexit.register(at_exit)


def raise_on(rank: int) -> None:
    if ranks.rank() == rank:
        raise KeyError(f"raised on purpose by rank {rank}")
    ranks.barrier()


def test_every_rank_runs_with_gloo_and_its_share_of_the_cores(tmp_path: Path) -> None:
    # written by a thread still running when fn returns, then by an atexit handler: a rank's exit waits
    # for its threads and runs its atexit handlers, as Python's exit does, in that order
    launch(report_world_late, 2, args=(str(tmp_path / "world"),), threads=1)
    seen = sorted((tmp_path / f"world.{r}").read_text() for r in range(2))
    assert seen == ["0 2 gloo 1 atexit", "1 2 gloo 1 atexit"]


def report_start(path: str) -> None:
    """What started this rank: its parent's command line, whether its parent had torch loaded, and whether this rank
    still holds the fork server's keep-alive pipe."""
    import json
    from multiprocessing import forkserver

    parent = os.getppid()
    command = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    loaded = "libtorch" in Path(f"/proc/{parent}/maps").read_text()
    alive = forkserver._forkserver._forkserver_alive_fd  # type: ignore[attr-defined]
    Path(f"{path}.{os.environ['RANK']}").write_text(json.dumps([command, loaded, alive]))


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
def test_ranks_start_from_a_fork_server_that_imported_torch_and_let_go_of_its_pipe(tmp_path: Path) -> None:
    """A rank is forked from a server that imported torch once (not spawned, importing it again: about a second of
    CPU each), and closes the server's keep-alive pipe (else the server, and so the rank, outlives the launcher)."""
    import json

    launch(report_start, 2, args=(str(tmp_path / "start"),))
    for rank in range(2):
        command, loaded, alive = json.loads((tmp_path / f"start.{rank}").read_text())
        assert "multiprocessing.forkserver" in command and loaded and alive is None, (rank, command, loaded, alive)


def listening(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on ``port`` on this machine, from /proc/net (Linux)."""
    import socket

    found = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        table = Path("/proc/net", name)
        for line in table.read_text().splitlines()[1:] if table.exists() else []:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)  # 32-bit words in the host's (little-endian) order
                found.append(socket.inet_ntop(family, b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))))
    return found


def report_store_listeners(path: str) -> None:
    """Rank 0 writes where the launcher's store (MASTER_PORT) listens."""
    if os.environ["RANK"] == "0":
        Path(path).write_text(" ".join(listening(int(os.environ["MASTER_PORT"]))))


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net (Linux)")
def test_the_launchers_store_listens_on_this_machine_only(tmp_path: Path) -> None:
    """Its ranks are local: a store on every interface would let anyone on the network join or write keys."""
    launch(report_store_listeners, 2, args=(str(tmp_path / "listeners"),))
    assert (tmp_path / "listeners").read_text() == "127.0.0.1"


@pytest.mark.timeout(60)
def test_a_child_exception_is_re_raised_as_itself_naming_its_rank() -> None:
    with pytest.raises(KeyError, match="raised on purpose by rank 1") as caught:
        launch(raise_on, 2, args=(1,))
    assert "rank 1 of 2 is the cause" in "\n".join(caught.value.__notes__)


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_nprocs_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="nprocs must be a positive int"):
        launch(report_world, bad, args=("x",))  # type: ignore[arg-type]


def test_cuda_ranks_need_a_gpu_each() -> None:
    import torch

    with pytest.raises(ValueError, match="NCCL cannot run two ranks on one GPU"):
        launch(report_world, torch.cuda.device_count() + 1, args=("x",), device="cuda")


def resume_or_crash(directory: str) -> None:
    """The README's resume idiom over 4 steps, a checkpoint after each; the first time, rank 1 is killed in step 2.
    Each run writes down the step it started from."""
    import signal

    import torch
    from torch.nn import functional as F

    from pipeengine import PipelineEngine, latest_checkpoint
    from tests.pipeengine.models import batch, mlp

    engine = PipelineEngine(mlp(), F.mse_loss, num_microbatches=2)
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    start = engine.load(directory, optimizer)["step"] if latest_checkpoint(directory) else 0
    with open(f"{directory}/starts.{ranks.rank()}", "a") as out:
        out.write(f"{start}\n")
    for step in range(start, 4):
        if step == 2 and ranks.rank() == 1 and start == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch("mlp", 4, seed=step)
        engine.train_step(x if engine.first else None, y if engine.last else None)
        optimizer.step()
        engine.save(directory, optimizer, step=step + 1)


@pytest.mark.timeout(120)
def test_under_torchrun_launch_joins_its_group_and_max_restarts_resumes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        "from pipeengine import launch\n"
        "from tests.pipeengine.test_launch import report_world, resume_or_crash\n"
        "if __name__ == '__main__':\n"
        f"    launch(resume_or_crash, 2, args=({str(tmp_path)!r},))\n"
        f"    launch(report_world, 2, args=({str(tmp_path / 'world')!r},))\n"
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(script),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "torchrun.log"
    with log.open("w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=100, env=env, cwd=tmp_path)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun did not finish in 100 s:\n{log.read_text()[-4000:]}")
    assert code.returncode == 0, log.read_text()[-4000:]
    assert sorted((tmp_path / f"world.{r}").read_text().rsplit(" ", 1)[0] for r in range(2)) == [
        "0 2 gloo",
        "1 2 gloo",
    ]
    # torchrun started both ranks again once; they resumed after the last checkpoint before the kill (step 2)
    assert [(tmp_path / f"starts.{r}").read_text().split() for r in range(2)] == [["0", "2"], ["0", "2"]]
    assert (tmp_path / "latest").read_text() == "checkpoint-4"


def test_each_torchrun_attempt_joins_on_keys_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent keeps every attempt's keys: attempt k's group must not read attempt k-1's (dead) addresses,
    so each attempt after the first joins under a prefix of its own (the end-to-end test restarts once: a prefix
    shared by attempts 1 and 2 would pass it, then hang a second restart)."""
    import torch.distributed as dist

    from pipeengine.launcher import torchrun

    prefixes: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: object())
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: prefixes.append(prefix))
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(torchrun.atexit, "register", lambda fn: fn)
    for attempt in ("1", "2", "3"):
        env = {
            "TORCHELASTIC_RESTART_COUNT": attempt,
            "RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        torchrun.join(lambda: None, 2, (), "cpu", 5.0)
    assert len(set(prefixes)) == 3, prefixes


def fails_each_time(path: str) -> None:
    with open(f"{path}.{ranks.rank()}", "a") as out:
        out.write("started\n")
    if ranks.rank() == 1:
        raise RuntimeError("the same fault again (planted)")


@pytest.mark.timeout(120)
def test_a_rank_that_fails_every_time_stops_after_max_restarts_with_its_cause(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(RuntimeError, match=r"the same fault again") as raised:
        launch(fails_each_time, 2, args=(str(tmp_path / "runs"),), max_restarts=2, timeout=30)
    assert "in the last of 3 runs (max_restarts=2 spent)" in "\n".join(raised.value.__notes__)
    assert [(tmp_path / f"runs.{r}").read_text().count("started") for r in range(2)] == [3, 3]
    said = capfd.readouterr().err
    for restart in (1, 2):
        assert (
            f"rank 1 raised RuntimeError: the same fault again (planted); every rank stopped, starting all 2 "
            f"again (restart {restart} of max_restarts=2)"
        ) in said, said
    with pytest.raises(ValueError, match="max_restarts needs processes"):
        launch(fails_each_time, 2, args=("x",), max_restarts=1, in_process=True)


@pytest.mark.timeout(120)
def test_a_script_without_a_main_guard_gets_multiprocessings_own_explanation(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from pipeengine import launch\nfrom tests.pipeengine.test_launch import report_world\n"
        "launch(report_world, 2, args=('x',))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=env)
    assert result.returncode != 0
    assert "if __name__ == '__main__'" in result.stderr and "can only join a started process" not in result.stderr


@on_ranks(2, in_process=True)
@pytest.mark.parametrize("value", [3])
def test_on_ranks_runs_a_tests_own_body_on_each_rank_with_its_fixtures(value: int, tmp_path: Path) -> None:
    """tests.pipeengine.ranks.on_ranks: the body below runs once on each rank, given pytest's parameters and
    fixtures."""
    seen = ranks.all_gather_object((ranks.rank(), value, str(tmp_path)))
    assert seen == [(0, 3, str(tmp_path)), (1, 3, str(tmp_path))]


def test_the_attempt_is_read_from_the_rendezvous_only_where_the_agent_runs_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's command line names its c10d rendezvous in either spelling; without one (or outside torchrun) the
    rendezvous gives no round and the restart count serves; the state is unpickled with its own classes only."""
    import pickle

    from pipeengine.launcher import torchrun

    argv = ["python", "-m", "torch.distributed.run", "--nnodes=2", "--rdzv_backend", "c10d", "--rdzv-endpoint=h:7"]
    assert torchrun._options(argv)["rdzv_endpoint"] == "h:7" and torchrun._options(argv)["rdzv_backend"] == "c10d"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert torchrun.rendezvous_round(argv) is None  # not under torchrun's agent
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    assert torchrun.rendezvous_round(["torchrun", "--standalone", "--nproc-per-node", "2"]) is None
    assert torchrun.rendezvous_round(["torchrun", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:1"]) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setattr(torchrun, "rendezvous_round", lambda: None)
    assert torchrun.attempt() == (3, "TORCHELASTIC_RESTART_COUNT")
    monkeypatch.setattr(torchrun, "rendezvous_round", lambda: 5)
    assert torchrun.attempt() == (5, "the rendezvous round")
    with pytest.raises(pickle.UnpicklingError, match="names posix.system, which it never holds"):
        torchrun._State(io.BytesIO(pickle.dumps(os.system))).load()
