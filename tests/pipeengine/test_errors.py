"""Bad input gets a clear error on every rank, and a failing rank stops them all: never a hang."""

import multiprocessing
import os
import re
import signal
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

from pipeengine import LaunchError, PeerError, PipelineEngine, PipelineError, launch
from pipeengine.comm.calls import CallMismatch
from schedules import build_schedule
from tests.pipeengine import ranks
from tests.pipeengine.models import mlp, mse
from tests.pipeengine.ranks import on_ranks

# ---- rank functions that go wrong on purpose


class Fault(nn.Module):
    """Identity, except on one rank at its n-th call: raise, die, hang, or lie about its shape."""

    def __init__(self, rank: int, at_call: int, how: str) -> None:
        super().__init__()
        self.rank, self.at_call, self.how, self.calls = rank, at_call, how, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            return x
        if self.how == "shape":
            return x[:, :-1]  # real output narrower than the meta device said
        if ranks.rank() != self.rank:
            return x
        self.calls += 1
        if self.calls == self.at_call:
            if self.how == "raise":
                raise RuntimeError(f"planted failure in a layer on rank {self.rank}")
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "hang":
                time.sleep(3600)
        return x


def train_with_fault(rank: int, how: str, timeout: float) -> None:
    """4 ranks, 1F1B, 8 micro-batches; the Fault sits in ``rank``'s stage and strikes at its 3rd call."""
    layers = list(mlp(layers=4))  # 9 layers; with the Fault 10, split uniformly as [0,2) [2,5) [5,7) [7,10)
    at = {0: 1, 1: 3, 2: 5, 3: 8}[rank]
    model = nn.Sequential(*layers[:at], Fault(rank, 3, how), *layers[at:])
    engine = PipelineEngine(model, mse, num_microbatches=8, schedule="1f1b", partition="uniform", timeout=timeout)
    x, y = torch.randn(16, 16), torch.randn(16, 4)
    engine.train_step(x if engine.first else None, y if engine.last else None)


def construct(case: str) -> None:
    """Engines that must be refused, identically, on every rank."""
    world = ranks.size()
    if case == "not_sequential":
        PipelineEngine(nn.ModuleList([nn.Linear(2, 2)]), mse, num_microbatches=4)  # type: ignore[arg-type]
    elif case == "more_stages_than_layers":
        torch.manual_seed(0)  # in-process ranks build it one at a time (pipeengine.comm.loopback): alike everywhere
        PipelineEngine(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)), mse, num_microbatches=4)
    elif case == "interleaved_needs_more_microbatches":
        PipelineEngine(mlp(), mse, num_microbatches=world // 2, schedule="interleaved")
    elif case == "schedule_for_another_world":
        PipelineEngine(mlp(), mse, num_microbatches=4, schedule=build_schedule("1f1b", world * 2, 4))
    elif case == "partition_does_not_fit":
        PipelineEngine(mlp(), mse, num_microbatches=4, partition=[1] * (world + 1))
    elif case == "dp_does_not_divide":
        PipelineEngine(mlp(), mse, num_microbatches=4, data_parallel=3)
    else:
        raise AssertionError(case)


def bad_batch(case: str) -> None:
    """Steps that every rank must refuse together, before any transfer."""
    engine = PipelineEngine(mlp(), mse, num_microbatches=4, schedule="1f1b")
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    if case == "no_targets":
        engine.train_step(x if engine.first else None, None)
    elif case == "uneven":
        engine.train_step(torch.randn(10, 16) if engine.first else None, torch.randn(10, 4) if engine.last else None)
    elif case == "rows_disagree":
        engine.train_step(x if engine.first else None, y[:6] if engine.last else None)
    elif case == "inputs_not_tensors":
        engine.train_step([1, 2, 3] if engine.first else None, y if engine.last else None)
    elif case == "smaller_than_m":
        engine.train_step(torch.randn(2, 16) if engine.first else None, torch.randn(2, 4) if engine.last else None)
    elif case == "scalar_input":
        engine.train_step(torch.tensor(1.0) if engine.first else None, y if engine.last else None)
    elif case == "empty":
        engine.train_step(torch.randn(0, 16) if engine.first else None, torch.randn(0, 4) if engine.last else None)
    elif case == "empty_eval":
        engine.eval_step(torch.randn(0, 16) if engine.first else None)
    else:
        raise AssertionError(case)


# ---- the tests


def test_not_a_sequential_is_refused_before_anything_else() -> None:
    with pytest.raises(TypeError, match=r"splits an nn.Sequential into stages, got ModuleList"):
        PipelineEngine(nn.ModuleList([nn.Linear(2, 2)]), mse, num_microbatches=2)  # type: ignore[arg-type]


def test_without_torch_distributed_it_says_how_to_start() -> None:
    with pytest.raises(RuntimeError, match=r"pipeengine.launcher.launch\(fn, nprocs=N\) or torchrun"):
        PipelineEngine(nn.Sequential(nn.Linear(2, 2)), mse, num_microbatches=2)


def refused_here(run: Callable[[str], None], case: str, error: type[Exception], message: str) -> None:
    """``run(case)`` raises the expected error on this rank (every rank runs it: none may hang)."""
    with pytest.raises(error, match=message) as caught:
        run(case)
    assert caught.type is error, caught.value  # that class, not a subclass of it
    ranks.barrier()  # every rank refused it, and none is left waiting


@pytest.mark.timeout(120)
def test_bad_construction_is_refused_on_every_rank_and_the_launch_names_each() -> None:
    with pytest.raises(ValueError, match="4 stages but the model has 3 layers") as caught:
        launch(construct, 4, args=("more_stages_than_layers",), timeout=30, in_process=True)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert len(re.findall(r"^  rank \d: ValueError: ", notes, re.M)) == 3  # the same refusal on the others


BAD_CONSTRUCTION = {
    "not_sequential": (TypeError, "got ModuleList"),
    "interleaved_needs_more_microbatches": (ValueError, "must be a multiple of 4, got 2; use 4"),
    "schedule_for_another_world": (ValueError, "schedule is for 8 ranks .* world has 4 ranks"),
    "partition_does_not_fit": (ValueError, "partition lists 5 stages, the schedule has 4"),
    "dp_does_not_divide": (ValueError, "a world of 4 ranks does not split into data_parallel=3 equal"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", BAD_CONSTRUCTION)
@on_ranks(4, timeout=30, in_process=True)
def test_a_bad_construction_is_refused_alike_on_every_rank(case: str) -> None:
    refused_here(construct, case, *BAD_CONSTRUCTION[case])


BAD_BATCH = {
    "no_targets": (ValueError, "step refused by rank 1: the rank of the last stage got no targets"),
    "uneven": (ValueError, "a batch of 10 does not split into 4 equal micro-batches: .* multiple of 4 .*8 or 12"),
    "rows_disagree": (ValueError, "the targets have 6 rows but the inputs 8"),
    "inputs_not_tensors": (ValueError, "step refused by rank 0: the inputs on the first stage's rank are not"),
    "smaller_than_m": (ValueError, r"a batch of 2 does not split into 4 equal micro-batches: .*\(e\.g\. 4\), or"),
    "scalar_input": (ValueError, "the inputs need a batch dimension: inputs tensor 0 is 0-d"),
    "empty": (ValueError, r"train_step got an empty batch: the inputs have shape \[0, 16\] \(0 rows\); pass"),
    "empty_eval": (ValueError, r"eval_step got an empty batch: the inputs have shape \[0, 16\]"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", BAD_BATCH)
@on_ranks(2, timeout=10, in_process=True)  # no hang
def test_a_bad_batch_is_refused_by_every_rank_before_any_transfer(case: str) -> None:
    refused_here(bad_batch, case, *BAD_BATCH[case])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank, in_process", [(0, True), (2, False), (3, True)])
def test_a_rank_raising_mid_step_stops_every_rank_with_its_error(rank: int, in_process: bool) -> None:
    with pytest.raises(
        PipelineError,
        match=rf"rank {rank}, instruction \d+ of training step 0: {rank}F\d \(stage {rank}, micro-batch \d\): "
        r"RuntimeError: planted failure",
    ) as caught:
        # 600 s of timeout: only the peers noticing the failure can stop them within the test's own timeout
        launch(train_with_fault, 4, args=(rank, "raise", 600.0), timeout=600, in_process=in_process)
    notes = "\n".join(caught.value.__notes__)
    assert f"rank {rank} of 4 is the cause" in notes
    assert "waiting for" in notes  # what the other ranks were waiting on when it went
    assert not multiprocessing.active_children()


@pytest.mark.timeout(120)
def test_a_killed_rank_is_named_and_the_others_stop() -> None:
    with pytest.raises(LaunchError, match=r"rank 1 died from signal SIGKILL") as caught:
        launch(train_with_fault, 4, args=(1, "kill", 600.0), timeout=600)  # the peers notice the death
    assert "PeerError: rank 0, instruction" in str(caught.value) and "from rank 1" in str(caught.value)
    assert not multiprocessing.active_children()


def die_while_the_other_computes() -> None:
    """Rank 1 dies at once, without a report; rank 0 is in a long compute (no collective would tell it)."""
    if ranks.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


@pytest.mark.timeout(60)
def test_a_rank_dead_without_a_report_stops_the_others_at_once_not_when_they_finish() -> None:
    with pytest.raises(LaunchError, match=r"rank 1 died from signal SIGKILL") as caught:
        launch(die_while_the_other_computes, 2, timeout=120, grace=1)
    assert "rank 0: was still running 1 s after the first failure and was stopped" in str(caught.value)


@pytest.mark.timeout(120)
def test_a_hung_rank_is_found_by_the_timeout_and_stopped() -> None:
    with pytest.raises(LaunchError, match=r"rank 2 was still running .* and was stopped") as caught:
        launch(train_with_fault, 4, args=(2, "hang", 2.0), timeout=2, grace=1)
    # a neighbour gave up once its 2 s had passed: a wait never ends before its timeout, so the time it reports is at
    # least 2 s whatever the machine's load (a lower bound only: a loaded machine may take longer to notice)
    waited = [float(s) for s in re.findall(r"failed after (\d+\.\d) s", str(caught.value))]
    assert waited and max(waited) >= 2.0, str(caught.value)
    assert not multiprocessing.active_children()


@pytest.mark.timeout(120)
def test_an_output_that_differs_from_the_inferred_shape_is_caught_before_sending() -> None:
    with pytest.raises(
        PipelineError,
        match=r"rank 0, instruction \d+ of training step 0: 0F0 \(stage 0, micro-batch 0\): ValueError: "
        r"stage 0 produced float32\[2, 15\]"
        r".*expects float32\[2, 16\]",
    ) as caught:
        launch(train_with_fault, 4, args=(0, "shape", 60.0), timeout=60, in_process=True)
    assert "PeerError" in "\n".join(caught.value.__notes__)


def test_peer_error_is_a_pipeline_error() -> None:
    assert issubclass(PeerError, PipelineError)


@pytest.mark.timeout(60)
@on_ranks(4, timeout=20, in_process=True)
def test_a_batch_one_replica_refuses_is_refused_by_every_replica() -> None:
    """dp=2 x pp=2: the second replica's batch is empty (then uneven), the first's is good; every rank of the world
    refuses the step, and the next good step trains on every rank (no replica was left a collective behind)."""
    engine = PipelineEngine(mlp(), mse, num_microbatches=2, schedule="1f1b", data_parallel=2)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    for bad in (0, 3):
        rows = bad if engine.dp_rank == 1 else 4
        with pytest.raises(ValueError, match=r"(empty batch|a batch of 3 does not split).*"):
            engine.train_step(x[:rows] if engine.first else None, y[:rows] if engine.last else None)
    loss = engine.train_step(x if engine.first else None, y if engine.last else None)
    assert len(set(ranks.all_gather_object(loss))) == 1  # both replicas took the same batch: one mean loss
    with pytest.raises(CallMismatch, match=r"ranks of the world are not making the same call: .*called save"):
        if engine.dp_rank == 1:
            engine.save("unused")
        else:
            engine.train_step(x if engine.first else None, y if engine.last else None)
