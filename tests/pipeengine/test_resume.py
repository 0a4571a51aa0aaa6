"""Resuming: a run saved at step K and resumed is the uninterrupted run, bit for bit, in the same layout (dropout, an
LR scheduler and the data's position included), and reads the same global samples in another layout; a background
write that fails leaves `latest` where it was. Real gloo processes: each rank's random generator is its process's.
Restarts after a killed rank: test_examples.py (train_gpt) and test_launch.py."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from pipeengine import PipelineEngine, ReplicaLoader, latest_checkpoint
from pipeengine.core.dtensors import local
from tests.pipeengine import ranks
from tests.pipeengine.parity import close
from tests.pipeengine.ranks import on_ranks

STEPS, SAVED_AT, WIDTH = 4, 2, 16


def model(dropout: float) -> nn.Sequential:
    """Eight layers: a block is Linear, GELU, Dropout, Linear (tensor parallel: the first by columns, the last by
    rows, the dropout on each rank's columns)."""
    torch.manual_seed(0)

    def block() -> nn.Sequential:
        return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * WIDTH, WIDTH))

    return nn.Sequential(nn.Linear(4, WIDTH), *[block() for _ in range(6)], nn.Linear(WIDTH, 2))


def dataset() -> TensorDataset:
    """40 samples (five global batches of 8): inputs, targets, and each sample's index (what a replica read)."""
    data = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(40, 4, generator=data), torch.randn(40, 2, generator=data), torch.arange(40))


Run = tuple[list[float], list[list[int]], dict[str, torch.Tensor]]


def run(
    directory: str,
    options: dict[str, Any],
    *,
    resume: bool = False,
    dropout: float = 0.1,
    background: bool = False,
    reseed: bool = False,
) -> Run:
    """STEPS steps of AdamW under a StepLR, saving at SAVED_AT (or resuming there): the losses, the global samples
    each step read (every replica's together) and this rank's final parameters (a shard: its local part). fp16: the
    loss scale doubles after every good step (the scaler is an extra: a small gradient's fp16 rounding depends on
    it)."""
    engine = PipelineEngine(model(dropout), F.mse_loss, **{"num_microbatches": 4, **options})
    if engine.scaler.enabled:
        engine.scaler.scale, engine.scaler.growth_interval = 2.0**13, 1
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    data = ReplicaLoader(dataset(), batch_size=8, replicas=engine.data_parallel, rank=engine.dp_rank, seed=1)
    start = 0
    if resume:
        start = engine.load(directory, optimizer, scheduler=scheduler, data=data, scaler=engine.scaler)["step"]
        if reseed:  # the negative control: what a resume without the generators' state draws
            torch.manual_seed(1234 + ranks.rank())
            random.seed(1234 + ranks.rank())
    losses, read, pending = [], [], None
    batches = data.forever()
    for step in range(start, STEPS):
        x, y, index = next(batches)
        losses.append(engine.train_step(x if engine.first else None, y if engine.last else None))
        engine.scaler.step(optimizer)  # (without fp16: optimizer.step())
        engine.scaler.update()
        scheduler.step()
        optimizer.zero_grad()
        shares = dict(ranks.all_gather_object((engine.dp_rank, index.tolist())))  # every rank of a replica reads its
        read.append(sorted(i for share in shares.values() for i in share))  # replica's share: once each
        if step + 1 == SAVED_AT and not resume:
            pending = engine.save(
                directory,
                optimizer,
                background=background,
                scheduler=scheduler,
                data=data,
                scaler=engine.scaler,
                step=step + 1,
            )
    if background:
        assert pending is not None and pending.result() == latest_checkpoint(directory)  # type: ignore[union-attr]
    weights = {name: local(p).detach().clone() for name, p in engine.named_parameters()}
    return losses, read, {**weights, "Python's random": torch.tensor(random.random(), dtype=torch.float64)}


def equal_resume(directory: str, options: dict[str, Any], background: bool = False) -> None:
    """Every loss and every parameter after the resume equals (torch.equal) the uninterrupted run's, and so does the
    next draw of Python's random (restored with the generators)."""
    losses, read, weights = run(directory, options, background=background)
    again, read_again, resumed = run(directory, options, resume=True)
    what = f"{options} background={background}"
    assert again == losses[SAVED_AT:], f"{what}: losses {again} after the resume, {losses[SAVED_AT:]} uninterrupted"
    assert read_again == read[SAVED_AT:], f"{what}: the resumed run read other samples"
    differ = [name for name in weights if not torch.equal(weights[name], resumed[name])]
    assert weights.keys() == resumed.keys() and not differ, f"{what}: parameters differ after the resume: {differ}"


def tp_plan() -> dict[str, object]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"*.0": ColwiseParallel(), "*.3": RowwiseParallel()}


DP2 = {"data_parallel": 2}
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "v-half", "v-min", "dualpipe-v"]


def failing_write(directory: str) -> None:
    """Rank 1's background write of the second checkpoint fails (its generators' file): `latest` stays on the
    first, whose files are all there, and the next call raises on every rank, naming the rank and the fault."""
    from pipeengine.train import extras

    engine = PipelineEngine(model(0.1), F.mse_loss, num_microbatches=2, schedule="1f1b")
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    engine.save(directory, optimizer, step=1)
    kept = extras.write_atomically
    if ranks.rank() == 1:

        def broken(path: Path, write: Any) -> None:
            raise OSError("disk full (planted)")

        extras.write_atomically = broken  # type: ignore[assignment]
    try:
        engine.save(directory, optimizer, background=True, step=2)  # returns: the write fails in its thread
        with pytest.raises(
            OSError,
            match=r"checkpoint-2 failed \(rank 1: OSError: disk full \(planted\)\).*"
            r"'latest' still points at checkpoint-1",
        ):
            engine.load(directory, optimizer)
        engine.save(directory, optimizer, background=True, step=2)  # fails again; the next save raises it
        with pytest.raises(OSError, match=r"checkpoint-2 failed \(rank 1: OSError: disk full \(planted\)\)"):
            engine.save(directory, optimizer, background=True, step=3)
    finally:
        extras.write_atomically = kept  # type: ignore[assignment]
    assert latest_checkpoint(directory) == Path(directory) / "checkpoint-1"
    assert not (Path(directory) / "checkpoint-2").exists()  # the partial one is removed
    assert engine.load(directory, optimizer)["step"] == 1  # the previous one loads, whole


def refused(directory: str) -> None:
    """What cannot be saved or resumed is refused on every rank at once (and the ranks stay in step), a refused load
    changes nothing; a rank whose optimizer group is empty (the first layer's own learning rate) saves and loads."""
    import threading

    engine = PipelineEngine(model(0.1), F.mse_loss, num_microbatches=2, schedule="1f1b")
    first = {id(p) for p in engine.stages[min(engine.stages)].parameters()} if ranks.rank() == 0 else set()
    groups = [
        {"params": [p for p in engine.parameters() if id(p) in first], "lr": 0.01},
        {"params": [p for p in engine.parameters() if id(p) not in first]},
    ]
    optimizer = torch.optim.SGD(groups, lr=0.1)  # rank 1's first group holds nothing
    for value, kind in ((threading.Lock(), "a lock"), (Path("x"), "a PosixPath")):
        with pytest.raises(TypeError, match=rf"extra 'odd' is {kind}, which a resume could not load"):
            engine.save(directory, optimizer, odd=value)
    with pytest.raises(OSError, match=r"cannot save into .*: rank 0 cannot read it \(NotADirectoryError"):
        engine.save(f"{__file__}/under-a-file", optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    engine.save(directory, optimizer, scheduler=scheduler, step=3)
    before = {name: p.detach().clone() for name, p in engine.named_parameters()}
    with torch.no_grad():
        for p in engine.parameters():
            p.add_(1.0)
    with pytest.raises(KeyError, match=r"holds no extra named data \(it holds: scheduler, step\)"):
        engine.load(directory, optimizer, data=None)
    with pytest.raises(TypeError, match=r"extra 'scheduler' was saved from an object with state_dict\(\); pass"):
        engine.load(directory, optimizer, scheduler=5)
    assert all(not torch.equal(p, before[name]) for name, p in engine.named_parameters())  # nothing was loaded
    assert engine.load(directory, optimizer, scheduler=scheduler)["step"] == 3
    assert all(torch.equal(p, before[name]) for name, p in engine.named_parameters())
    assert [g["lr"] for g in optimizer.param_groups] == [0.01, 0.1]


@pytest.mark.timeout(300)
@on_ranks(2, timeout=120)
def test_every_schedule_resumes_exactly_and_a_failed_write_moves_nothing(tmp_path: Path) -> None:
    """On 2 ranks (pp=2), every schedule, every other one saving in the background; then the negative control:
    without the generators' state the dropout draws otherwise, and the test sees it; then a failing write."""
    for index, schedule in enumerate(SCHEDULES):
        equal_resume(f"{tmp_path}/{index}", {"schedule": schedule}, background=index % 2 == 1)
    equal_resume(f"{tmp_path}/fp16", {"schedule": "1f1b", "precision": "fp16"})  # the loss scale resumes too
    losses, _, _ = run(f"{tmp_path}/control", {"schedule": "1f1b"})
    again, _, _ = run(f"{tmp_path}/control", {"schedule": "1f1b"}, resume=True, reseed=True)
    assert again != losses[SAVED_AT:], "reseeding after the load changed nothing: the dropout draws nothing here"
    failing_write(f"{tmp_path}/fault")
    refused(f"{tmp_path}/refused")


@pytest.mark.timeout(300)
@on_ranks(4, timeout=120)
def test_replicas_fsdp_and_tp_resume_exactly_and_another_layout_reads_the_same_samples(tmp_path: Path) -> None:
    """On 4 ranks: dp=2 x pp=2, fsdp=True (the sharded format, in the background and not), tensor_parallel=2 x
    pp=2. Then saved on dp=2 x pp=2, resumed on dp=1 x pp=4 and dp=4 x pp=1: the same global samples, the same
    losses within float32's tolerance (no dropout: another layout draws otherwise)."""
    for index, (options, background) in enumerate(
        [
            ({**DP2, "schedule": "1f1b"}, True),
            ({**DP2, "schedule": "1f1b", "fsdp": True}, True),
            ({**DP2, "schedule": "zb-h1", "fsdp": True}, False),
            ({"schedule": "1f1b", "tensor_parallel": 2, "tp_plan": tp_plan()}, True),
        ]
    ):
        equal_resume(f"{tmp_path}/{index}", options, background)
    losses, read, _ = run(f"{tmp_path}/layouts", {**DP2, "schedule": "1f1b"}, dropout=0.0)
    for options in ({"schedule": "1f1b"}, {"data_parallel": 4, "schedule": "gpipe", "num_microbatches": 2}):
        again, read_again, _ = run(f"{tmp_path}/layouts", options, resume=True, dropout=0.0)
        assert read_again == read[SAVED_AT:], f"{options}: read {read_again}, the uninterrupted run {read[SAVED_AT:]}"
        for step, (a, b) in enumerate(zip(again, losses[SAVED_AT:], strict=True)):
            close(a, b, f"{options}: the loss {step} steps after the resume")
